"""Files whose layout is known (``FileExtent``): their digests, and the lean reads that trust
nothing but those digests held in memory (the Arrow format itself: ``arrow_format.py``).

A ``FileExtent`` records, per row block of pages, where the block lies in the file, the xxh3
of the whole block and one xxh3 per layer (a page of ``L`` layers is ``L`` contiguous slices
of ``page_bytes // L`` bytes; layer ``l``'s digest covers slice ``l`` of every page of the
block, in page order; an embedding page is one layer); and the xxh3 of every byte outside the
blocks (the "frame"). The writer computes all of them from the bytes it wrote, a first full
read (``read_file``) from the verified pages it just read.

- ``read_extent``: the whole group file, one ``preadv`` of the file (blocks straight into the
  destination), then the size, the frame's and every block's xxh3 checked: every byte of the
  file is verified, no Arrow parsing.
- ``read_layer``: one layer of every page, one read per page slice (one ``preadv`` per block
  when a page is a single layer) straight into a one-layer destination, then the size and each
  block's digest of that layer checked. Only the bytes returned are read and verified: a
  changed byte in another layer or in the frame goes unnoticed here, and that is fine, since
  nothing of it is returned (the next whole read notices it).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from ..errors import CorruptDataError

if TYPE_CHECKING:
    from .arrow_format import DestPages


@dataclass(frozen=True)
class FileExtent:
    """Where one file's pages lie, as the writer (or a first verified read) found them: the
    file's size; per row block ``(file offset, first page of the group, pages, xxh3 of the
    block)``; ``frame``, the xxh3 of every byte outside the blocks (magics, schema, metadata,
    checksum column, footer), in file order; and ``layers``, per row block (as ``runs``) the
    xxh3 of each layer's slices of its pages (``layer_digests``)."""

    name: str
    size: int
    page_bytes: int
    runs: tuple[tuple[int, int, int, int], ...]
    frame: int
    layers: tuple[tuple[int, ...], ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers[0]) if self.layers else 1

    def gaps(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of the bytes outside the page blocks, in file order."""
        return frame_gaps(self.runs, self.size, self.page_bytes)

    @functools.cached_property
    def plan(self) -> tuple[tuple[int, int | None, int, int], ...]:
        """The whole file in order, as one ``preadv`` fills it: ``(offset, first page, pages,
        digest)`` for a block of pages, ``(offset, None, length, 0)`` for frame bytes."""
        pieces = [(o, None, n, 0) for o, n in self.gaps()]
        pieces += [(o, first, k, d) for o, first, k, d in self.runs]
        return tuple(sorted(pieces, key=lambda p: p[0]))


def frame_gaps(runs, size: int, page_bytes: int) -> list[tuple[int, int]]:
    out, at = [], 0
    for offset, _, k, *_ in sorted(runs):
        if offset > at:
            out.append((at, offset - at))
        at = max(at, offset + k * page_bytes)
    if at < size:
        out.append((at, size - at))
    return out


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


def digest_of(arrays: Sequence[np.ndarray]) -> int:
    """xxh3 of the bytes of ``arrays`` taken in order (a block of pages, maybe in runs)."""
    if len(arrays) == 1:
        return xxhash.xxh3_64_intdigest(arrays[0])
    h = xxhash.xxh3_64()
    for a in arrays:
        h.update(a)
    return h.intdigest()


def layer_digests(arrays: Sequence[np.ndarray], num_layers: int) -> tuple[int, ...]:
    """Per layer, the xxh3 of that layer's slice of every page of ``arrays`` (``[k,
    page_bytes]`` rows, a block maybe in runs), in page order: exactly the bytes of the
    block's pages in a one-layer destination."""
    if num_layers == 1:
        return (digest_of(arrays),)
    out = []
    for layer in range(num_layers):
        h = xxhash.xxh3_64()
        for a in arrays:
            lb = a.shape[1] // num_layers
            for row in a[:, layer * lb:(layer + 1) * lb]:
                h.update(row)
        out.append(h.intdigest())
    return tuple(out)


