"""Per-page xxh3 digests of host pages, taken in the same pass as the copy that moves them.

A host entry keeps one xxh3 per page (the disk files keep the same). Hashing a page in a pass
of its own costs a second read of memory. Where the native helper is built
(``native.digests``), the copy takes each page's xxh3 from the registers it loads anyway:
into the slab (``copy_in_digested``; a put's token-major K/V straight into slots,
``kv_in_digested``, which also tests every element for NaN / Inf), out of it into K/V tensors (``copy_out_verified``, every
page checked against its digest as it is copied, the first bad page's destination poisoned)
and into a device pool's pages (``copy_to_verified``). Elsewhere each chunk is hashed with
``xxhash`` right after it landed, while it sits in the CPU's cache (``copy_and_digest``), and
reads check pages before copying them (``HostEntry.checked_pages``). The copies out read
their source as a ``DigestedPages`` (what a ``HostEntry`` offers), so this module sits below
``host_slabs``, which calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
import xxhash

from ..errors import CorruptDataError
from ..native import digests as native_digests
from ..native import rows as native_rows
from ..native.rows import merge_dims


class DigestedPages(Protocol):
    """What the verified copies read of the pages they copy out: a host entry
    (``host_slabs.HostEntry``): the slab, the group's slots in it, each page's xxh3 (``None``:
    not taken) and the error a mismatch raises (counted by the entry)."""

    @property
    def slab_view(self) -> torch.Tensor: ...

    @property
    def num_pages(self) -> int: ...

    @property
    def slots(self) -> tuple[int, ...]: ...

    @property
    def sums(self) -> tuple[int, ...] | None: ...

    def corrupt(self, detail: str) -> CorruptDataError: ...


_CHUNK = 256 << 10      # copied, then hashed while it sits in the CPU's cache


def copy_and_digest(dst: np.ndarray, src: np.ndarray) -> list[int]:
    """Copy ``src`` rows (pages, uint8) into ``dst`` chunk by chunk (libc's memcpy) and return
    each destination page's xxh3, each chunk hashed right after it landed: one pass over
    memory for the copy and the digest together, instead of two."""
    out = []
    for dst_row, src_row in zip(dst, src):
        h = xxhash.xxh3_64()
        for at in range(0, dst_row.shape[0], _CHUNK):
            part = dst_row[at:at + _CHUNK]
            np.copyto(part, src_row[at:at + _CHUNK])
            h.update(part)
        out.append(h.intdigest())
    return out


def page_rows_of(run: torch.Tensor) -> np.ndarray:
    """A run of pages as ``[pages, page_bytes]`` uint8 rows (a view of the slab)."""
    return run.reshape(run.shape[0], -1).view(torch.uint8).numpy()


def _page_addrs(view: torch.Tensor, ids: Sequence[int]) -> np.ndarray:
    step = view.stride(0) * view.element_size()
    return view.data_ptr() + np.asarray(ids, dtype=np.int64) * step


def copy_in_digested(dst_view: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor,
                     src_ids: Sequence[int]) -> list[int] | None:
    """Pages ``src[src_ids[i]]`` into ``dst_view[dst_ids[i]]`` (whole contiguous pages, CPU), the
    xxh3 of each taken by the copy, in the order of the ids; ``None`` where the native helper
    does not apply (nothing copied)."""
    if (src.device.type != "cpu" or dst_view.device.type != "cpu" or src.dtype != dst_view.dtype
            or not src[0].is_contiguous() or not dst_view[0].is_contiguous() or not native_digests.available()):
        return None
    page_bytes = src[0].numel() * src.element_size()
    res = native_digests.copy_digest(_page_addrs(dst_view, dst_ids), _page_addrs(src, src_ids),
                                     ([], [], [], page_bytes))
    return None if res is None else res.digests


def kv_in_digested(slab: torch.Tensor, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor,
                   tally: native_rows.Tally | None = None) -> list[int] | None:
    """Token ``t`` of ``k, v [L, n, H, D]`` (CPU tensors of one shape and strides, the slab's
    dtype) into page ``slots[t // P]`` of a page-major host ``slab``, the xxh3 of each page taken
    by the copy that moves it (the page's bytes in page order: each page's rows walked in the
    slab's order, K then V of a layer) and, with ``tally``, every element tested for NaN / Inf
    on the way; a partial last page is copied by the row copy, then hashed. ``None`` where the
    native helper does not apply (nothing copied)."""
    check = native_rows.CHECK_KINDS.get(k.dtype, 0) if tally is not None else 0
    if (not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4
            or k.device.type != "cpu" or v.device.type != "cpu" or slab.device.type != "cpu"
            or k.dtype != slab.dtype or v.dtype != slab.dtype or k.shape != v.shape
            or k.stride() != v.stride() or k.stride(-1) != 1 or (tally is not None and not check)
            or not native_digests.available()):
        return None
    es, P = k.element_size(), slab.shape[3]
    n = k.shape[1]
    full = n // P
    s = [x * es for x in slab.stride()[1:5]]       # a page's L, 2, P, H
    dims = [(k.shape[0], s[0], k.stride(0) * es), (2, s[1], v.data_ptr() - k.data_ptr()),
            (P, s[2], k.stride(1) * es), (slab.shape[4], s[3], k.stride(2) * es)]
    space = _in_order(dims, slab.shape[5] * es)     # walked in the page's order: its own xxh3
    sums: list[int] = []
    if full:
        dst = _page_addrs(slab, slots[:full])
        src = k.data_ptr() + np.arange(full, dtype=np.int64) * (P * k.stride(1) * es)
        res = native_digests.copy_digest(dst, src, space, check=check, threads=torch.get_num_threads())
        if res is None:
            return None
        sums = res.digests
        if tally is not None:
            tally.checked += 1
            tally.nonfinite |= res.nonfinite
    if full < len(slots):                            # the partial last page
        page, rest = slab[slots[full]], n - full * P
        for j, src_t in ((0, k), (1, v)):
            dst_t = page[:, j, :rest]
            if not native_rows.copy_view(dst_t, src_t[:, full * P:], tally=tally):
                if tally is not None:
                    tally.unchecked += 1
                dst_t.copy_(src_t[:, full * P:])
        sums.append(xxhash.xxh3_64_intdigest(page_rows_of(page[None])[0]))
    return sums


def _in_order(dims: list[tuple[int, int, int]], row: int) -> tuple[list[int], list[int], list[int], int] | None:
    """``rows.row_space``'s form of ``(size, dst_stride, src_stride)`` dims (byte strides) kept in
    the order given (outermost first; ``merge_dims`` puts them in the source's order instead):
    dims of size 1 dropped, a dim that runs on into the next on both sides merged with it, whole
    rows back to back joined."""
    merged: list[tuple[int, int, int]] = []
    for size, ds, ss in dims:
        if size == 1:
            continue
        if merged and merged[-1][1] == ds * size and merged[-1][2] == ss * size:
            merged[-1] = (merged[-1][0] * size, ds, ss)
        else:
            merged.append((size, ds, ss))
    while merged and merged[-1][1] == row and merged[-1][2] == row:
        row *= merged.pop()[0]
    if len(merged) > native_rows.MAX_DIMS:
        return None
    return [m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged], row


def copy_to_verified(entry: DigestedPages, dst_view: torch.Tensor, dst_ids: Sequence[int]) -> bool:
    """The entry's pages into rows ``dst_ids`` of a CPU page-major view, each checked against
    its digest as it is copied (``CorruptDataError``, counted, at the first that differs: its
    destination page poisoned, nothing after it copied). ``False`` where the native helper
    does not apply (nothing copied)."""
    slab = entry.slab_view
    if entry.sums is None or dst_view.device.type != "cpu" or dst_view.dtype != slab.dtype:
        return False
    if not dst_view[0].is_contiguous() or not native_digests.available():
        return False
    page_bytes = slab[0].numel() * slab.element_size()
    res = native_digests.copy_digest(_page_addrs(dst_view, dst_ids), _page_addrs(slab, entry.slots),
                                     ([], [], [], page_bytes), expect=entry.sums)
    return _settled(entry, res)


def copy_out_verified(entry: DigestedPages, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The entry's tokens into ``k, v`` (``[L, n, H, D]``, or block-split ``[L, blocks, P, H,
    D]``; CPU tensors of one shape, strides and the entry's dtype), every page checked against
    its digest by the copy that moves it; a partial last page is checked with ``xxhash`` first,
    then copied. At the first page that differs: ``CorruptDataError`` (counted), that page's
    destination poisoned (NaN bytes), nothing after it copied. ``False`` where the native
    helper does not apply (nothing copied; the caller checks and copies by itself)."""
    slab = entry.slab_view                        # [slots, L, 2, P, H, D]
    if (entry.sums is None or not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor)
            or k.device.type != "cpu" or v.device.type != "cpu" or k.dtype != slab.dtype
            or v.dtype != slab.dtype or k.stride() != v.stride() or k.stride(-1) != 1
            or not native_digests.available()):
        return False
    es, P = k.element_size(), slab.shape[3]
    gap = v.data_ptr() - k.data_ptr()             # K and V are one index apart: V at k + gap
    s = [x * es for x in slab.stride()[1:5]]      # the page's L, 2, P, H
    if k.dim() == 5:
        full, token_step, block_step = k.shape[1], k.stride(2) * es, k.stride(1) * es
        heads = k.stride(3) * es
    else:
        full, token_step = k.shape[1] // P, k.stride(1) * es
        block_step, heads = P * token_step, k.stride(2) * es
    space = merge_dims([(k.shape[0], k.stride(0) * es, s[0]), (2, gap, s[1]), (P, token_step, s[2]),
                        (slab.shape[4], heads, s[3])], slab.shape[5] * es)
    dst = k.data_ptr() + np.arange(full, dtype=np.int64) * block_step
    res = native_digests.copy_digest(dst, _page_addrs(slab, entry.slots[:full]), space,
                                     expect=entry.sums[:full])
    if not _settled(entry, res):
        return False
    if full < entry.num_pages:                    # the partial last page: checked, then copied
        page, rest = slab[entry.slots[full]], k.shape[1] - full * P
        if xxhash.xxh3_64_intdigest(page_rows_of(page[None])[0]) != entry.sums[full]:
            raise entry.corrupt("page checksum mismatch")
        k[:, full * P:].copy_(page[:, 0, :rest])
        v[:, full * P:].copy_(page[:, 1, :rest])
    return True


def _settled(entry: DigestedPages, res: native_digests.Result | None) -> bool:
    if res is None:
        return False
    if res.bad >= 0:
        raise entry.corrupt(f"page {res.bad} checksum mismatch")
    return True
