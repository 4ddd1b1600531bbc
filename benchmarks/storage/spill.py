"""Spill and restore throughput of the disk tier against the raw disk, torch.save and Ray.

``python -m benchmarks.storage.spill [--quick] [--dir DIR]``

All measured in one run, in one directory, over the same bytes (random, never zeros): 64 MiB
groups of 2 MiB pages (8 layers, 8 KV heads, head dim 128, fp16, 64-token pages) held in a
host tier.

- raw write: each group's bytes written to its own file with ``os.write`` and fsync'd;
- spill: ``DiskTier.put`` of each group from its host slots (Arrow file, xxh3 per page, tmp +
  fsync + rename + directory fsync), one group after another;
- raw read / restore: after dropping the page cache (``/proc/sys/vm/drop_caches`` as root,
  else ``posix_fadvise(DONTNEED)`` per file), ``readv`` into a reused buffer against
  ``DiskTier.get`` into reserved host slots (mapped, verified);
- ``torch.save`` (fsync'd) / ``torch.load`` of the same tensors;
- Ray object spilling: a local Ray (loopback) with a 96 MiB object store, ``ray.put`` of the
  same arrays far past its capacity (nearly every byte spills, for real, to a directory here),
  then ``ray.get`` of every one after a cache drop; both timed over all the bytes, nothing
  scaled, after one untimed round (Ray starts its IO workers on first use). Ray does not fsync
  what it spills (its writes may end in the page cache); ``spill_over_ray_spilling_fsynced``
  adds the time to fsync the files it wrote, for durable bytes on both sides;
- warm restart: a ``DiskTier`` scanning 10k (and, without ``--quick``, 100k) files, cold cache.

Every contender runs once per round, ``--rounds`` rounds (6; quick 2); the raw write and the
spill take turns going first. Each ratio (competitor's seconds / the cache's, higher = the cache
faster) is the median of the per-round pairs (``spill_over_raw_write``: of pairs of rounds, one
of each order, their seconds summed), with the best and worst and every pair beside it: ``spill_over_raw_write`` (target >= 0.8),
``restore_over_raw_read`` (>= 0.8), ``spill_over_ray_spilling`` (>= 2.0),
``warm_restart_s_per_10k_files``, plus the GB/s of the median round. Writes
``benchmarks/results/spill.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks._common import add_out_arg, print_table, ratio_figures, write_results
from benchmarks.file_faults import drop_cache
from mmtier.config import CacheConfig
from mmtier.content import KeyMaker
from mmtier.storage import DiskTier, HostTier, Mover
from mmtier.storage.arrow_format import FORMAT_VERSION, file_name, layout_of, serialize
from mmtier.storage.layer_extent import layer_major, layer_sums

CFG = CacheConfig(model="bench-mm", num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16",
                  modalities={"vision": {"page_size": 64},
                              "tiny": {"kind": "embedding", "page_size": 1, "width": 8}},
                  device_bytes=1 << 20)
SPEC = CFG.spec("vision")
KEYS = KeyMaker(CFG.model, "bench")


def key(modality: str, i: int):
    spec = CFG.spec(modality)
    return KEYS.derive(modality=modality, layout=spec.layout_fields(),
                       media=hashlib.sha256(i.to_bytes(8, "big")).digest(), tenant_salt=b"b" * 32)


def raw_write(d: Path, arrays: list[np.ndarray]) -> tuple[float, list[Path]]:
    paths = []
    t0 = time.perf_counter()
    for i, a in enumerate(arrays):
        p = d / f"raw-{i}.bin"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            mv, off = memoryview(a).cast("B"), 0
            while off < len(mv):
                off += os.write(fd, mv[off:off + (64 << 20)])
            os.fsync(fd)
        finally:
            os.close(fd)
        paths.append(p)
    return time.perf_counter() - t0, paths


def raw_read(paths: list[Path], nbytes: int) -> float:
    buf = bytearray(16 << 20)
    t0 = time.perf_counter()
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    assert total == nbytes
    return time.perf_counter() - t0


def torch_save_load(d: Path, tensors: list[torch.Tensor]) -> tuple[float, float, list[Path]]:
    paths = [d / f"t-{i}.pt" for i in range(len(tensors))]
    t0 = time.perf_counter()
    for p, t in zip(paths, tensors):
        with open(p, "wb") as f:
            torch.save(t, f)
            f.flush()
            os.fsync(f.fileno())
    ts = time.perf_counter() - t0
    drop_cache(paths)
    t0 = time.perf_counter()
    for p, t in zip(paths, tensors):
        got = torch.load(p, weights_only=True)
        assert got.shape == t.shape
    return ts, time.perf_counter() - t0, paths


class RaySpilling:
    """A local Ray whose object store is small enough that ``ray.put`` of the benchmark's bytes
    spills for real (to a directory under the benchmark's folder, on loopback); each round puts
    every array and then gets every one back after dropping the page cache. Both times cover
    all the bytes, as the cache's do: the few arrays still in memory at the end of the puts make
    Ray's side faster, never slower (``spilled_fraction`` says how much went to disk)."""

    def __init__(self, d: Path, store_bytes: int) -> None:
        import json

        import ray

        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        self.ray, self.dir, self.store_bytes = ray, d / "ray-spill", store_bytes
        self.dir.mkdir()
        ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=store_bytes,
                 _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False,
                 _system_config={"object_spilling_config": json.dumps(
                     {"type": "filesystem", "params": {"directory_path": str(self.dir)}}),
                     "min_spilling_size": 0})
        self.spilled: list[int] = []

    def warm_up(self, arrays: list[np.ndarray]) -> None:
        """One untimed round: Ray starts its IO workers (spill, restore) on first use."""
        self.round(arrays)
        self.spilled.clear()

    def round(self, arrays: list[np.ndarray]) -> tuple[float, float, float]:
        """(seconds to put every array, seconds to then fsync the files Ray spilled them to --
        Ray does not, the cache does --, seconds to get every one back after a cache drop)."""
        before_files = {p for p in self.dir.rglob("*") if p.is_file()}
        before = self._spilled_bytes()
        t0 = time.perf_counter()
        refs = [self.ray.put(a) for a in arrays]
        t_put = time.perf_counter() - t0
        self.spilled.append(self._spilled_bytes() - before)
        t0 = time.perf_counter()
        for p in {p for p in self.dir.rglob("*") if p.is_file()} - before_files:
            with contextlib.suppress(FileNotFoundError), open(p, "rb") as f:
                os.fsync(f.fileno())
        t_sync = time.perf_counter() - t0
        drop_cache([p for p in self.dir.rglob("*") if p.is_file()])
        t0 = time.perf_counter()
        for r, a in zip(refs, arrays):
            got = self.ray.get(r, timeout=300)
            assert got.nbytes == a.nbytes
            del got
        t_get = time.perf_counter() - t0
        del refs
        return t_put, t_sync, t_get

    def _spilled_bytes(self) -> int:
        """Bytes Ray has written to its spill directory so far (its own counter, which files
        that Ray deletes once their objects are freed do not lower)."""
        from ray._private.internal_api import memory_summary

        summary = memory_summary(stats_only=True)
        for line in summary.splitlines():
            if line.strip().startswith("Spilled") and "MiB" in line:
                return int(float(line.split()[1]) * (1 << 20))
        return sum(p.stat().st_size for p in self.dir.rglob("*") if p.is_file())

    def note(self, nbytes: int) -> str:
        return (f"ray {self.ray.__version__}: store {self.store_bytes >> 20} MiB, per round "
                f"{min(self.spilled) >> 20}-{max(self.spilled) >> 20} MiB of {nbytes >> 20} MiB spilled "
                "(no fsync); put and get timed over all the bytes, after one untimed round")

    def close(self) -> None:
        self.ray.shutdown()


