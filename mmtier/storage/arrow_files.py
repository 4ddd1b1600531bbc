"""The disk tier: groups as Arrow IPC files in one directory (format 2, layer-major:
``arrow_format.py``; lean reads of files whose layout is known: ``layer_extent.py``).

One file per modality group, or per ``chunk_bytes`` (64 MiB) chunk of a large group.

Writes (``put_async``; ``put`` runs it on the tier's own event loop) go through aiofiles: a
unique ``.tmp`` file in the same directory, fsync, rename, and one fsync of the directory per
group. The large buffers handed to aiofiles are the caller's own page memory (no copy). A
write refused for space (ENOSPC, or the ``free_floor_bytes`` floor checked with ``statvfs``)
raises ``StorageFullError``; beyond the byte budget, ``CapacityError``; any other I/O error,
``StorageIOError``. Every failure removes what that write created, counts, and leaves the
tier working; data already on disk is untouched.

Reads (``get``, ``get_many``, ``get_layer``; ``disk_reads.py``, inherited) copy the pages
once and check every byte against what was written; any mismatch is a miss (``corrupt_reads``,
the group's files moved to ``quarantine/``), never wrong data; nothing is unpickled. The writer
keeps, per file, where its pages lie and the xxh3 of each block of pages, of each layer of each
block, and of every other byte, so those reads need no Arrow parsing.

Warm restart: the constructor scans the directory reading only each file's footer and
schema, removes ``.tmp`` leftovers, indexes complete groups, and quarantines bad files and
partial groups (``quarantined_at_start``, ``partial_groups_at_start``). ``inventory()`` lists
the groups so the cache can adopt them; it should ``KeyMaker.verify`` each key (a file is not
trusted to have been issued by this cache's secret)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiofiles
import aiofiles.os
import pyarrow as pa
import torch

from ..config import ModalitySpec
from ..content import ContentKey
from ..errors import (
    CapacityError,
    ClosedError,
    CorruptDataError,
    MMTierError,
    ShapeError,
    StorageFullError,
    UnknownModalityError,
)
from . import writers
from .arrow_format import (
    FILE_OVERHEAD,
    FORMAT_VERSION,
    SUFFIX,
    file_name,
    group_fields,
    layout_of,
    page_rows,
    page_sums,
    scan_file,
    serialize,
    slice_rows,
)
from .direct_reads import AHEAD_WINDOWS, WINDOW_BYTES
from .disk_reads import DiskReads
from .file_writes import write_parts
from .layer_extent import (
    DIRECT_MIN_EXTENT,
    LayerExtent,
    direct_align,
    frame_digest,
    layer_major,
    layer_sums,
)
from .staging import MIN_BYTES, StagingPool
from .tier import StorageTier

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
QUARANTINE_DIR = "quarantine"

# Test hook for crash injection (tests/chaos): ``MMTIER_CRASH_STEP=<step>[:<n>]``, read once at
# import (or set ``_CRASH_STEP`` / ``_CRASH_AT`` in a fresh process), SIGKILLs this process the
# n-th time (default 1st) a write reaches ``step``: ``before_write`` (tmp file open, empty),
# ``after_write`` (bytes written, not fsynced), ``after_fsync`` (before the rename),
# ``after_rename`` (final name, directory not fsynced), ``after_dir_fsync`` (durable, index not
# updated). Unset (production): one falsy check per step, nothing else.
CRASH_STEPS = ("before_write", "after_write", "after_fsync", "after_rename", "after_dir_fsync")
_CRASH_STEP, _, _CRASH_AT = (os.environ.get("MMTIER_CRASH_STEP") or "").partition(":")
_CRASH_AT = int(_CRASH_AT or 1)
_crash_hits = 0


def _crash_point(step: str) -> None:
    global _crash_hits
    if step == _CRASH_STEP:
        _crash_hits += 1
        if _crash_hits == _CRASH_AT:
            os.kill(os.getpid(), signal.SIGKILL)


class StorageIOError(MMTierError):
    """A disk-tier write failed for a reason other than space (EIO, permissions, ...)."""


@dataclass(frozen=True)
class DiskEntry:
    """One group on disk, as the index knows it."""

    key: ContentKey
    model: str
    layout: dict[str, str]
    num_tokens: int
    num_pages: int
    nbytes: int
    files: tuple[str, ...]
    # Where the pages lie in each file and the digests of all its bytes, known from the write
    # or a first verified read; ``None`` after a warm restart until that read. With them a read
    # is a few syscalls per file (``read_whole``, ``read_layer_extent``) instead of parsing the Arrow footer.
    extents: tuple[LayerExtent, ...] | None = None
    # Written by another process that still runs (a directory shared by engine processes):
    # read like any other, but not counted in this tier's budget nor ever deleted by it.
    borrowed: bool = False


class DiskTier(DiskReads, StorageTier):
    """Arrow IPC files of groups in one directory, under a byte budget. Thread-safe."""

    def __init__(self, directory: str | os.PathLike, *, model: str, capacity_bytes: int,
                 free_floor_bytes: int = 0, chunk_bytes: int = 64 << 20, io_timeout_s: float = 300.0,
                 scan_threads: int = 16, write_concurrency: int = 4, read_threads: int = 4,
                 read_ahead_layers: int = 1, direct_reads: bool = True, direct_writes: bool = True):
        self.dir = Path(directory)
        self._dir_str = str(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.capacity_bytes = capacity_bytes
        self.free_floor_bytes = free_floor_bytes
        self.chunk_bytes = chunk_bytes
        self.io_timeout_s = io_timeout_s
        self.scan_threads = scan_threads
        self.write_concurrency = write_concurrency
        self.read_threads = read_threads
        self.read_ahead_layers = read_ahead_layers   # a buffered layer read asks the kernel for the next ones
        # layer reads with O_DIRECT where aligned (``layer_extent.read_direct``); the writer
        # pads each layer's extent to the device's logical block for them
        self.direct_reads = direct_reads
        self.io_align = direct_align(os.stat(self.dir).st_dev) if direct_reads else 1
        self._readers: concurrent.futures.ThreadPoolExecutor | None = None
        # whole-file reads with O_DIRECT through reused aligned windows, the next window read
        # (and the one after) while this one is checked and copied (``direct_reads``)
        self._read_windows = StagingPool((1 + AHEAD_WINDOWS) * read_threads * WINDOW_BYTES)
        self._window_readers: concurrent.futures.ThreadPoolExecutor | None = None
        # the writers' layer-major copies of their chunks, reused (one per write in flight)
        self._write_buffers = StagingPool(write_concurrency * max(chunk_bytes, MIN_BYTES))
        # files written with O_DIRECT from reused aligned images (``file_writes``), else buffered
        self.direct_writes = direct_writes
        self.write_align = direct_align(os.stat(self.dir).st_dev) if direct_writes else 1
        self._write_images = (StagingPool(write_concurrency * (max(chunk_bytes, MIN_BYTES) + FILE_OVERHEAD + (1 << 20)))
                              if direct_writes else None)
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._index: dict[bytes, DiskEntry] = {}
        self._writing: dict[bytes, concurrent.futures.Future] = {}
        self._used = 0
        self._reserved = 0
        self._closed = False
        self._counts = dict.fromkeys(
            ("writes", "write_bytes", "hits", "misses", "corrupt_reads", "quarantined",
             "quarantined_at_start", "partial_groups_at_start", "tmp_removed_at_start",
             "full_errors", "floor_refusals", "budget_refusals", "io_errors", "removes",
             "read_bytes", "tmp_kept_at_start", "foreign_at_start", "borrowed_at_start",
             "old_format_at_start", "direct_read_files"), 0)
        t0 = time.perf_counter()
        self._scan()
        self.scan_s = time.perf_counter() - t0

    # ---- accounting ----
    @property
    def used_bytes(self) -> int:
        return self._used

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {"capacity_bytes": self.capacity_bytes, "used_bytes": self._used,
                    "groups": len(self._index), "scan_s": self.scan_s, **self._counts}

    def inventory(self) -> list[DiskEntry]:
        with self._lock:
            return list(self._index.values())

    def info(self, key: ContentKey) -> DiskEntry | None:
        with self._lock:
            e = self._index.get(key.digest)
            return e if e is not None and e.key == key else None

    # ---- the tier interface ----
    def contains(self, key: ContentKey) -> bool:
        return self.info(key) is not None

    def put(self, key: ContentKey, spec: ModalitySpec, num_tokens: int,
            pages: torch.Tensor | Sequence[torch.Tensor]) -> DiskEntry:
        """Write a group (blocking; from async code await ``put_async``). ``pages``:
        ``[n, *page_shape]`` or contiguous runs of it. Idempotent per key."""
        with self._sync_lock:
            if self._closed:
                raise ClosedError("disk tier is closed")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(self.put_async(key, spec, num_tokens, pages))

    def put_many(self, items: Sequence[tuple[ContentKey, ModalitySpec, int, torch.Tensor | Sequence[torch.Tensor]]]
                 ) -> list[DiskEntry]:
        """Several groups ``(key, spec, num_tokens, pages)`` at once (blocking): their writes run
        side by side (``write_concurrency`` at a time, on aiofiles' threads), each file fsynced
        as ``put`` does, and the directory fsynced once for all of them at the end, so every
        group is durable when this returns. A group that fails does not stop the others: the
        first error is raised once all have finished, the groups written are kept."""
        with self._sync_lock:
            if self._closed:
                raise ClosedError("disk tier is closed")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(self._put_many(items))

    async def _put_many(self, items) -> list[DiskEntry]:
        gate = asyncio.Semaphore(self.write_concurrency)

        async def one(item) -> DiskEntry:
            async with gate:
                return await self.put_async(*item, sync_dir=False)

        results = await asyncio.gather(*(one(it) for it in items), return_exceptions=True)
        await _fsync_dir(self.dir)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)  # type: ignore[arg-type]

    async def put_async(self, key: ContentKey, spec: ModalitySpec, num_tokens: int,
                        pages: torch.Tensor | Sequence[torch.Tensor], *, sync_dir: bool = True,
                        expected_sums: Sequence[int] | None = None) -> DiskEntry:
        """``put`` on the caller's event loop. ``sync_dir=False`` leaves the directory fsync
        to the caller (``put_many`` makes one for many groups): the group is durable only after it.
        ``expected_sums``: the xxh3 each page should have (a host copy's digests); the write
        computes them anyway, and a difference raises ``CorruptDataError``, nothing written."""
        if spec.name != key.modality:
            raise UnknownModalityError(f"key of modality {key.modality!r} with spec {spec.name!r}")
        n = spec.pages_for(num_tokens)
        rows = page_rows(spec, pages)
        if sum(r.shape[0] for r in rows) != n:
            raise ShapeError(f"{spec.name}: {sum(r.shape[0] for r in rows)} pages for {n} needed")
        per_file = max(1, self.chunk_bytes // spec.page_bytes)
        num_chunks = max(1, -(-n // per_file))
        pads = min(n, per_file) * spec.layer_bytes >= DIRECT_MIN_EXTENT     # extents padded for O_DIRECT
        need = n * spec.page_bytes + num_chunks * (FILE_OVERHEAD + (spec.page_layers * self.io_align if pads else 0))
        while True:
            with self._lock:
                if self._closed:
                    raise ClosedError("disk tier is closed")
                done = self._index.get(key.digest)
                if done is not None and done.key == key:
                    return done
                other = self._writing.get(key.digest)
                if other is None:
                    if self._used + self._reserved + need > self.capacity_bytes:
                        self._counts["budget_refusals"] += 1
                        raise CapacityError(f"disk tier: {need} bytes wanted, "
                                            f"{self.capacity_bytes - self._used - self._reserved} free")
                    self._reserved += need
                    mine: concurrent.futures.Future = concurrent.futures.Future()
                    self._writing[key.digest] = mine
                    break
            # The same group is being written by another call: wait for it, then look again.
            try:
                await asyncio.wait_for(asyncio.wrap_future(other), self.io_timeout_s)
            except TimeoutError:
                raise StorageIOError(f"another write of {key!r} did not finish in "
                                     f"{self.io_timeout_s} s") from None
        entry = None
        written: list[Path] = []
        try:
            entry = await self._write_group(key, spec, num_tokens, n, rows, per_file, num_chunks, need,
                                            written, sync_dir, expected_sums)
        except OSError as exc:
            await self._cleanup(written)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._count("full_errors")
                raise StorageFullError(f"disk full writing {key!r}: {exc}") from exc
            self._count("io_errors")
            raise StorageIOError(f"writing {key!r} failed: {exc}") from exc
        except BaseException:
            await self._cleanup(written)
            raise
        finally:
            with self._lock:
                self._reserved -= need
                del self._writing[key.digest]
                if entry is not None:
                    self._index[key.digest] = entry
                    self._used += entry.nbytes
                    self._counts["writes"] += 1
                    self._counts["write_bytes"] += entry.nbytes
            mine.set_result(None)
        return entry

    def remove(self, key: ContentKey) -> bool:
        with self._lock:
            e = self._index.get(key.digest)
            if e is None or e.key != key:
                return False
            del self._index[key.digest]
            self._counts["removes"] += 1
            if e.borrowed:                   # another running process's files: forget them only
                return True
            self._used -= e.nbytes
        for name in e.files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / name)
        return True

    def close(self) -> None:
        with self._sync_lock:
            self._closed = True
            for pool in (self._readers, self._window_readers):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._readers = self._window_readers = None
            if self._loop is not None:
                self._loop.run_until_complete(self._loop.shutdown_default_executor())
                self._loop.close()
                self._loop = None

    # ---- writing ----
    async def _write_group(self, key, spec, num_tokens, n, rows, per_file, num_chunks, need,
                           written: list[Path], sync_dir: bool = True,
                           expected_sums: Sequence[int] | None = None) -> DiskEntry:
        st = await aiofiles.os.statvfs(self.dir) if self.free_floor_bytes > 0 else None
        with self._lock:   # every write in flight (this one included) may still need its bytes
            inflight = self._reserved
        if st is not None and st.f_bavail * st.f_frsize - max(inflight, need) < self.free_floor_bytes:
            self._count("floor_refusals")
            raise StorageFullError(f"disk tier: writing {need} bytes would cross the free-space floor "
                                   f"({self.free_floor_bytes} bytes; {st.f_bavail * st.f_frsize} free)")
        loop = asyncio.get_running_loop()
        bounds = [(c * per_file, min(n, (c + 1) * per_file)) for c in range(num_chunks)]
        chunks = [slice_rows(rows, lo, hi) for lo, hi in bounds]
        if expected_sums is not None:
            sums = await loop.run_in_executor(None, page_sums, rows)
            if sums.tolist() != list(expected_sums):
                raise CorruptDataError(f"{key!r}: the pages to write differ from their checksums")
        base = {"format": FORMAT_VERSION, "key": key.to_wire(), "model": self.model,
                "layout": layout_of(spec), "num_tokens": num_tokens, "num_pages": n,
                "num_chunks": num_chunks, "writer": writers.this_writer()}
        files, extents, total = [], [], 0
        lb = spec.layer_bytes
        for c, ((lo, hi), chunk_rows) in enumerate(zip(bounds, chunks)):
            meta = {**base, "chunk": c, "first_page": lo, "chunk_pages": hi - lo}
            copied = spec.page_layers > 1 or len(chunk_rows) > 1
            buf = self._write_buffers.take((hi - lo) * spec.page_bytes) if copied else None
            layers = parts = None
            try:
                layers = await loop.run_in_executor(None, layer_major, chunk_rows, spec.page_layers,
                                                    buf.numpy() if buf is not None else None)
                row_sums, layer_digests = await loop.run_in_executor(None, layer_sums, layers)
                parts, offsets = serialize(meta, lb, layers, row_sums, self.io_align)
                name = file_name(key.modality, key.hex, c, num_chunks)
                size = await self._write_file(self.dir / name, parts, written)
                extent = None
                if offsets is not None:      # the frame digest reads the parts: before the buffer goes
                    extent = LayerExtent(name, size, lb, lo, hi - lo, tuple(offsets), layer_digests, 0)
                    extent = dataclasses.replace(extent, frame=frame_digest(parts, extent.gaps()))
            finally:
                del layers, parts            # nothing refers to the buffer once it is given back
                if buf is not None:
                    self._write_buffers.give(buf)
            total += size
            files.append(name)
            if extent is not None and extents is not None:
                extents.append(extent)
            else:
                extents = None
        if sync_dir:
            await _fsync_dir(self.dir)
            if _CRASH_STEP:
                _crash_point("after_dir_fsync")
        return DiskEntry(key, self.model, layout_of(spec), num_tokens, n, total, tuple(files),
                         tuple(extents) if extents is not None else None)

    async def _write_file(self, final: Path, parts: list[object], written: list[Path]) -> int:
        tmp = final.with_name(writers.tmp_name(final.name, uuid.uuid4().hex[:12]))
        loop = asyncio.get_running_loop()
        try:
            size = await loop.run_in_executor(None, functools.partial(
                write_parts, str(tmp), parts, align=self.write_align, images=self._write_images,
                crash=_crash_point if _CRASH_STEP else None))
            await aiofiles.os.replace(tmp, final)
            if _CRASH_STEP:
                _crash_point("after_rename")
        except BaseException:
            await self._cleanup([tmp])
            raise
        written.append(final)
        return size

    async def _cleanup(self, paths: list[Path]) -> None:
        for p in paths:
            try:
                await aiofiles.os.unlink(p)
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("mmtier disk tier: cannot remove %s: %s", p, exc)

    def _expected_group(self, e: DiskEntry) -> dict:
        return {"format": FORMAT_VERSION, "key": e.key.to_wire(), "model": e.model,
                "layout": e.layout, "num_tokens": e.num_tokens, "num_pages": e.num_pages,
                "num_chunks": len(e.files)}

    # ---- corruption and quarantine ----
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _corrupt(self, e: DiskEntry, why: str) -> None:
        log.warning("mmtier disk tier: corrupt group %r (%s); quarantined", e.key, why)
        with self._lock:
            self._counts["corrupt_reads"] += 1
            current = self._index.get(e.key.digest)
            if current is not None and current.key == e.key and current.files == e.files:
                del self._index[e.key.digest]
                self._used -= current.nbytes
            else:
                return
        for name in e.files:
            self._quarantine(self.dir / name, "quarantined")

    def _quarantine(self, path: Path, counter: str) -> None:
        qdir = self.dir / QUARANTINE_DIR
        try:
            qdir.mkdir(exist_ok=True)
            os.replace(path, qdir / f"{path.name}.{time.time_ns()}")
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("mmtier disk tier: cannot quarantine %s (%s); removing it", path, exc)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._count(counter)

    # ---- warm restart ----
    def _scan_one(self, name: str) -> tuple[dict, int] | str | None:
        """``(metadata, size)`` of a well-formed file of this model, ``"foreign"`` for a
        well-formed file of another model (left alone: another process's), else ``None``."""
        path = self.dir / name
        try:
            meta = scan_file(str(path))
            key = ContentKey.from_wire(meta["key"])
            if meta["model"] != self.model:
                return "foreign"
            if meta["format"] != FORMAT_VERSION:       # an old layout: never read (a miss)
                return "old live" if writers.alive(meta.get("writer")) else "old"
            if name != file_name(key.modality, key.hex, meta["chunk"], meta["num_chunks"]):
                return None
            return meta, path.stat().st_size
        except (OSError, pa.ArrowException, CorruptDataError, ValueError, KeyError, TypeError):
            return None

    def _scan(self) -> None:
        candidates: list[str] = []
        with os.scandir(self.dir) as it:
            for d in it:
                if not d.is_file(follow_symlinks=False):
                    continue
                if d.name.endswith(TMP_SUFFIX):
                    if writers.tmp_in_flight(d.name):    # another running process's write
                        self._counts["tmp_kept_at_start"] += 1
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(d.path)
                    self._counts["tmp_removed_at_start"] += 1
                elif d.name.endswith(SUFFIX):
                    candidates.append(d.name)
        # Footers are small random reads: overlap them (the GIL is released inside Arrow).
        if len(candidates) > 64:
            with concurrent.futures.ThreadPoolExecutor(self.scan_threads) as pool:
                results = list(pool.map(self._scan_one, candidates, chunksize=64))
        else:
            results = [self._scan_one(name) for name in candidates]
        groups: dict[str, list[tuple[dict, str, int]]] = {}
        for name, found in zip(candidates, results):
            if found == "foreign":
                self._counts["foreign_at_start"] += 1
            elif found in ("old", "old live"):
                self._counts["old_format_at_start"] += 1
                if found == "old":               # its writer is gone: set aside, recomputed
                    log.warning("mmtier disk tier: %s is an older file format; quarantined", name)
                    self._quarantine(self.dir / name, "quarantined_at_start")
            elif found is None:
                self._quarantine(self.dir / name, "quarantined_at_start")
            else:
                groups.setdefault(found[0]["key"]["digest"], []).append((found[0], name, found[1]))
        for chunks in groups.values():
            chunks.sort(key=lambda c: c[0]["chunk"])
            m0 = chunks[0][0]
            ok = ([c[0]["chunk"] for c in chunks] == list(range(m0["num_chunks"]))
                  and all(group_fields(c[0]) == group_fields(m0) for c in chunks)
                  and [c[0]["first_page"] for c in chunks]
                  == [sum(x[0]["chunk_pages"] for x in chunks[:i]) for i in range(len(chunks))]
                  and sum(c[0]["chunk_pages"] for c in chunks) == m0["num_pages"])
            if not ok:
                self._counts["partial_groups_at_start"] += 1
                for _, name, _ in chunks:
                    self._quarantine(self.dir / name, "quarantined_at_start")
                continue
            key = ContentKey.from_wire(m0["key"])
            nbytes = sum(c[2] for c in chunks)
            writer = m0.get("writer")
            borrowed = writer != writers.this_writer() and writers.alive(writer)
            self._index[key.digest] = DiskEntry(key, m0["model"], m0["layout"], m0["num_tokens"],
                                                m0["num_pages"], nbytes, tuple(c[1] for c in chunks),
                                                borrowed=borrowed)
            if borrowed:
                self._counts["borrowed_at_start"] += 1
            else:                            # its writer is gone: this tier takes the files over
                self._used += nbytes


async def _fsync_dir(path: Path) -> None:
    def sync() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    await asyncio.get_running_loop().run_in_executor(None, sync)
