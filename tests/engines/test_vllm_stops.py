"""Stopped the way servers are stopped, nothing saved is lost (issue 50): real vLLM OpenAI API
servers (``python -m vllm.entrypoints.openai.api_server``, vLLM's default shutdown settings: no
``--shutdown-timeout``, no close RPC) with MMTierConnector given sizes and a ``disk_dir`` only,
vLLM's prefix cache on, stopped by

(a) SIGINT to the server's process group (Ctrl-C),
(b) SIGTERM to the main process (``docker stop``, Kubernetes),
(c) SIGKILL of every process a few seconds after the last answer (a crash, the OOM killer),
(d) SIGKILL of every process during a burst of saves.

vLLM kills its workers on the way out without calling the connector's ``shutdown``: what the
caches held reaches the disk only through the write-behind (``mmtier.tiers.durability``, lag
bound 1 s by default). After each stop a server restarted over the same ``disk_dir`` serves the
prompt answered before it (more than the lag before the stop) from mmtier: the cached tokens
it reports (``usage.prompt_tokens_details.cached_tokens``; vLLM's own prefix cache is empty
after a restart) equal what vLLM's own prefix cache gave for the repeat before the stop, and
every answer equals plain vLLM's. After the burst's kill nothing half-written is found: no
temporary file survives the restart, nothing is quarantined, no corrupt read.

One chain of server starts serves the four stops (each start costs about a minute on 2
cores): start 1 answers A1 and is stopped by (a); start 2 serves A1 again, answers A2, (b);
start 3: A2, A3, (c); start 4: A3, A4, then a burst of new prompts and (d); start 5 serves A4
and the burst's prompts. Plain vLLM answers every prompt once, as the oracle.

Needs the engines environment (``./run engines``); skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.openai.api_server", reason="no vLLM engine here: run ./run engines "
                    "(vLLM's CPU build in .venv-engines); ./run test then runs this file there")

import httpx  # noqa: E402
import psutil  # noqa: E402

from mmtier.demo.engines import EngineServer, EngineSpec, mmtier_sizes  # noqa: E402
from mmtier.serve.tiny_models import ensure_tiny_llava, text  # noqa: E402

PROMPT_WORDS = 640
MAX_TOKENS = 8
LAG_S = 1.0                       # the write-behind's default bound (``durable_lag_s``)
SETTLE_S = 4.0                    # the wait after the last answer before a stop: beyond the lag
BURST = 6                         # prompts of the burst during which (d) kills the server


def token_kv_bytes(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    return 2 * t["num_hidden_layers"] * t["num_key_value_heads"] * head_dim * 4      # float32


def spec(name: str, model: Path, disk: Path | None) -> EngineSpec:
    mm = None if disk is None else mmtier_sizes(disk, device_bytes=64 << 20, host_bytes=16 << 20,
                                                disk_bytes=1 << 30)
    return EngineSpec(name=name, model=str(model), kv_blocks=256, token_kv_bytes=token_kv_bytes(model),
                      images_per_prompt=1, mmtier=mm, encoder_cache=False, max_num_seqs=8,
                      shutdown_timeout_s=None)          # vLLM's default shutdown: no drain


def ask(server: EngineServer, prompt: str) -> dict:
    r = httpx.post(server.base_url + "/v1/completions", timeout=300.0, json={
        "model": server.spec.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "logprobs": 1})
    r.raise_for_status()
    body = r.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    choice = body["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]["token_logprobs"],
            "cached": int(details.get("cached_tokens") or 0), "at": time.monotonic()}


def processes(server: EngineServer) -> list[psutil.Process]:
    """The server and every process under it (vLLM's engine core, its workers)."""
    main = psutil.Process(server.proc.pid)
    return [main, *main.children(recursive=True)]


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return alive


def stop(server: EngineServer, how: str) -> dict:
    """Stop ``server`` the way ``how`` says and wait for all its processes to be gone."""
    procs = processes(server)
    t0 = time.monotonic()
    if how == "sigint":
        os.killpg(server.proc.pid, signal.SIGINT)
    elif how == "sigterm":
        server.proc.send_signal(signal.SIGTERM)
    else:
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    left = wait_gone(procs, 180.0)
    for p in left:                      # a stop that hangs is reported, then cleaned up
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    server.proc.wait(30)
    return {"exited_by_itself": not left, "stop_s": time.monotonic() - t0, "processes": len(procs)}


def start(name: str, model: Path, disk: Path | None, logs: Path) -> EngineServer:
    server = EngineServer(spec(name, model, disk), logs / f"{name}.log").start()
    server.wait_ready(900.0)
    return server


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("stops")
    model = ensure_tiny_llava(os.environ.get("MMTIER_MODELS") or root / "models")
    disk = root / "disk"
    prompts = {f"A{i}": text(500 + i, PROMPT_WORDS) for i in range(1, 5)}
    burst = [text(600 + i, PROMPT_WORDS) for i in range(BURST)]
    out: dict = {"disk": disk, "logs": root}
    plain = start("plain", model, None, root)
    try:
        out["plain"] = {name: ask(plain, p) for name, p in prompts.items()}
        out["plain_burst"] = [ask(plain, p) for p in burst]
    finally:
        plain.stop()
    runs: list[dict] = []
    server = None
    try:
        for i, how in enumerate(("sigint", "sigterm", "kill_idle", "kill_burst", None), start=1):
            server = start("mmtier", model, disk, root)
            run: dict = {"how": how}
            if i > 1:                                # the prompt answered before the last stop
                run["again"] = ask(server, prompts[f"A{i - 1}"])
            if how is None:
                run["burst_again"] = [ask(server, p) for p in burst]
                run["tmp_files"] = sorted(p.name for p in disk.rglob("*.tmp"))
                quarantine = disk / "quarantine"
                run["quarantined"] = sorted(p.name for p in quarantine.iterdir()) if quarantine.exists() else []
                run["metrics"] = httpx.get(server.base_url + "/metrics", timeout=30).text
                server.stop()
                runs.append(run)
                break
            run["first"] = ask(server, prompts[f"A{i}"])
            run["repeat"] = ask(server, prompts[f"A{i}"])          # vLLM's own prefix cache: the bar
            if how == "kill_burst":
                time.sleep(SETTLE_S)                                # A4 is durable; then the burst
                answered: list[dict] = []

                def one(p: str, answered=answered, server=server) -> None:
                    try:
                        answered.append(ask(server, p))
                    except httpx.HTTPError:
                        pass                                        # killed mid-answer

                threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in burst]
                for t in threads:
                    t.start()
                deadline = time.monotonic() + 300
                while len(answered) < 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
                run["burst_answered_before_kill"] = len(answered)
                run["tmp_at_kill"] = len(list(disk.rglob("*.tmp")))
                run["stop"] = stop(server, "kill")
                for t in threads:
                    t.join(60)
            else:
                time.sleep(SETTLE_S)
                run["stop"] = stop(server, "kill" if how == "kill_idle" else how)
            run["files_after_stop"] = len(list(disk.glob("*.arrow")))
            runs.append(run)
            server = None
    finally:
        if server is not None:
            server.stop()
    out["runs"] = runs
    (root / "chain.json").write_text(json.dumps(   # what each start saw, for a reader of a failure
        [{k: v for k, v in r.items() if k != "metrics"} for r in runs], indent=1, default=str))
    return out


