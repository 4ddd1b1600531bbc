"""Layer-major files (format 2) whose layout is known (``LayerExtent``), and their lean reads.

A format-2 file holds one chunk of a group's pages layer by layer: record batch ``l`` is layer
``l``'s slice of every page of the chunk, in page order (``page_bytes // L`` bytes a row), so
reading layer ``l`` of the chunk is one contiguous extent of the file. ``LayerExtent`` records,
per layer, where that extent lies and the xxh3 of its bytes, and the xxh3 of every byte outside
the extents (the "frame": magics, schema, metadata, checksum column, footer). The writer keeps
them from the bytes it wrote, a first full read (``arrow_format.read_file``) from the verified
bytes it read; a damaged file cannot vouch for itself.

- ``read_layer_extent``: one layer of every page of the file: one ``preadv`` of one extent
  straight into a one-layer destination, then the size and that layer's digest checked. Only
  the bytes returned are read and verified (a changed byte elsewhere is noticed by the next
  read that returns it). Where the extent's offset and length and the destination's address
  are multiples of the device's logical block size (the writer pads each layer's extent to
  it: ``arrow_format.serialize``; ``StagingPool`` buffers are page-aligned), the read is
  ``O_DIRECT`` (``read_direct``): the device writes into the destination, with no page-cache
  copy and no page-cache pages to add and reclaim (on the development machine those two
  took about half of a streamed decode's CPU). Anything else, or a file system that refuses
  ``O_DIRECT``, reads buffered, with the next layer's extent handed to the kernel meanwhile.
- ``read_whole``: the whole file into whole (page-major) pages: one sequential pass, each
  layer's extent scattered straight into its slice of every page (``preadv``, no copy), the
  frame into small buffers; then the size, the frame's and every layer's xxh3 checked.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from ..errors import CorruptDataError

if TYPE_CHECKING:
    from .dest_pages import DestPages, DestTokens

_IOV_MAX = 512
_MIN_ALIGN = 512                      # no device has a smaller logical block
# Extents the writer pads to the device's block (for O_DIRECT reads): from this size a pad of
# under one block costs at most 0.8 % of the bytes at 512-byte blocks (6 % at 4 KiB), and
# the page-cache copy it saves is worth more than the syscalls; smaller ones read buffered.
DIRECT_MIN_EXTENT = 64 << 10
_DIRECT_REFUSED: set[str] = set()     # directories whose file system refused O_DIRECT


@dataclass(frozen=True)
class LayerExtent:
    """Where one layer-major file's layers lie: the file's ``size``; the chunk's ``first`` page
    of the group and its ``pages``; per layer the file offset of its extent (``pages *
    layer_bytes`` contiguous bytes) and that extent's xxh3; ``frame``, the xxh3 of every byte
    outside the extents, in file order."""

    name: str
    size: int
    layer_bytes: int
    first: int
    pages: int
    offsets: tuple[int, ...]
    digests: tuple[int, ...]
    frame: int

    @property
    def num_layers(self) -> int:
        return len(self.offsets)

    @property
    def num_pages(self) -> int:
        return self.pages

    @property
    def page_bytes(self) -> int:
        return self.layer_bytes * self.num_layers

    def gaps(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of the bytes outside the layer extents, in file order."""
        out, at = [], 0
        span = self.pages * self.layer_bytes
        for offset in sorted(self.offsets):
            if offset > at:
                out.append((at, offset - at))
            at = max(at, offset + span)
        if at < self.size:
            out.append((at, self.size - at))
        return out


def digest_of_slices(slices: Sequence[np.ndarray]) -> int:
    """xxh3 of ``slices`` taken in order (what one layer extent of the file holds)."""
    h = xxhash.xxh3_64()
    for s in slices:
        h.update(s)
    return h.intdigest()


def _check_size(fd: int, extent: LayerExtent) -> None:
    size = os.fstat(fd).st_size
    if size != extent.size:
        raise CorruptDataError(f"{extent.name}: {size} bytes, {extent.size} were written")


