"""Spill and restore throughput of the disk tier against the raw disk, torch.save and Ray.

``python -m benchmarks.spill [--quick] [--dir DIR]``

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
- Ray object spilling: a local Ray with a small object store, ``ray.put`` of the same arrays
  past its capacity (forcing spills to a directory here), then ``ray.get`` of the spilled ones;
- warm restart: a ``DiskTier`` scanning 10k (and, without ``--quick``, 100k) files, cold cache.

Figures: ``spill_over_raw_write`` (target >= 0.8), ``restore_over_raw_read`` (>= 0.8),
``spill_over_ray_spilling`` (>= 2.0), ``warm_restart_s_per_10k_files``, plus the GB/s behind
them. Writes ``benchmarks/results/spill.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks._common import add_out_arg, print_table, write_results
from mmtier.config import CacheConfig
from mmtier.content import KeyMaker
from mmtier.storage import DiskTier, HostTier, Mover
from mmtier.storage.arrow_format import FORMAT_VERSION, file_name, layout_of, page_sums, serialize

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


def drop_cache(paths: list[Path]) -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise_dontneed"


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


def ray_spilling(d: Path, arrays: list[np.ndarray], store_bytes: int) -> tuple[float | None, float | None, str]:
    """Seconds to ``ray.put`` everything past a small store (spilling) and to ``ray.get`` back
    the spilled objects, or ``None`` with the reason."""
    try:
        import json

        import ray
    except ImportError as exc:
        return None, None, f"ray not importable: {exc}"
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    spill_dir = d / "ray-spill"
    spill_dir.mkdir()
    try:
        ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=store_bytes,
                 _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False,
                 _system_config={"object_spilling_config": json.dumps(
                     {"type": "filesystem", "params": {"directory_path": str(spill_dir)}}),
                     "min_spilling_size": 0})
    except Exception as exc:  # a local cluster that cannot start: report, do not fail the run
        return None, None, f"ray.init failed: {exc!r}"
    try:
        t0 = time.perf_counter()
        refs = [ray.put(a) for a in arrays]
        t_put = time.perf_counter() - t0
        spill_files = [p for p in spill_dir.rglob("*") if p.is_file()]
        spilled = sum(p.stat().st_size for p in spill_files)
        if spilled < arrays[0].nbytes:
            return None, None, f"ray spilled only {spilled} bytes; nothing to compare"
        # the oldest objects went to disk first: read back as many as were spilled
        count, acc = 0, 0
        while count < len(arrays) and acc + arrays[count].nbytes <= spilled:
            acc += arrays[count].nbytes
            count += 1
        drop_cache(spill_files)
        t0 = time.perf_counter()
        for r, a in zip(refs[:count], arrays[:count]):
            got = ray.get(r, timeout=300)
            assert got.nbytes == a.nbytes
            del got
        t_get = time.perf_counter() - t0
        frac = spilled / sum(a.nbytes for a in arrays)
        return (t_put / frac, t_get * len(arrays) / max(count, 1),
                f"ray {ray.__version__}: store {store_bytes >> 20} MiB, {spilled >> 20} MiB spilled "
                f"(no fsync); times scaled to all bytes")
    finally:
        ray.shutdown()


def warm_restart(d: Path, n: int) -> tuple[float, float]:
    """Seconds for a DiskTier to scan ``n`` small group files (written directly, no fsync),
    with a cold page cache and with a warm one."""
    spec = CFG.spec("tiny")
    d.mkdir()
    rows = [np.random.default_rng(0).integers(1, 256, (4, spec.page_bytes), dtype=np.uint8)]
    sums = page_sums(rows)
    for i in range(n):
        k = key("tiny", i)
        meta = {"format": FORMAT_VERSION, "key": k.to_wire(), "model": CFG.model,
                "layout": layout_of(spec), "num_tokens": 4, "num_pages": 4, "num_chunks": 1,
                "chunk": 0, "first_page": 0, "chunk_pages": 4}
        with open(d / file_name("tiny", k.hex, 0, 1), "wb") as f:
            for part in serialize(meta, spec.page_bytes, rows, sums)[0]:
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
                    help="seconds, a check that it runs: 128 MiB, one round, 2k files (scaled to 10k)")
    ap.add_argument("--dir", default=os.environ.get("MMTIER_BENCH_DIR", "/var/tmp"),
                    help="where the files go (one filesystem for every contender)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray comparison")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    # 32 pages of 2 MiB: a 64 MiB group, about one 576-token image on an 8B model's geometry
    # (32 layers x 8 KV heads x 128 x fp16 = 128 KiB per token -> 72 MiB). Every file also
    # pays a fixed cost for its structure at both ends (~3 random reads on a cold cache).
    groups, pages_per_group, rounds = (4, 16, 1) if args.quick else (16, 32, 3)
    nbytes = groups * pages_per_group * SPEC.page_bytes
    work = Path(tempfile.mkdtemp(prefix="mmtier-spill-", dir=args.dir))
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

        t_raw_w = t_spill = t_raw_r = t_restore = float("inf")
        for rnd in range(rounds):  # alternate contenders; keep each one's best round
            dt, raw_paths = raw_write(work, arrays)
            t_raw_w = min(t_raw_w, dt)
            disk = DiskTier(work / f"tier{rnd}", model=CFG.model, capacity_bytes=4 * nbytes)
            t0 = time.perf_counter()
            for k in keys:
                e = host.get(k)
                disk.put(e.key, SPEC, e.num_tokens, e.runs())
            t_spill = min(t_spill, time.perf_counter() - t0)
            tier_paths = [work / f"tier{rnd}" / f for e in disk.inventory() for f in e.files]

            how = drop_cache(raw_paths)
            t_raw_r = min(t_raw_r, raw_read(raw_paths, nbytes))
            for k in keys:  # free the slots (already touched) and read back into them
                host.remove(k)
            drop_cache(tier_paths)
            t0 = time.perf_counter()
            restored = []
            for k in keys:
                slot = host.reserve(k, SPEC, pages_per_group * SPEC.page_size)
                assert disk.get(k, SPEC, CFG.model, out=slot.runs()) is not None
                restored.append(host.commit(slot))
            t_restore = min(t_restore, time.perf_counter() - t0)
            for e, a in zip(restored, arrays):
                assert np.array_equal(e.gather().reshape(-1).view(torch.uint8).numpy(), a)
            disk.close()
            shutil.rmtree(work / f"tier{rnd}")

        disk2 = DiskTier(work / "tier2", model=CFG.model, capacity_bytes=4 * nbytes)
        mover = Mover(host, disk2, model=CFG.model, max_inflight_bytes=64 << 20)
        t0 = time.perf_counter()
        futs = [mover.spill(k, SPEC, pages_per_group * SPEC.page_size) for k in keys]
        for f in futs:
            f.result(timeout=600)
        t_mover_spill = time.perf_counter() - t0
        mover.close()
        for p in raw_paths:
            p.unlink()
        shutil.rmtree(work / "tier2")

        tensors = [torch.from_numpy(a) for a in arrays]
        t_save, t_load, pt_paths = torch_save_load(work, tensors)
        for p in pt_paths:
            p.unlink()

        ray_put = ray_get = None
        ray_note = "skipped (--no-ray)"
        if not args.no_ray:
            ray_put, ray_get, ray_note = ray_spilling(work, arrays, store_bytes=max(80 << 20, nbytes // 4))

        restart_files = 2_000 if args.quick else 10_000
        restart_10k = tuple(t * 10_000 / restart_files for t in warm_restart(work / "restart-10k", restart_files))
        restart_100k = (None, None) if args.quick else warm_restart(work / "restart-100k", 100_000)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)

    gbps = lambda t: nbytes / t / 1e9 if t else None
    figures = {
        "spill_over_raw_write": t_raw_w / t_spill,
        "restore_over_raw_read": t_raw_r / t_restore,
        "spill_over_ray_spilling": (ray_put / t_spill) if ray_put else None,
        "restore_over_ray_restore": (ray_get / t_restore) if ray_get else None,
        "spill_over_torch_save": t_save / t_spill,
        "restore_over_torch_load": t_load / t_restore,
        "warm_restart_s_per_10k_files": restart_10k[0],
        "warm_restart_s_per_10k_files_cached": restart_10k[1],
        "warm_restart_s_per_100k_files": restart_100k[0],
        "warm_restart_s_per_100k_files_cached": restart_100k[1],
        "raw_write_gbps": gbps(t_raw_w), "spill_gbps": gbps(t_spill),
        "spill_via_mover_gbps": gbps(t_mover_spill),
        "raw_read_gbps": gbps(t_raw_r), "restore_gbps": gbps(t_restore),
        "torch_save_gbps": gbps(t_save), "torch_load_gbps": gbps(t_load),
        "ray_spill_gbps": gbps(ray_put), "ray_restore_gbps": gbps(ray_get),
        "bytes": nbytes, "groups": groups, "rounds": rounds, "page_bytes": SPEC.page_bytes,
        "warm_restart_files_measured": restart_files,
        "cache_drop": how, "ray": ray_note, "dir": args.dir, "quick": args.quick,
    }
    print_table(f"spill / restore, {nbytes >> 20} MiB in {groups} groups under {args.dir} ({how})",
                [(k, v) for k, v in figures.items()])
    print(f"\nwrote {write_results('spill', figures, args.out)}")
    return figures


if __name__ == "__main__":
    main()
