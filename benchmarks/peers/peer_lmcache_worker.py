"""LMCache's side of ``benchmarks/peers/peer_lmcache.py``, run in LMCache's own environment.

``.venv-lmcache/bin/python benchmarks/peers/peer_lmcache_worker.py`` (``benchmarks/peers/peers_env.sh`` makes
that venv). It imports LMCache and torch only (never mmtier), reads one JSON command per line on
stdin and answers one JSON object per line on stdout (LMCache's own logging goes to stderr):
no pickle either way. The KV is made here from the same seeds as mmtier's side (the same torch
build), so both store the same bytes, and every read is compared bitwise with them.

LMCache ships no connector that runs without a GPU; ``CPUConnector`` is the smallest one that
does: ``from_gpu`` copies a chunk's K and V out of a ``[2, layers, tokens, heads, head_dim]``
tensor into the memory object (``KV_2LTD``), ``to_gpu`` copies it back into another.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time

import torch

try:                                   # as a module of the benchmarks package (mmtier's side)
    from benchmarks.file_faults import damage, drop_cache
except ImportError:                    # as a script in LMCache's environment: benchmarks/ on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from file_faults import damage, drop_cache


def group_kv(seed: int, i: int, layers: int, tokens: int, heads: int, head_dim: int):
    """The K and V of group ``i`` (``[layers, tokens, heads, head_dim]`` bf16), made exactly as
    ``peer_lmcache.group_kv`` makes them."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    k = torch.randn(layers, tokens, heads, head_dim, generator=g).to(torch.bfloat16)
    v = torch.randn(layers, tokens, heads, head_dim, generator=g).to(torch.bfloat16)
    return k, v


