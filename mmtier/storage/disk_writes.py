"""The disk tier's writes: a group's pages into durable Arrow IPC files, one per ``chunk_bytes``.

``DiskWrites.put_async`` claims the group's bytes in the ``DiskIndex`` (a second write of the
same key waits for the first; beyond the budget, ``CapacityError``), checks the free-space
floor (``statvfs``; ``StorageFullError``), makes each chunk's layer-major copy in a reused
buffer (``layer_extent.layer_major``), serializes it (``arrow_format.serialize``, extents
padded to ``io_align`` for ``O_DIRECT`` reads) and writes it to a unique ``.tmp`` file, with
``O_DIRECT`` from a reused aligned image where the file system takes it (``file_writes``),
fsynced, then renamed; one fsync of the directory per group (``put_many_async``: one for all).
The index then learns the group with where its pages lie and their digests, so its reads are
lean. A write refused for space (ENOSPC) raises ``StorageFullError``, any other I/O error
``StorageIOError``; every failure removes what that write created, counts, and leaves the tier
working; data already on disk is untouched.

Test hook for crash injection (tests/chaos): ``MMTIER_CRASH_STEP=<step>[:<n>]``, read once at
import (or set ``_CRASH_STEP`` / ``_CRASH_AT`` in a fresh process), SIGKILLs this process the
n-th time (default 1st) a write reaches ``step``: ``before_write`` (tmp file open, empty),
``after_write`` (bytes written, not fsynced), ``after_fsync`` (before the rename),
``after_rename`` (final name, directory not fsynced), ``after_dir_fsync`` (durable, index not
updated). Unset (production): one falsy check per step, nothing else.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import functools
import logging
import os
import signal
import uuid
from collections.abc import Sequence
from pathlib import Path

import aiofiles.os
import torch

from ..config import ModalitySpec
from ..content import ContentKey
from ..errors import (
    CorruptDataError,
    MMTierError,
    ShapeError,
    StorageFullError,
    UnknownModalityError,
)
from . import writers
from .arrow_format import (
    FILE_OVERHEAD,
    file_name,
    group_meta,
    layout_of,
    page_rows,
    page_sums,
    serialize,
    slice_rows,
)
from .disk_index import DiskEntry, DiskIndex
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

log = logging.getLogger(__name__)

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


class DiskWrites:
    """The writes into ``index``'s directory (of groups of ``model``). Thread-safe; the
    coroutines run on any event loop."""

    def __init__(self, index: DiskIndex, *, model: str, chunk_bytes: int, io_timeout_s: float,
                 write_concurrency: int, free_floor_bytes: int, io_align: int, direct_writes: bool):
        self._index = index
        self.model = model
        self.chunk_bytes = chunk_bytes
        self.io_timeout_s = io_timeout_s
        self.write_concurrency = write_concurrency
        self.free_floor_bytes = free_floor_bytes
        # each layer's extent padded to it, for O_DIRECT layer reads (``layer_extent.read_direct``)
        self.io_align = io_align
        # the writers' layer-major copies of their chunks, reused (one per write in flight)
        self.buffers = StagingPool(write_concurrency * max(chunk_bytes, MIN_BYTES))
        # files written with O_DIRECT from reused aligned images (``file_writes``), else buffered
        self.direct_writes = direct_writes
        self.write_align = direct_align(os.stat(index.dir).st_dev) if direct_writes else 1
        self._images = (StagingPool(write_concurrency * (max(chunk_bytes, MIN_BYTES) + FILE_OVERHEAD + (1 << 20)))
                        if direct_writes else None)

    async def put_many_async(self, items: Sequence[tuple[ContentKey, ModalitySpec, int,
                                                         torch.Tensor | Sequence[torch.Tensor]]]) -> list[DiskEntry]:
        """Several groups side by side (``write_concurrency`` at a time), the directory fsynced
        once at the end; the first error raised once all have finished."""
        gate = asyncio.Semaphore(self.write_concurrency)

        async def one(item) -> DiskEntry:
            async with gate:
                return await self.put_async(*item, sync_dir=False)

        results = await asyncio.gather(*(one(it) for it in items), return_exceptions=True)
        await fsync_dir(self._index.dir)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)  # type: ignore[arg-type]

    async def put_async(self, key: ContentKey, spec: ModalitySpec, num_tokens: int,
                        pages: torch.Tensor | Sequence[torch.Tensor], *, sync_dir: bool = True,
                        expected_sums: Sequence[int] | None = None) -> DiskEntry:
        """Write a group (``pages``: ``[n, *page_shape]`` or contiguous runs of it); idempotent
        per key. ``sync_dir=False`` leaves the directory fsync to the caller: the group is
        durable only after it. ``expected_sums``: the xxh3 each page should have (a host copy's
        digests); the write computes them anyway, and a difference raises
        ``CorruptDataError``, nothing written."""
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
            claimed = self._index.claim(key, need)
            if not isinstance(claimed, concurrent.futures.Future):
                break
            # The same group is being written by another call: wait for it, then look again.
            try:
                await asyncio.wait_for(asyncio.wrap_future(claimed), self.io_timeout_s)
            except TimeoutError:
                raise StorageIOError(f"another write of {key!r} did not finish in "
                                     f"{self.io_timeout_s} s") from None
        if isinstance(claimed, DiskEntry):
            return claimed
        entry = None
        written: list[Path] = []
        try:
            entry = await self._write_group(key, spec, num_tokens, n, rows, per_file, num_chunks, need,
                                            written, sync_dir, expected_sums)
        except OSError as exc:
            await _cleanup(written)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._index.count(full_errors=1)
                raise StorageFullError(f"disk full writing {key!r}: {exc}") from exc
            self._index.count(io_errors=1)
            raise StorageIOError(f"writing {key!r} failed: {exc}") from exc
        except BaseException:
            await _cleanup(written)
            raise
        finally:
            self._index.settle(claimed, entry)
        return entry

    async def _write_group(self, key, spec, num_tokens, n, rows, per_file, num_chunks, need,
                           written: list[Path], sync_dir: bool = True,
                           expected_sums: Sequence[int] | None = None) -> DiskEntry:
        directory = self._index.dir
        st = await aiofiles.os.statvfs(directory) if self.free_floor_bytes > 0 else None
        inflight = self._index.reserved_bytes   # every write in flight (this one included) may still need its bytes
        if st is not None and st.f_bavail * st.f_frsize - max(inflight, need) < self.free_floor_bytes:
            self._index.count(floor_refusals=1)
            raise StorageFullError(f"disk tier: writing {need} bytes would cross the free-space floor "
                                   f"({self.free_floor_bytes} bytes; {st.f_bavail * st.f_frsize} free)")
        loop = asyncio.get_running_loop()
        bounds = [(c * per_file, min(n, (c + 1) * per_file)) for c in range(num_chunks)]
        chunks = [slice_rows(rows, lo, hi) for lo, hi in bounds]
        if expected_sums is not None:
            sums = await loop.run_in_executor(None, page_sums, rows)
            if sums.tolist() != list(expected_sums):
                raise CorruptDataError(f"{key!r}: the pages to write differ from their checksums")
        base = {**group_meta(key.to_wire(), self.model, layout_of(spec), num_tokens, n, num_chunks),
                "writer": writers.this_writer()}
        files, extents, total = [], [], 0
        lb = spec.layer_bytes
        for c, ((lo, hi), chunk_rows) in enumerate(zip(bounds, chunks)):
            meta = {**base, "chunk": c, "first_page": lo, "chunk_pages": hi - lo}
            copied = spec.page_layers > 1 or len(chunk_rows) > 1
            buf = self.buffers.take((hi - lo) * spec.page_bytes) if copied else None
            layers = parts = None
            try:
                layers = await loop.run_in_executor(None, layer_major, chunk_rows, spec.page_layers,
                                                    buf.numpy() if buf is not None else None)
                row_sums, layer_digests = await loop.run_in_executor(None, layer_sums, layers)
                parts, offsets = serialize(meta, lb, layers, row_sums, self.io_align)
                name = file_name(key.modality, key.hex, c, num_chunks)
                size = await self._write_file(directory / name, parts, written)
                extent = None
                if offsets is not None:      # the frame digest reads the parts: before the buffer goes
                    extent = LayerExtent(name, size, lb, lo, hi - lo, tuple(offsets), layer_digests, 0)
                    extent = dataclasses.replace(extent, frame=frame_digest(parts, extent.gaps()))
            finally:
                del layers, parts            # nothing refers to the buffer once it is given back
                if buf is not None:
                    self.buffers.give(buf)
            total += size
            files.append(name)
            if extent is not None and extents is not None:
                extents.append(extent)
            else:
                extents = None
        if sync_dir:
            await fsync_dir(directory)
            if _CRASH_STEP:
                _crash_point("after_dir_fsync")
        return DiskEntry(key, self.model, layout_of(spec), num_tokens, n, total, tuple(files),
                         tuple(extents) if extents is not None else None)

    async def _write_file(self, final: Path, parts: list[object], written: list[Path]) -> int:
        tmp = final.with_name(writers.tmp_name(final.name, uuid.uuid4().hex[:12]))
        loop = asyncio.get_running_loop()
        try:
            size = await loop.run_in_executor(None, functools.partial(
                write_parts, str(tmp), parts, align=self.write_align, images=self._images,
                crash=_crash_point if _CRASH_STEP else None))
            await aiofiles.os.replace(tmp, final)
            if _CRASH_STEP:
                _crash_point("after_rename")
        except BaseException:
            await _cleanup([tmp])
            raise
        written.append(final)
        return size


async def _cleanup(paths: list[Path]) -> None:
    for p in paths:
        try:
            await aiofiles.os.unlink(p)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("mmtier disk tier: cannot remove %s: %s", p, exc)


async def fsync_dir(path: Path) -> None:
    def sync() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    await asyncio.get_running_loop().run_in_executor(None, sync)
