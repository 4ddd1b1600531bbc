"""vLLM's OpenAI API server (``python -m vllm.entrypoints.openai.api_server``) as a child process
on 127.0.0.1, the way a user serves: with vLLM's own prefix cache on, and with or without
mmtier's KV and encoder-cache connectors (named with their sizes only: the cache's shape comes
from vLLM, ``mmtier.engines.vllm.shape``). The demo and ``benchmarks/engines/serving_load.py``
start their engines here. Everything the server prints goes to a log file, never the console.

``EngineSpec`` is what to start; ``EngineServer`` starts it, waits for ``/health``, counts the
encoder towers' items from outside the engine (``encoded()``, through ``/collective_rpc`` and
``mmtier.demo.worker_ext``), closes the workers' mmtier caches (``close_caches()``: what they hold
goes to the disk tier) and stops it: SIGTERM (vLLM drains and shuts its engine core down) or,
after a grace period, SIGKILL of its process group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .model import DTYPE, TOKEN_KV_BYTES

BLOCK = 32                          # vLLM's CPU backend: a multiple of 32


@dataclass(frozen=True)
class EngineSpec:
    name: str                       # "plain" / "mmtier": the served model name too
    model: str                      # the saved model's folder
    kv_blocks: int                  # vLLM's KV block pool, in blocks of BLOCK tokens
    max_model_len: int = 2048
    images_per_prompt: int = 8
    mm_limits: dict | None = None   # items per prompt by medium (None: images_per_prompt images)
    token_kv_bytes: int = TOKEN_KV_BYTES   # the model's KV bytes a token (sizes the block pool)
    mmtier: dict | None = None      # the connectors' extra config (sizes only), None: plain vLLM
    encoder_cache: bool = True      # with mmtier: its encoder-cache connector beside the KV one
    max_num_seqs: int = 8
    # SIGTERM drains for this long and the engine's processes exit (caches close); None: vLLM's
    # defaults (no drain; its workers are killed, the caches' write-behind made them durable)
    shutdown_timeout_s: int | None = 120
    python: str = sys.executable    # the engines environment's interpreter
    extra_env: dict = field(default_factory=dict)

    def argv(self, port: int) -> list[str]:
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--served-model-name", self.name, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", DTYPE, "--block-size", str(BLOCK), "--max-model-len", str(self.max_model_len),
                "--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-cache-memory-bytes", str(self.kv_blocks * BLOCK * self.token_kv_bytes),
                "--limit-mm-per-prompt", json.dumps(self.mm_limits or {"image": self.images_per_prompt}),
                "--max-num-seqs", str(self.max_num_seqs), "--seed", "0", "--disable-uvicorn-access-log",
                "--worker-extension-cls", "mmtier.demo.worker_ext.DemoWorker"]
        if self.shutdown_timeout_s is not None:
            args += ["--shutdown-timeout", str(self.shutdown_timeout_s)]
        if self.mmtier is not None:
            args += ["--kv-transfer-config", json.dumps({
                "kv_connector": "MMTierConnector", "kv_connector_module_path": "mmtier.engines.vllm.connector",
                "kv_role": "kv_both", "kv_connector_extra_config": self.mmtier})]
        if self.mmtier is not None and self.encoder_cache:
            args += ["--ec-transfer-config", json.dumps({
                "ec_connector": "MMTierECConnector", "ec_connector_module_path": "mmtier.engines.vllm.ec",
                "ec_role": "ec_both", "ec_connector_extra_config": self.mmtier})]
        return args


def mmtier_sizes(disk_dir: str | Path, *, device_bytes: int, host_bytes: int, disk_bytes: int = 4 << 30,
                 chunk_blocks: int | None = None) -> dict:
    """The connectors' extra config: sizes and the disk tier's folder, nothing of the shape
    (``chunk_blocks``: blocks per text group, the connector's default where None)."""
    extra = {"mmtier_device_bytes": device_bytes, "mmtier_host_bytes": host_bytes,
             "mmtier_disk_dir": str(disk_dir), "mmtier_disk_bytes": disk_bytes, "mmtier_disk_free_floor_bytes": 0}
    if chunk_blocks is not None:
        extra["mmtier_chunk_blocks"] = chunk_blocks
    return extra


def same_cores_env() -> dict:
    """The OpenMP set-up every engine here starts with (the caller's environment wins): its
    threads on all the CPUs this process may use, and idle threads asleep at once.

    vLLM's CPU build binds its threads itself ('auto'): it keeps cores back for the scheduler
    and one more per worker where a KV connector is configured, so on a 2-core machine a plain
    engine ran one thread on core 0 and an engine with mmtier two threads on cores 0-1, both
    on core 0. The engines of a comparison must run alike, and not spin on each other's cores
    once a step is over (libgomp's default waits actively)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "OMP_WAIT_POLICY": "PASSIVE"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineServer:
    """One API server process. ``start()`` returns at once; ``wait_ready()`` blocks until it
    answers ``/health`` (or raises ``RuntimeError`` with the log's tail if it exits)."""

    def __init__(self, spec: EngineSpec, log_path: Path, port: int | None = None):
        self.spec, self.log_path = spec, Path(log_path)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self._terminated = False
        self.started_at = 0.0
        self.ready_s = float("nan")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EngineServer:
        env = {**same_cores_env(), **os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO",
               "TOKENIZERS_PARALLELISM": "false", **self.spec.extra_env}
        if self.spec.shutdown_timeout_s is not None:
            env["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] = str(self.spec.shutdown_timeout_s)
        else:
            env.pop("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", None)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)          # the pool is --kv-cache-memory-bytes
        with open(self.log_path, "a") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} start {self.spec.name}: "
                      f"{' '.join(self.spec.argv(self.port))}\n")
            log.flush()
            self.proc = subprocess.Popen(self.spec.argv(self.port), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self._terminated = False
        self.started_at = time.perf_counter()
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        import httpx

        deadline = self.started_at + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.spec.name} exited with {self.proc.returncode}; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    self.ready_s = time.perf_counter() - self.started_at
                    return self.ready_s
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"engine {self.spec.name} not ready in {timeout_s:.0f} s; log {self.log_path}")

    def encoded(self) -> int:
        """Items the model's encoder towers encoded since the last call (images, videos or
        audio clips; summed over the workers)."""
        return sum(int(x) for x in self._rpc("mmtier_encoded"))

    def _rpc(self, method: str, timeout_s: float = 120.0) -> list:
        import httpx

        r = httpx.post(self.base_url + "/collective_rpc", json={"method": method, "timeout": timeout_s},
                       timeout=timeout_s + 30)
        r.raise_for_status()
        return r.json()["results"]

    def cache_counters(self) -> list[dict]:
        """The counters of every mmtier cache the workers have open (one dict per cache)."""
        return [c for per_worker in self._rpc("mmtier_counters") for c in per_worker]

    def close_caches(self) -> int:
        """Close the workers' mmtier caches (written to the disk tier); the caches opened."""
        return sum(int(x) for x in self._rpc("mmtier_close", 300.0))

    def terminate(self) -> None:
        """SIGTERM, once: vLLM drains and shuts its engine core down (``stop`` waits for it)."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, grace_s: float = 180.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        # vLLM's engine core is a child of the server: wait for the group to be gone
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    @staticmethod
    def stop_all(servers) -> None:
        """Stop ``servers`` side by side: each is sent SIGTERM, then each is waited for."""
        servers = list(servers)
        for s in servers:
            s.terminate()
        for s in servers:
            s.stop()

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