def read_layer_extent(path: str, extent: LayerExtent, layer: int, dest: DestPages, ahead: int = 0,
                      direct: bool = True) -> int:
    """Layer ``layer`` of the file's pages into ``dest`` (one-layer pages, group-indexed): one
    ``preadv`` of the layer's extent, then its digest checked. Returns the pages read.

    ``direct``: read with ``O_DIRECT`` where the extent and the destination are aligned to the
    device's logical block (``read_direct``; else, or where refused, buffered). ``ahead`` (a
    buffered read only): the extents of that many following layers are handed to the kernel to
    read meanwhile (``POSIX_FADV_WILLNEED``: asynchronous, into the page cache, which bounds
    it), so the disk reads the next layer while the caller computes this one."""
    if dest.page_bytes != extent.layer_bytes or not 0 <= layer < extent.num_layers:
        raise CorruptDataError(f"{extent.name}: layer {layer} of {extent.num_layers} "
                               f"({extent.layer_bytes} bytes) does not fit pages of {dest.page_bytes} bytes")
    views = dest.views(extent.first, extent.pages)
    offset, span = extent.offsets[layer], extent.pages * extent.layer_bytes
    target = _direct_target(views, offset, span) if direct else None
    if target is None or not read_direct(path, extent, target, offset):
        fd = os.open(path, os.O_RDONLY)
        try:
            _check_size(fd, extent)
            preadv_exact(fd, [v.reshape(-1) for v in views], offset)
            if ahead:
                piece = readahead_bytes(os.fstat(fd).st_dev)
                for nxt in range(layer + 1, min(layer + 1 + ahead, extent.num_layers)):
                    for at in range(0, span, piece):      # the kernel reads at most its readahead a call
                        os.posix_fadvise(fd, extent.offsets[nxt] + at, min(piece, span - at),
                                         os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
    got = xxhash.xxh3_64_intdigest(target) if target is not None else \
        digest_of_slices([v.reshape(-1) for v in views])
    if got != extent.digests[layer]:
        raise CorruptDataError(f"{extent.name}: page data of layer {layer} changed")
    return extent.pages


def _direct_target(views: Sequence[np.ndarray], offset: int, span: int) -> np.ndarray | None:
    """The destination as one flat array if an ``O_DIRECT`` read may fill it (one contiguous
    run; its address, the offset and the length multiples of the smallest logical block)."""
    if len(views) != 1 or not views[0].flags.c_contiguous:
        return None
    flat = views[0].reshape(-1)
    if (flat.ctypes.data | offset | span) % _MIN_ALIGN:
        return None
    return flat


def open_direct(path: str) -> int | None:
    """``path`` opened for reading with ``O_DIRECT``; ``None`` where its file system refuses it
    (remembered per folder: not tried there again). Other errors raise."""
    folder = os.path.dirname(path)
    if folder in _DIRECT_REFUSED:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        refuse_direct(folder)
        return None


def refuse_direct(folder: str) -> None:
    """Remember that the file system of ``folder`` refused an ``O_DIRECT`` open or read:
    ``open_direct`` answers ``None`` there from now on (the reads go buffered)."""
    _DIRECT_REFUSED.add(folder)


def read_direct(path: str, extent: LayerExtent, buf: np.ndarray, offset: int) -> bool:
    """Fill ``buf`` from ``offset`` of the file with ``O_DIRECT`` reads (the device writes into
    ``buf``: no page cache, no copy) after checking the file's size. ``False`` where that
    cannot be done -- the file system refuses ``O_DIRECT``, or the device's logical block is
    larger than the alignment of ``buf``, the offset or the length -- and nothing is promised
    of ``buf``: the caller reads buffered. The caller checks the digest either way."""
    fd = open_direct(path)
    if fd is None:
        return False
    try:
        st = os.fstat(fd)
        if st.st_size != extent.size:
            raise CorruptDataError(f"{extent.name}: {st.st_size} bytes, {extent.size} were written")
        if (buf.ctypes.data | offset | buf.nbytes) % direct_align(st.st_dev):
            return False
        try:
            preadv_exact(fd, [buf], offset)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            return False
        return True
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=64)
def direct_align(dev: int) -> int:
    """The alignment ``O_DIRECT`` needs on device ``dev`` (of address, offset and length): its
    logical block size (``queue/logical_block_size``); 4096 if unknown."""
    for queue in (f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue",
                  f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/../queue"):
        try:
            with open(f"{queue}/logical_block_size") as f:
                return max(_MIN_ALIGN, int(f.read()))
        except (OSError, ValueError):
            continue
    return 4096


def read_whole(path: str, extent: LayerExtent, dest: DestPages | DestTokens) -> int:
    """The whole file into ``dest`` (whole pages, group-indexed, or a group's tokens) in one
    sequential pass; every
    byte checked against the digests held in memory. Returns the pages read."""
    if dest.page_bytes != extent.page_bytes:
        raise CorruptDataError(f"{extent.name}: pages of {extent.page_bytes} bytes, not {dest.page_bytes}")
    pieces: list[tuple[int, int, object]] = []          # (offset, layer or -1, buffers)
    frame: list[bytearray] = []
    for offset, length in extent.gaps():
        buf = bytearray(length)
        frame.append(buf)
        pieces.append((offset, -1, [buf]))
    per_layer = [dest.layer_slices(extent.first, extent.pages, layer, extent.layer_bytes)
                 for layer in range(extent.num_layers)]
    for layer, offset in enumerate(extent.offsets):
        pieces.append((offset, layer, per_layer[layer]))
    pieces.sort(key=lambda p: p[0])
    fd = os.open(path, os.O_RDONLY)
    try:
        _check_size(fd, extent)
        bufs = [b for _, _, bs in pieces for b in bs]    # type: ignore[attr-defined]
        preadv_exact(fd, bufs, 0)
    finally:
        os.close(fd)
    if digest_of_slices(frame) != extent.frame:          # type: ignore[arg-type]
        raise CorruptDataError(f"{extent.name}: bytes outside the pages changed")
    for layer, slices in enumerate(per_layer):
        if digest_of_slices(slices) != extent.digests[layer]:
            raise CorruptDataError(f"{extent.name}: page data of layer {layer} changed")
    return extent.pages


@functools.lru_cache(maxsize=64)
def readahead_bytes(dev: int) -> int:
    """The most one ``POSIX_FADV_WILLNEED`` reads on device ``dev`` (Linux caps it at the
    device's readahead, ``queue/read_ahead_kb``); 128 KiB, the usual default, if unknown."""
    for queue in (f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue",
                  f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/../queue"):
        try:
            with open(f"{queue}/read_ahead_kb") as f:
                return max(128, int(f.read())) << 10
        except (OSError, ValueError):
            continue
    return 128 << 10


def preadv_exact(fd: int, bufs: Sequence[object], offset: int) -> None:
    """Fill ``bufs`` (consecutive in the file from ``offset``), ``_IOV_MAX`` buffers a call,
    however the reads split; a short file raises ``CorruptDataError``."""
    mvs = [memoryview(b).cast("B") for b in bufs]  # type: ignore[arg-type]
    mvs = [m for m in mvs if m.nbytes]
    i = 0
    while i < len(mvs):
        n = os.preadv(fd, mvs[i:i + _IOV_MAX], offset)
        if n == 0:
            raise CorruptDataError(f"file ends early (offset {offset})")
        offset += n
        while n and i < len(mvs):
            if n >= mvs[i].nbytes:
                n -= mvs[i].nbytes
                i += 1
            else:
                mvs[i] = mvs[i][n:]
                n = 0


def frame_digest(parts: Sequence[object], gaps: list[tuple[int, int]]) -> int:
    """xxh3 of the bytes of ``parts`` (a file, in order) that fall in ``gaps``."""
    h, pos = xxhash.xxh3_64(), 0
    for p in parts:
        mv = memoryview(p).cast("B")  # type: ignore[arg-type]
        n = mv.nbytes
        for offset, length in gaps:
            lo, hi = max(offset, pos), min(offset + length, pos + n)
            if lo < hi:
                h.update(mv[lo - pos:hi - pos])
        pos += n
    return h.intdigest()


def read_frame(fd: int, gaps: list[tuple[int, int]]) -> int:
    """xxh3 of the bytes in ``gaps`` as the file holds them now."""
    h = xxhash.xxh3_64()
    for offset, length in gaps:
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise CorruptDataError(f"file ends inside its frame (offset {offset})")
        h.update(data)
    return h.intdigest()


def layer_major(rows: Sequence[np.ndarray], num_layers: int, out: np.ndarray | None = None) -> list[np.ndarray]:
    """A chunk's pages (``[k, page_bytes]`` uint8 runs) as ``num_layers`` contiguous ``[k,
    page_bytes // num_layers]`` arrays, layer ``l``'s slices of every page in page order: the
    record batches of a layer-major file (one copy; none for one run of one-layer pages).
    ``out``: a uint8 buffer of at least the chunk's bytes that the layers are laid into (a
    writer's reused buffer: fresh memory costs a fault and a zeroed page per 4 KiB)."""
    if num_layers == 1 and len(rows) == 1:
        return [rows[0]]
    lb = rows[0].shape[1] // num_layers
    if out is None:
        return [np.concatenate([r[:, layer * lb:(layer + 1) * lb] for r in rows]) for layer in range(num_layers)]
    k = sum(r.shape[0] for r in rows)
    if out.dtype != np.uint8 or out.ndim != 1 or out.shape[0] < num_layers * k * lb:
        raise ValueError(f"layer_major: out must be uint8 [>= {num_layers * k * lb}]")
    layers = list(out[:num_layers * k * lb].reshape(num_layers, k, lb))
    for layer, dst in enumerate(layers):
        np.concatenate([r[:, layer * lb:(layer + 1) * lb] for r in rows], out=dst)
    return layers


def layer_sums(layers: Sequence[np.ndarray]) -> tuple[np.ndarray, tuple[int, ...]]:
    """The xxh3 of every row of ``layers`` (layer-major: the file's checksum column) and of each
    layer's whole extent."""
    rows = np.fromiter((xxhash.xxh3_64_intdigest(row) for lay in layers for row in lay), dtype=np.uint64)
    return rows, tuple(xxhash.xxh3_64_intdigest(lay) for lay in layers)