def warm_restart(d: Path, n: int) -> tuple[float, float]:
    """Seconds for a DiskTier to scan ``n`` small group files (written directly, no fsync),
    with a cold page cache and with a warm one."""
    spec = CFG.spec("tiny")
    d.mkdir()
    rows = [np.random.default_rng(0).integers(1, 256, (4, spec.page_bytes), dtype=np.uint8)]
    layers = layer_major(rows, spec.page_layers)           # the tier's layout (format 2)
    sums, _ = layer_sums(layers)
    for i in range(n):
        k = key("tiny", i)
        meta = {"format": FORMAT_VERSION, "key": k.to_wire(), "model": CFG.model,
                "layout": layout_of(spec), "num_tokens": 4, "num_pages": 4, "num_chunks": 1,
                "chunk": 0, "first_page": 0, "chunk_pages": 4}
        with open(d / file_name("tiny", k.hex, 0, 1), "wb") as f:
            for part in serialize(meta, spec.layer_bytes, layers, sums)[0]:
                f.write(part)
    times = []
    for drop in (True, False):  # cold cache (restart after a reboot), then cached
        if drop:
            drop_cache([])
        t0 = time.perf_counter()
        disk = DiskTier(d, model=CFG.model, capacity_bytes=1 << 40)
        times.append(time.perf_counter() - t0)
        assert disk.stats()["groups"] == n, disk.stats()
        disk.close()
    return times[0], times[1]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="seconds, a check that it runs: 128 MiB, 2 rounds, 2k files (scaled to 10k)")
    ap.add_argument("--dir", default=os.environ.get("MMTIER_BENCH_DIR", "/var/tmp"),
                    help="where the files go (one filesystem for every contender)")
    ap.add_argument("--rounds", type=int, default=None, help="paired rounds (default 5; quick 2)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray comparison")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    # 32 pages of 2 MiB: a 64 MiB group, about one 576-token image on an 8B model's geometry
    # (32 layers x 8 KV heads x 128 x fp16 = 128 KiB per token -> 72 MiB). Every file also
    # pays a fixed cost for its structure at both ends (~3 random reads on a cold cache).
    groups, pages_per_group = (4, 16) if args.quick else (16, 32)
    rounds = args.rounds or (2 if args.quick else 6)      # even: pairs of rounds, both orders
    if rounds < 2 or rounds % 2:
        ap.error(f"--rounds must be even and at least 2 (pairs of rounds, each writer first once), got {rounds}")
    nbytes = groups * pages_per_group * SPEC.page_bytes
    work = Path(tempfile.mkdtemp(prefix="mmtier-spill-", dir=args.dir))
    t: dict[str, list[float]] = {k: [] for k in ("raw_write", "spill", "raw_read", "restore",
                                                 "torch_save", "torch_load", "ray_put", "ray_put_fsynced",
                                                 "ray_get")}
    ray_side = None
    ray_note = "skipped (--no-ray)"
    try:
        host = HostTier(nbytes, pin_memory=False)
        keys = [key("vision", i) for i in range(groups)]
        gen = torch.Generator().manual_seed(0)
        for k in keys:
            raw = torch.randint(1, 256, (pages_per_group * SPEC.page_bytes,), dtype=torch.uint8, generator=gen)
            host.put(k, SPEC, pages_per_group * SPEC.page_size, raw.view(SPEC.torch_dtype).view(
                pages_per_group, *SPEC.page_shape))
        entries = [host.get(k) for k in keys]
        arrays = [e.gather().reshape(-1).view(torch.uint8).numpy() for e in entries]
        tensors = [torch.from_numpy(a) for a in arrays]
        if not args.no_ray:
            # small enough that all but the last array or so go to disk
            ray_side = RaySpilling(work, store_bytes=96 << 20)
            ray_side.warm_up(arrays)

        for rnd in range(rounds):  # every contender once per round, over the same bytes
            # the two writers take turns going first: on a virtual disk the second writer of a
            # round ran up to 2x slower than the first (the spill 0.70-0.88 s first, 1.6-1.8 s
            # right after the raw write), a bias a fixed order would hand one side
            disk = DiskTier(work / f"tier{rnd}", model=CFG.model, capacity_bytes=4 * nbytes)

            def spill_all(disk: DiskTier = disk) -> float:
                t0 = time.perf_counter()
                for k in keys:
                    e = host.get(k)
                    disk.put(e.key, SPEC, e.num_tokens, e.runs())
                return time.perf_counter() - t0

            if rnd % 2 == 0:
                dt, raw_paths = raw_write(work, arrays)
                t["spill"].append(spill_all())
            else:
                t["spill"].append(spill_all())
                dt, raw_paths = raw_write(work, arrays)
            t["raw_write"].append(dt)
            tier_paths = [work / f"tier{rnd}" / f for e in disk.inventory() for f in e.files]

            how = drop_cache(raw_paths)
            t["raw_read"].append(raw_read(raw_paths, nbytes))
            for k in keys:  # free the slots (already touched) and read back into them
                host.remove(k)
            drop_cache(tier_paths)
            t0 = time.perf_counter()
            restored = []
            for k in keys:
                slot = host.reserve(k, SPEC, pages_per_group * SPEC.page_size)
                assert disk.get(k, SPEC, CFG.model, out=slot.runs()) is not None
                restored.append(host.commit(slot))
            t["restore"].append(time.perf_counter() - t0)
            for e, a in zip(restored, arrays):
                assert np.array_equal(e.gather().reshape(-1).view(torch.uint8).numpy(), a)
            disk.close()
            shutil.rmtree(work / f"tier{rnd}")
            for p in raw_paths:
                p.unlink()

            t_save, t_load, pt_paths = torch_save_load(work, tensors)
            t["torch_save"].append(t_save)
            t["torch_load"].append(t_load)
            for p in pt_paths:
                p.unlink()
            if ray_side is not None:
                t_put, t_sync, t_get = ray_side.round(arrays)
                t["ray_put"].append(t_put)
                t["ray_put_fsynced"].append(t_put + t_sync)
                t["ray_get"].append(t_get)
        if ray_side is not None:
            ray_note = ray_side.note(nbytes)

        disk2 = DiskTier(work / "tier2", model=CFG.model, capacity_bytes=4 * nbytes)
        mover = Mover(host, disk2, model=CFG.model, max_inflight_bytes=64 << 20)
        t0 = time.perf_counter()
        futs = [mover.spill(k, SPEC, pages_per_group * SPEC.page_size) for k in keys]
        for f in futs:
            f.result(timeout=600)
        t_mover_spill = time.perf_counter() - t0
        mover.close()
        shutil.rmtree(work / "tier2")

        restart_files = 2_000 if args.quick else 10_000
        restart_10k = tuple(t * 10_000 / restart_files for t in warm_restart(work / "restart-10k", restart_files))
        restart_100k = (None, None) if args.quick else warm_restart(work / "restart-100k", 100_000)
    finally:
        if ray_side is not None:
            ray_side.close()
        with contextlib.suppress(OSError):
            shutil.rmtree(work)

    med = {k: statistics.median(v) for k, v in t.items() if v}
    gbps = lambda k: nbytes / med[k] / 1e9 if k in med else None
    # each ratio: competitor seconds / the cache's seconds, per round (higher = the cache faster)
    figures: dict[str, object] = {}
    # the raw write and the spill went first in turn: a pair of rounds (one of each order) is
    # one measurement, its summed seconds against each other
    pairs = range(0, len(t["spill"]) - 1, 2)
    figures.update(ratio_figures("spill_over_raw_write", [t["raw_write"][i] + t["raw_write"][i + 1] for i in pairs],
                                 [t["spill"][i] + t["spill"][i + 1] for i in pairs], higher_is_better=True))
    for name, other, ours in (("restore_over_raw_read", "raw_read", "restore"),
                              ("spill_over_torch_save", "torch_save", "spill"),
                              ("restore_over_torch_load", "torch_load", "restore"),
                              ("spill_over_ray_spilling", "ray_put", "spill"),
                              ("spill_over_ray_spilling_fsynced", "ray_put_fsynced", "spill"),
                              ("restore_over_ray_restore", "ray_get", "restore")):
        if t[other]:
            figures.update(ratio_figures(name, t[other], t[ours], higher_is_better=True))
    figures.update({
        "warm_restart_s_per_10k_files": restart_10k[0],
        "warm_restart_s_per_10k_files_cached": restart_10k[1],
        "warm_restart_s_per_100k_files": restart_100k[0],
        "warm_restart_s_per_100k_files_cached": restart_100k[1],
        "raw_write_gbps": gbps("raw_write"), "spill_gbps": gbps("spill"),
        "spill_via_mover_gbps": nbytes / t_mover_spill / 1e9,
        "raw_read_gbps": gbps("raw_read"), "restore_gbps": gbps("restore"),
        "torch_save_gbps": gbps("torch_save"), "torch_load_gbps": gbps("torch_load"),
        "ray_spill_gbps": gbps("ray_put"), "ray_restore_gbps": gbps("ray_get"),
        "ray_spilled_fraction": min(ray_side.spilled) / nbytes if ray_side and ray_side.spilled else None,
        "bytes": nbytes, "groups": groups, "rounds": rounds, "page_bytes": SPEC.page_bytes,
        "warm_restart_files_measured": restart_files,
        "summary": f"ratios: median of {rounds} paired rounds (best, worst beside); GB/s: median round",
        "cache_drop": how, "ray": ray_note, "dir": args.dir, "quick": args.quick,
    })
    print_table(f"spill / restore, {nbytes >> 20} MiB in {groups} groups under {args.dir} ({how})",
                [(k, v) for k, v in figures.items()])
    print(f"\nwrote {write_results('spill', figures, args.out)}")
    return figures


if __name__ == "__main__":
    main()