class Peer:
    def __init__(self, groups: int, layers: int, heads: int, head_dim: int, chunk: int, seed: int,
                 workdir: str):
        # LMCache's modules log at import; keep stdout for the JSON answers only
        from lmcache.v1.gpu_connector import GPUConnectorInterface

        self.n, self.L, self.H, self.D, self.C = groups, layers, heads, head_dim, chunk
        self.dir = workdir
        T = groups * chunk
        self.src = torch.empty(2, layers, T, heads, head_dim, dtype=torch.bfloat16)
        for i in range(groups):
            k, v = group_kv(seed, i, layers, chunk, heads, head_dim)
            self.src[0, :, i * chunk:(i + 1) * chunk] = k
            self.src[1, :, i * chunk:(i + 1) * chunk] = v
        self.dst = torch.empty_like(self.src)
        self.tokens = torch.arange(T)
        self.chunk_bytes = 2 * layers * chunk * heads * head_dim * 2
        peer = self

        class CPUConnector(GPUConnectorInterface):
            def from_gpu(self, memory_obj, start, end, **kw):
                memory_obj.tensor.view(2, peer.L, end - start, peer.H, peer.D).copy_(peer.src[:, :, start:end])

            def to_gpu(self, memory_obj, start, end, **kw):
                peer.dst[:, :, start:end].copy_(memory_obj.tensor.view(2, peer.L, end - start, peer.H, peer.D))

            def batched_from_gpu(self, objs, starts, ends, **kw):
                for o, s, e in zip(objs, starts, ends):
                    self.from_gpu(o, s, e)

            def batched_to_gpu(self, objs, starts, ends, **kw):
                for o, s, e in zip(objs, starts, ends):
                    self.to_gpu(o, s, e)

            def get_shape(self, num_tokens):
                return torch.Size([2, peer.L, num_tokens, peer.H * peer.D])

            def initialize_kvcaches_ptr(self, **kw):
                return None

        self.connector_cls = CPUConnector
        self.engines: dict[str, object] = {}

    # ------------------------------------------------------------------ engines
    def engine(self, name: str, *, cpu: bool, disk_dir: str | None, cpu_gib: float, disk_gib: float = 0.0):
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        if name in self.engines:
            return self.engines[name]
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=self.C, local_cpu=cpu, max_local_cpu_size=cpu_gib,
                                                local_disk=disk_dir, max_local_disk_size=disk_gib,
                                                lmcache_instance_id=name)
        md = LMCacheMetadata(model_name="llama-3-8b-shaped", world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=0, kv_dtype=torch.bfloat16,
                             kv_shape=(self.L, 2, self.C, self.H, self.D), chunk_size=self.C)
        eng = LMCacheEngineBuilder.get_or_create(name, cfg, md, self.connector_cls(), lambda *a: None,
                                                 lambda *a: None)
        eng.post_init()
        self.engines[name] = eng
        return eng

    def destroy(self, name: str) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        if self.engines.pop(name, None) is not None:
            LMCacheEngineBuilder.destroy(name)

    def backends(self, eng):
        return eng.storage_manager.storage_backends

    def keys(self, eng):
        return [key for _, _, key in eng.token_database.process_tokens(self.tokens)]

    def chunk_src(self, i: int) -> torch.Tensor:
        return self.src[:, :, i * self.C:(i + 1) * self.C]

    # ------------------------------------------------------------------ storage level
    def tier_host_put(self) -> dict:
        from lmcache.v1.memory_management import MemoryFormat

        eng = self.engine("host", cpu=True, disk_dir=None, cpu_gib=self.n * self.chunk_bytes * 1.5 / 2**30 + 0.25)
        cpu = self.backends(eng)["LocalCPUBackend"]
        keys = self.keys(eng)
        for k in keys:
            cpu.remove(k)
        shape = torch.Size([2, self.L, self.C, self.H * self.D])
        srcs = [self.chunk_src(i).contiguous() for i in range(self.n)]   # contiguous, as mmtier's pages
        t0 = time.perf_counter()
        for key, s in zip(keys, srcs):
            obj = cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            obj.tensor.view(s.shape).copy_(s)
            cpu.submit_put_task(key, obj)
            obj.ref_count_down()
        dt = time.perf_counter() - t0
        return {"s": dt}

    def tier_host_get(self) -> dict:
        eng = self.engine("host", cpu=True, disk_dir=None, cpu_gib=0)
        cpu = self.backends(eng)["LocalCPUBackend"]
        keys = self.keys(eng)
        out = torch.full((self.n, 2, self.L, self.C, self.H, self.D), float("nan"), dtype=torch.bfloat16)
        t0 = time.perf_counter()
        for i, key in enumerate(keys):
            obj = cpu.get_blocking(key)
            out[i].copy_(obj.tensor.view(out[i].shape))
            obj.ref_count_down()
        dt = time.perf_counter() - t0
        ok = all(torch.equal(out[i], self.chunk_src(i)) for i in range(self.n))
        return {"s": dt, "equal": ok}

    def _disk_engine(self):
        d = os.path.join(self.dir, "lmcache-disk")
        os.makedirs(d, exist_ok=True)
        # budget far above what the rounds write: LMCache's remove() never gives bytes back to
        # it (see the probe), so a tight one would refuse later rounds
        return self.engine("disk", cpu=False, disk_dir=d, cpu_gib=self.n * self.chunk_bytes * 1.5 / 2**30 + 0.25,
                           disk_gib=1000.0), d

    def _wait_written(self, disk, keys, timeout: float = 300.0) -> None:
        end = time.monotonic() + timeout
        while not all(disk.contains(k) for k in keys):
            if time.monotonic() > end:
                raise TimeoutError("LMCache disk writes did not finish")
            time.sleep(0.0005)

    def _fsync_files(self, d: str) -> None:
        for name in os.listdir(d):
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def tier_disk_put(self) -> dict:
        from lmcache.v1.memory_management import MemoryFormat

        eng, d = self._disk_engine()
        bk = self.backends(eng)
        disk, cpu = bk["LocalDiskBackend"], bk["LocalCPUBackend"]
        keys = self.keys(eng)
        for k in keys:
            disk.remove(k)
        os.sync()
        shape = torch.Size([2, self.L, self.C, self.H * self.D])
        objs = []
        for i in range(self.n):                # the buffers to write, filled before the clock
            obj = cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            obj.tensor.view(2, self.L, self.C, self.H, self.D).copy_(self.chunk_src(i))
            objs.append(obj)
        t0 = time.perf_counter()
        disk.batched_submit_put_task(keys, objs)
        self._wait_written(disk, keys)
        t_write = time.perf_counter() - t0
        self._fsync_files(d)
        t_durable = time.perf_counter() - t0
        for obj in objs:
            obj.ref_count_down()
        return {"s": t_durable, "s_no_fsync": t_write}

    def tier_disk_cold_read(self) -> dict:
        eng, d = self._disk_engine()
        disk = self.backends(eng)["LocalDiskBackend"]
        keys = self.keys(eng)
        how = drop_cache([os.path.join(d, n) for n in os.listdir(d)])
        t0 = time.perf_counter()
        objs = disk.batched_get_blocking(keys)
        dt = time.perf_counter() - t0
        ok = all(o is not None and torch.equal(o.tensor.view(2, self.L, self.C, self.H, self.D), self.chunk_src(i))
                 for i, o in enumerate(objs))
        for o in objs:
            if o is not None:
                o.ref_count_down()
        return {"s": dt, "equal": ok, "drop": how}

    # ------------------------------------------------------------------ cache level
    def cache_put_host(self) -> dict:
        eng = self.engine("host", cpu=True, disk_dir=None, cpu_gib=0)
        eng.clear()
        cpu = self.backends(eng)["LocalCPUBackend"]
        if any(cpu.contains(k) for k in self.keys(eng)):
            raise RuntimeError("clear() left chunks in LMCache's CPU backend")
        t0 = time.perf_counter()
        eng.store(self.tokens)
        dt = time.perf_counter() - t0
        return {"s": dt}

    def cache_get_host(self) -> dict:
        eng = self.engine("host", cpu=True, disk_dir=None, cpu_gib=0)
        self.dst.fill_(float("nan"))
        t0 = time.perf_counter()
        got = eng.retrieve(self.tokens)
        dt = time.perf_counter() - t0
        return {"s": dt, "equal": bool(got.all()) and torch.equal(self.dst, self.src)}

    def cache_put_disk(self) -> dict:
        eng, d = self._disk_engine()
        disk = self.backends(eng)["LocalDiskBackend"]
        keys = self.keys(eng)
        for k in keys:
            disk.remove(k)
        os.sync()
        t0 = time.perf_counter()
        eng.store(self.tokens)
        self._wait_written(disk, keys)
        t_write = time.perf_counter() - t0
        self._fsync_files(d)
        return {"s": time.perf_counter() - t0, "s_no_fsync": t_write}

    def cache_cold_read(self) -> dict:
        eng, d = self._disk_engine()
        how = drop_cache([os.path.join(d, n) for n in os.listdir(d)])
        self.dst.fill_(float("nan"))
        t0 = time.perf_counter()
        got = eng.retrieve(self.tokens)
        dt = time.perf_counter() - t0
        return {"s": dt, "equal": bool(got.all()) and torch.equal(self.dst, self.src), "drop": how}

    def _poison_free(self, cpu, n: int) -> None:
        """NaN into the free buffers a read will land in (else a short read would leave the
        bytes the store left there, and look right by accident)."""
        from lmcache.v1.memory_management import MemoryFormat

        shape = torch.Size([2, self.L, self.C, self.H * self.D])
        objs = [cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD) for _ in range(n)]
        for o in objs:
            if o is not None:
                o.tensor.fill_(float("nan"))
                o.ref_count_down()

    # ------------------------------------------------------------------ reliability probes
    def probes(self) -> dict:
        """Flip a byte, truncate a file to half, restart over the same directory, and the disk
        budget after ``remove()``: what LMCache's local disk backend does with each."""
        out = {}
        d = os.path.join(self.dir, "lmcache-probe")
        n = min(4, self.n)
        tokens = self.tokens[: n * self.C]
        for probe in ("flip", "truncate"):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            eng = self.engine(f"probe-{probe}", cpu=False, disk_dir=d, cpu_gib=n * self.chunk_bytes * 2 / 2**30,
                              disk_gib=10.0)
            disk = self.backends(eng)["LocalDiskBackend"]
            keys = [key for _, _, key in eng.token_database.process_tokens(tokens)]
            eng.store(tokens)
            self._wait_written(disk, keys)
            path = disk.dict[keys[0]].path
            damage(path, probe)
            drop_cache([path])
            self._poison_free(self.backends(eng)["LocalCPUBackend"], n)
            self.dst[:, :, : n * self.C].fill_(float("nan"))
            try:
                got = eng.retrieve(tokens)
                hit = int(got[: self.C].sum()) == self.C
                equal = torch.equal(self.dst[:, :, : self.C], self.src[:, :, : self.C])
                out[f"lmcache_{probe}"] = ("wrong data returned, no error" if hit and not equal else
                                           "miss" if not hit else "equal data")
            except Exception as exc:  # what LMCache raises is the finding, whatever it is
                out[f"lmcache_{probe}"] = f"raised {type(exc).__name__}: {exc}"[:200]
            self.destroy(f"probe-{probe}")
        # restart: a new engine over the directory the last one wrote
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        eng = self.engine("probe-a", cpu=False, disk_dir=d, cpu_gib=n * self.chunk_bytes * 2 / 2**30, disk_gib=10.0)
        disk = self.backends(eng)["LocalDiskBackend"]
        keys = [key for _, _, key in eng.token_database.process_tokens(tokens)]
        eng.store(tokens)
        self._wait_written(disk, keys)
        self._fsync_files(d)
        self.destroy("probe-a")
        eng = self.engine("probe-b", cpu=False, disk_dir=d, cpu_gib=n * self.chunk_bytes * 2 / 2**30, disk_gib=10.0)
        disk = self.backends(eng)["LocalDiskBackend"]
        out["lmcache_restart_found"] = sum(disk.contains(k) for k in keys)
        out["lmcache_restart_of"] = n
        out["lmcache_restart_files_on_disk"] = len(os.listdir(d))
        self.destroy("probe-b")
        # budget: room for n chunks; store n, remove() them all, store n others
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        gib = (n * self.chunk_bytes + self.chunk_bytes // 2) / 2**30
        eng = self.engine("probe-c", cpu=False, disk_dir=d, cpu_gib=n * self.chunk_bytes * 2 / 2**30, disk_gib=gib)
        disk = self.backends(eng)["LocalDiskBackend"]
        keys = [key for _, _, key in eng.token_database.process_tokens(tokens)]
        eng.store(tokens)
        self._wait_written(disk, keys)
        for k in keys:
            disk.remove(k)
        other = self.tokens[n * self.C: 2 * n * self.C] if self.n >= 2 * n else self.tokens[: n * self.C] + 10**6
        okeys = [key for _, _, key in eng.token_database.process_tokens(other)]
        eng.store(other)
        end = time.monotonic() + 60          # its writers drain (a refused put never queues)
        while disk.disk_worker.put_tasks and time.monotonic() < end:
            time.sleep(0.001)
        out["lmcache_budget_after_remove_stored"] = sum(disk.contains(k) for k in okeys)
        out["lmcache_budget_after_remove_of"] = n
        out["lmcache_budget_accounted_bytes"] = int(disk.current_cache_size)
        out["lmcache_budget_files_on_disk"] = len(os.listdir(d))
        self.destroy("probe-c")
        shutil.rmtree(d, ignore_errors=True)
        return out


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr                       # anything LMCache prints goes to stderr
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    peer = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "init":
                import lmcache

                torch.set_num_threads(cmd.pop("threads", 1))   # the same torch threads as mmtier's side
                peer = Peer(**cmd)
                ans = {"version": getattr(lmcache, "__version__", "?"), "torch": torch.__version__}
            elif op == "quit":
                for name in list(peer.engines if peer else ()):
                    peer.destroy(name)
                out.write(json.dumps({"ok": True}) + "\n")
                out.flush()
                return
            else:
                ans = getattr(peer, op)()
            ans["ok"] = True
        except Exception as exc:  # reported to the parent, which fails the run with it
            ans = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        ans["load"] = os.getloadavg()[0]
        out.write(json.dumps(ans) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