def check_restart(chain: dict, index: int) -> None:
    """Start ``index + 1`` serves the prompt start ``index`` answered, from mmtier, as plain vLLM."""
    before, after = chain["runs"][index - 1], chain["runs"][index]
    want = chain["plain"][f"A{index}"]
    assert before["first"]["text"] == want["text"] and before["repeat"]["text"] == want["text"]
    assert before["repeat"]["cached"] > 0
    assert before["files_after_stop"] > 0
    got = after["again"]
    # vLLM's own cache is empty after a restart: every cached token came through the connector,
    # from the disk tier, as many as vLLM's prefix cache gave for the repeat before the stop
    assert got["cached"] == before["repeat"]["cached"], (before["how"], got, before["repeat"])
    assert got["text"] == want["text"]


def test_ctrl_c_to_the_process_group_keeps_what_was_saved(chain):
    assert chain["runs"][0]["how"] == "sigint"
    check_restart(chain, 1)


def test_sigterm_to_the_main_process_with_vllms_default_shutdown_keeps_what_was_saved(chain):
    assert chain["runs"][1]["how"] == "sigterm"
    assert chain["runs"][1]["stop"]["exited_by_itself"]
    check_restart(chain, 2)


def test_sigkill_of_every_process_after_the_last_answer_keeps_what_was_saved(chain):
    assert chain["runs"][2]["how"] == "kill_idle"
    check_restart(chain, 3)


def test_sigkill_during_a_burst_of_saves_keeps_what_was_saved_and_leaves_nothing_half_written(chain):
    killed, last = chain["runs"][3], chain["runs"][4]
    assert killed["how"] == "kill_burst" and killed["burst_answered_before_kill"] >= 2
    check_restart(chain, 4)
    # the burst's prompts: whatever the restart found of them, the answers are plain vLLM's
    for got, want in zip(last["burst_again"], chain["plain_burst"]):
        assert got["text"] == want["text"]
    assert last["tmp_files"] == [] and last["quarantined"] == []
    corrupt = [line for line in last["metrics"].splitlines()
               if line.startswith("vllm:mmtier_cache_events_total") and 'event="corrupt_reads"' in line
               and not line.rstrip().endswith(" 0.0")]
    assert corrupt == []
