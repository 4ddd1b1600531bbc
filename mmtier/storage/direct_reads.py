"""Whole-file reads of layer-major files with ``O_DIRECT``, through reused aligned windows.

``layer_extent.read_whole`` scatters each layer's extent straight into its slice of every
(page-major) page with one buffered ``preadv``: the device's bytes go through the page cache,
which on the development VM cost about as much system time as the disk took (0.25-0.5 s per
512 MiB), and the file's pages then sit in the cache beside the host tier. ``read_whole_direct``
reads the file with ``O_DIRECT`` instead, in windows of ``WINDOW_BYTES`` (aligned to the
device's block, so several layer extents and the frame between them come in one request;
the last window ends at the end of the file, a short read) into a 4 KiB-aligned buffer from a
``StagingPool``, and from there, warm memory, checks each byte against the digests the writer
kept (a frame hasher and one per layer, fed in file order) and copies each layer's bytes into
its slices of the pages (or of the group's K and V: ``dest_pages.DestTokens``). With ``ahead``
(an executor) the next ``depth`` windows are read while this one is checked and copied, each
into a buffer of its own. Windows of 2 MiB, 5 ahead (12 MiB in flight a file): a lone group
read keeps the device as busy as a batch reading several files side by side; measured on the
development VM (32 MiB groups, page cache dropped), a lone ``read_group`` went from 1.5x the
per-group time of ``read_groups`` with 8 MiB windows 2 ahead to 1.1x, the batch unchanged;
1 MiB windows 7 ahead were slower again (a window's Python work).

Nothing here needs the extents to be aligned: the windows are. Files under
``DIRECT_MIN_FILE`` bytes are left to the buffered read (one small request either way), as is
any file on a file system that refuses ``O_DIRECT`` (``None``: nothing was promised of the
destination; the directory is remembered and never tried again) and a device whose block is
larger than the pool's alignment. A damaged or short file raises ``CorruptDataError`` as the
buffered read does; the destination's contents are then undefined.
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from ..errors import CorruptDataError
from .layer_extent import LayerExtent, direct_align, open_direct, refuse_direct
from .staging import ALIGN, StagingPool

if TYPE_CHECKING:
    from .dest_pages import DestPages, DestTokens

WINDOW_BYTES = 2 << 20
DIRECT_MIN_FILE = 64 << 10
AHEAD_WINDOWS = 5


def read_whole_direct(path: str, extent: LayerExtent, dest: DestPages | DestTokens, windows: StagingPool,
                      ahead: Executor | None = None, window: int = WINDOW_BYTES,
                      depth: int = AHEAD_WINDOWS) -> int | None:
    """The whole file into ``dest`` (whole pages, group-indexed, or the group's tokens), read
    with ``O_DIRECT`` and verified as ``read_whole``; the pages read, or ``None`` where it
    cannot be read direct (the caller reads buffered; nothing was written to ``dest`` then)."""
    if dest.page_bytes != extent.page_bytes:
        raise CorruptDataError(f"{extent.name}: pages of {extent.page_bytes} bytes, not {dest.page_bytes}")
    folder = os.path.dirname(path)
    if extent.size < DIRECT_MIN_FILE:
        return None
    fd = open_direct(path)
    if fd is None:
        return None
    bufs: list = []
    pending: dict[int, Future] = {}
    try:
        st = os.fstat(fd)
        if st.st_size != extent.size:
            raise CorruptDataError(f"{extent.name}: {st.st_size} bytes, {extent.size} were written")
        align = direct_align(st.st_dev)
        if align > ALIGN or window % align:
            return None
        size = extent.size
        window = min(window, -(-size // align) * align)
        starts = list(range(0, size, window))
        nbuf = min(len(starts), 1 + (depth if ahead is not None else 0))
        bufs = [windows.take(window) for _ in range(nbuf)]
        arrays = [b.numpy()[:window] for b in bufs]
        scatter = _Scatter(extent, dest)

        def read(j: int) -> int:
            if ahead is None:
                return _read_window(fd, arrays[j % nbuf], starts[j], size)
            fut = pending.pop(j)
            return fut.result()

        if ahead is not None:
            for j in range(nbuf):
                pending[j] = ahead.submit(_read_window, fd, arrays[j], starts[j], size)
        for i in range(len(starts)):
            try:
                got = read(i)
            except OSError as exc:         # refused at the first read: nothing written to dest
                if i or exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                refuse_direct(folder)
                return None
            scatter.take(starts[i], arrays[i % nbuf][:got])
            if ahead is not None and i + nbuf < len(starts):
                pending[i + nbuf] = ahead.submit(_read_window, fd, arrays[i % nbuf], starts[i + nbuf], size)
        scatter.check()
        return extent.pages
    finally:
        for fut in pending.values():       # a failure: reads still in flight own the buffers
            try:
                fut.result()
            except Exception:  # noqa: BLE001, S110 -- moot: the read already failed
                pass
        os.close(fd)
        for b in bufs:
            windows.give(b)


def _read_window(fd: int, buf: np.ndarray, start: int, size: int) -> int:
    """Fill ``buf`` from ``start`` up to its end or the file's ``size`` (the last window: an
    aligned request that the end of the file cuts short); the bytes read."""
    want = min(buf.nbytes, size - start)
    at = 0
    while at < want:
        n = os.preadv(fd, [memoryview(buf[at:])], start + at)
        if n == 0:
            raise CorruptDataError(f"file ends early (offset {start + at}, {size} bytes expected)")
        at += n
    return want


class _Scatter:
    """Consumes the file's bytes window by window, in order: each piece's share is hashed
    (the frame's and each layer's xxh3, streamed) and a layer's copied into its slices of
    the pages (or the group's tokens: ``dest_pages.DestTokens``); ``check`` compares the
    digests once the whole file went by."""

    def __init__(self, extent: LayerExtent, dest: DestPages):
        self.extent = extent
        self.lb = extent.layer_bytes
        self.span = extent.pages * extent.layer_bytes
        self._copy = dest.layer_writer(extent.first, extent.pages, extent.layer_bytes)
        pieces = [(off, ln, -1) for off, ln in extent.gaps()]
        pieces += [(off, self.span, layer) for layer, off in enumerate(extent.offsets)]
        self.pieces = sorted(pieces)
        self.frame = xxhash.xxh3_64()
        self.layers = [xxhash.xxh3_64() for _ in extent.offsets]
        self.next = 0                        # the first piece not wholly consumed

    def take(self, start: int, data: np.ndarray) -> None:
        end = start + data.nbytes
        i = self.next
        while i < len(self.pieces):
            off, ln, layer = self.pieces[i]
            if off >= end:
                break
            lo, hi = max(off, start), min(off + ln, end)
            if lo < hi:
                part = data[lo - start:hi - start]
                if layer < 0:
                    self.frame.update(part)
                else:
                    self.layers[layer].update(part)
                    self._copy(layer, lo - off, part)
            if off + ln > end:
                break
            i += 1
        self.next = i

    def check(self) -> None:
        name = self.extent.name
        if self.next != len(self.pieces):
            raise CorruptDataError(f"{name}: file ends early")
        if self.frame.intdigest() != self.extent.frame:
            raise CorruptDataError(f"{name}: bytes outside the pages changed")
        for layer, h in enumerate(self.layers):
            if h.intdigest() != self.extent.digests[layer]:
                raise CorruptDataError(f"{name}: page data of layer {layer} changed")