def write_digests(chunks: list[list[np.ndarray]], layers: int
             ) -> list[tuple[np.ndarray, list[int], list[tuple[int, ...]]]]:
    """Per file chunk (its row blocks): the xxh3 of each page, of each block, and per block of
    each layer's slices, in one pass over memory: each page is read once from memory and hashed
    whole, then fed, while it sits in the CPU's cache, to its block's and its layers' running
    digests (the same digests ``digest_of`` / ``layer_digests`` give over the same bytes)."""
    out = []
    for rows in chunks:
        pages: list[int] = []
        blocks: list[int] = []
        per_layer: list[tuple[int, ...]] = []
        for r in rows:
            hb = xxhash.xxh3_64()
            hl = [xxhash.xxh3_64() for _ in range(layers)] if layers > 1 else []
            lb = r.shape[1] // layers
            for row in r:
                pages.append(xxhash.xxh3_64_intdigest(row))
                hb.update(row)
                for layer, h in enumerate(hl):
                    h.update(row[layer * lb:(layer + 1) * lb])
            blocks.append(hb.intdigest())
            per_layer.append(tuple(h.intdigest() for h in hl) if hl else (blocks[-1],))
        out.append((np.array(pages, dtype=np.uint64), blocks, per_layer))
    return out


def read_layer(path: str, extent: FileExtent, layer: int, dest: DestPages) -> int:
    """Layer ``layer`` of every page of a file whose layout is known, read straight into
    ``dest`` (one-layer pages): one read per page slice, or one ``preadv`` per block when a
    page is one layer; the size and each block's digest of that layer are checked against
    what was written. Any difference raises ``CorruptDataError``; returns the pages read."""
    num_layers = extent.num_layers
    lb = extent.page_bytes // num_layers
    if dest.page_bytes != lb or not 0 <= layer < num_layers:
        raise CorruptDataError(f"{extent.name}: layer {layer} of {num_layers} ({lb} bytes) does not "
                               f"fit pages of {dest.page_bytes} bytes")
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != extent.size:
            raise CorruptDataError(f"{extent.name}: {size} bytes, {extent.size} were written")
        pages = 0
        for (offset, first, k, _), sums in zip(extent.runs, extent.layers, strict=True):
            views = dest.views(first, k)
            if num_layers == 1:
                _preadv_exact(fd, [memoryview(v.reshape(-1)) for v in views], offset)
            else:
                at = offset + layer * lb
                for v in views:
                    for row in v:
                        _preadv_exact(fd, [memoryview(row)], at)
                        at += extent.page_bytes
            if digest_of(views) != sums[layer]:       # checked while the block is hot
                raise CorruptDataError(f"{extent.name}: page data of layer {layer} changed")
            pages += k
    finally:
        os.close(fd)
    return pages


def read_extent(path: str, extent: FileExtent, dest: DestPages) -> int:
    """The lean read of a file whose layout the index already knows, with no Arrow parsing:
    one ``preadv`` of the whole file, the page blocks landing straight in ``dest`` and the
    rest in small buffers; then every byte is checked against what was written (the size, the
    frame's xxh3, each block's xxh3; all held in memory, so a damaged file cannot vouch for
    itself). Any difference raises ``CorruptDataError``; returns the pages read."""
    if extent.page_bytes != dest.page_bytes:
        raise CorruptDataError(f"{extent.name}: pages of {extent.page_bytes} bytes, not {dest.page_bytes}")
    bufs: list = []
    frame: list[bytearray] = []
    blocks: list[tuple[list[np.ndarray], int]] = []
    pages = 0
    for _, first, n, digest in extent.plan:
        if first is None:
            buf = bytearray(n)
            frame.append(buf)
            bufs.append(buf)
        else:
            views = dest.views(first, n)
            blocks.append((views, digest))
            bufs.extend(views)
            pages += n
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != extent.size:
            raise CorruptDataError(f"{extent.name}: {size} bytes, {extent.size} were written")
        got = os.preadv(fd, bufs, 0) if len(bufs) <= _IOV_MAX else 0
        if got != size:
            _preadv_exact(fd, [memoryview(b) for b in bufs], 0)
    finally:
        os.close(fd)
    if digest_of(frame) != extent.frame:  # type: ignore[arg-type]
        raise CorruptDataError(f"{extent.name}: bytes outside the pages changed")
    for views, digest in blocks:
        if digest_of(views) != digest:
            raise CorruptDataError(f"{extent.name}: page data changed")
    return pages


def _preadv_exact(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Fill ``bufs`` (consecutive in the file from ``offset``), however the reads split."""
    bufs = [b.cast("B") for b in bufs if b.nbytes]
    while bufs:
        n = os.preadv(fd, bufs[:_IOV_MAX], offset)
        if n == 0:
            raise CorruptDataError(f"file ends early (offset {offset})")
        offset += n
        while n and bufs:
            if n >= bufs[0].nbytes:
                n -= bufs[0].nbytes
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][n:]
                n = 0


_IOV_MAX = 512
