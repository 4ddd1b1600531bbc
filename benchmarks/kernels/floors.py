"""The floors a decode step is measured against: each resource's bandwidth, measured in the run.

- ``read_bandwidth``: a streaming read (a float32 sum) of a buffer on the device or in host memory;
- ``disk_read_bandwidth``: a cold sequential read of a directory's own files (page cache dropped
  first), up to a byte limit, buffered or ``O_DIRECT``; ``disk_write_bandwidth``: an fsync'd sequential write;
- ``cpu_attention_rate``: bytes/s of the cache's CPU attention path over its in-memory pages, from
  the CPU seconds it spends (the compute a CPU decode cannot go below on an idle machine);
- ``Floors``: per resource seconds (bytes / bandwidth) and the two floors built from them: the
  *summed* floor (every resource one after another) and the *overlap* floor (the largest of them:
  independent resources working at once; on the CPU also the compute time, which the reads can
  at best hide).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mmtier.core.groups import Tier

__all__ = ["Floors", "cpu_attention_rate", "disk_read_bandwidth", "disk_write_bandwidth",
           "drop_file_cache", "read_bandwidth"]


@dataclass(frozen=True)
class Floors:
    """Seconds each independent resource needs for its bytes in one decode step."""

    resources: dict[str, float]        # name -> bytes / bandwidth
    compute_s: float | None = None     # CPU decode: all bytes at the CPU attention path's rate

    @property
    def summed_s(self) -> float:
        return sum(self.resources.values())

    @property
    def overlap_s(self) -> float:
        return max([*self.resources.values(), self.compute_s or 0.0])

    @property
    def bound(self) -> str:
        """The resource that sets the overlap floor."""
        named = {**self.resources, **({"compute": self.compute_s} if self.compute_s else {})}
        return max(named, key=named.__getitem__)


def read_bandwidth(nbytes: int, device: str) -> float:
    """Bytes/s of a streaming read (a float32 sum) over a buffer of ``nbytes`` on ``device``."""
    x = torch.randn(max(1, nbytes // 4), dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(4):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        x.sum()
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def drop_file_cache(directory: Path) -> None:
    for path in directory.glob("*.arrow"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_bandwidth(directory: Path, limit: int, direct: bool = False, readers: int = 1) -> float:
    """Cold sequential read of the directory's Arrow files (page cache dropped first), until
    ``limit`` bytes, in 8 MiB reads: buffered, or with ``direct`` ``O_DIRECT`` into one
    page-aligned buffer per reader (what the disk tier's layer reads do: no page-cache copy).
    ``readers``: threads reading files side by side (the disk tier keeps several reads in
    flight; one reader alone leaves a network or NVMe disk part idle)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    drop_file_cache(directory)
    files = sorted(directory.glob("*.arrow"))
    lock = threading.Lock()
    state = {"got": 0, "next": 0}

    def reader() -> None:
        buf = memoryview(mmap.mmap(-1, 8 << 20)) if direct else None   # page-aligned, reused
        while True:
            with lock:
                if state["got"] >= limit or state["next"] >= len(files):
                    return
                path = files[state["next"]]
                state["next"] += 1
            got = 0
            if buf is not None:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                try:
                    while n := os.preadv(fd, [buf], got):
                        got += n
                finally:
                    os.close(fd)
            else:
                with open(path, "rb", buffering=0) as f:
                    while chunk := f.read(8 << 20):
                        got += len(chunk)
            with lock:
                state["got"] += got

    t0 = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        for f in [pool.submit(reader) for _ in range(readers)]:
            f.result()
    return state["got"] / max(time.perf_counter() - t0, 1e-9)


def disk_write_bandwidth(directory: Path, nbytes: int) -> float:
    path = directory / "raw-write-probe.bin"
    block = os.urandom(8 << 20)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < nbytes:
            written += f.write(block)
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return written / dt


def cpu_attention_rate(cache, table, q: torch.Tensor) -> float:
    """Bytes/s of the cache's CPU attention path over one layer of its device-tier pages alone
    (in memory, no reads beside it) on this process's intra-op threads, best of three. Timed in
    the process's CPU seconds (divided by those threads), not wall seconds: on a machine shared
    with other jobs a wall-clock probe of a few seconds swings tens of times over, while the
    CPU work the arithmetic needs does not; the floor it gives is what an idle machine would
    take, so a decode timed in wall seconds beside it is never flattered by the load."""
    from mmtier.attention.compile import compile_segments
    from mmtier.attention.kernels import paged_attention

    segs = [s for s in table.segments if s.group.tier == Tier.DEVICE]
    nbytes = sum(s.group.nbytes for s in segs) // cache.cfg.num_layers
    ops = compile_segments(segs, 0, cache.planner.device_view)
    q_indptr = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    q_pos = torch.full((q.shape[0],), table.length - 1, dtype=torch.int32)
    threads = torch.get_num_threads()
    best = float("inf")
    for _ in range(3):
        c0 = time.process_time()
        paged_attention(q.cpu(), q_indptr, q_pos, ops, backend="torch")
        best = min(best, (time.process_time() - c0) / threads)
    return nbytes / max(best, 1e-9)
