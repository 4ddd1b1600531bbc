"""K/V between ``[num_layers, n, num_kv_heads, head_dim]`` tensors and page-major pages, by slices.

A group's pages are ``[pages, num_layers, 2, page_size, num_kv_heads, head_dim]`` rows of a pool
view or a host slab. Its pages lie in runs of consecutive rows; each run of ``r`` pages holds
``r * page_size`` consecutive tokens. So a run moves in one strided copy of a view on each side
(``copy_`` of ``view[s:s + r, :, j]`` against the tokens' ``[L, r, P, H, D]`` view, transposed):
no index tensor, no gather into a temporary, each byte copied once. Whatever the source's
device or dtype, ``copy_`` converts on the way. On the CPU, a large copy of one dtype walks its
rows in one C call instead (``native.rows``: the layout change at ~0.75x a plain copy, where
torch's strided copy runs at ~0.4x).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import DTypeError, ShapeError
from ..native import rows as native_rows


def contiguous_runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, length)]`` of maximal runs of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def view_runs(view: torch.Tensor, ids: Sequence[int]) -> list[torch.Tensor]:
    """The rows ``ids`` of a page-major view as slices, one per run of consecutive ids."""
    return [view[s:s + n] for s, n in contiguous_runs(ids)]


def kv_into_pages(view: torch.Tensor, ids: Sequence[int], k, v, tally: native_rows.Tally | None = None) -> None:
    """Token ``t`` of ``k, v [L, n, H, D]`` into page ``ids[t // P]``, slot ``t % P`` of a
    page-major ``view`` (pages from token 0; the last may be partial), run by run; or block
    ``i`` of an engine's own blocks (``EngineBlocks`` as ``k`` and ``v``) into page ``ids[i]``.
    ``tally``: the copies test what they move for NaN / Inf where they can (``native.rows``)."""
    if isinstance(k, EngineBlocks):
        k.into_pages(view, ids, tally)
        return
    P = view.shape[3]
    if k.dim() == 5:                                  # block-split [L, blocks, P, H, D]
        _blocks_into_pages(view, ids, k, v, tally)
        return
    n = k.shape[1]
    t = 0
    for run in view_runs(view, ids):
        r = run.shape[0]
        full = min(r, (n - t) // P)
        if full:
            for j, src in ((0, k), (1, v)):
                _copy(run[:full, :, j], src[:, t:t + full * P].unflatten(1, (full, P)).transpose(0, 1), tally)
            t += full * P
        if full < r and t < n:                        # the partial last page
            rest = n - t
            for j, src in ((0, k), (1, v)):
                _copy(run[full, :, j, :rest], src[:, t:n], tally)
            t = n
    if t != n:
        raise ShapeError(f"{len(ids)} pages of {P} tokens do not hold {n} tokens")


def _blocks_into_pages(view: torch.Tensor, ids: Sequence[int], k: torch.Tensor, v: torch.Tensor,
                       tally: native_rows.Tally | None) -> None:
    """Block ``b`` of ``k, v [L, blocks, P, H, D]`` into page ``ids[b]``, one copy per run."""
    if len(ids) != k.shape[1]:
        raise ShapeError(f"{len(ids)} pages for {k.shape[1]} blocks")
    both = paired_view(k, v)
    b = 0
    for run in view_runs(view, ids):
        r = run.shape[0]
        if both is not None:          # K and V in one copy: [L, r, P, H, 2, D] of the run
            _copy_in_order(run.permute(1, 0, 3, 4, 2, 5), both[:, b:b + r], both, tally)
        else:
            for j, src in ((0, k), (1, v)):
                _copy_in_order(run[:, :, j].transpose(0, 1), src[:, b:b + r], src, tally)
        b += r


def paired_view(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``[..., 2, D]``: K and V of one storage as one view (an engine's stage holds them side by
    side, ``K|V`` along its last axis), where both have the same shape and strides and V lies a
    fixed positive offset after K; ``None`` otherwise. One copy of it walks each source chunk
    once (K and V of a head are adjacent), about twice as fast as two copies of halves."""
    if (k.shape != v.shape or k.stride() != v.stride() or k.dtype != v.dtype or k.device != v.device
            or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()):
        return None
    delta = v.storage_offset() - k.storage_offset()
    if delta <= 0:
        return None
    return k.as_strided((*k.shape[:-1], 2, k.shape[-1]), (*k.stride()[:-1], delta, k.stride(-1)),
                        k.storage_offset())


def _copy_in_order(dst: torch.Tensor, src: torch.Tensor, order_of: torch.Tensor,
                   tally: native_rows.Tally | None = None) -> None:
    """``dst.copy_(src)`` walked in ``order_of``'s memory order (an engine's stage is head-major
    within a block, a page token-major: left to itself, the copy walks the page's order and
    reads the stage ~3x slower than in its own); on the CPU one C call where it applies."""
    if native_rows.copy_view(dst, src, tally=tally):
        return
    if tally is not None:
        tally.unchecked += 1
    order = sorted(range(order_of.dim()), key=lambda d: (-order_of.stride(d), d))
    dst.permute(*order).copy_(src.permute(*order))


def pages_into_kv(runs: Sequence[torch.Tensor], out_k, out_v) -> None:
    """The reverse: the tokens of page runs (in page order; the last page may be partial) into
    ``out_k, out_v [L, n, H, D]`` (or block-split ``[L, blocks, P, H, D]``, whole pages), one
    strided copy per run and side; or into an engine's own blocks (``EngineBlocks``, passed as
    both ``out_k`` and ``out_v``), one copy per layer and run of consecutive blocks."""
    if isinstance(out_k, EngineBlocks):
        out_k.from_pages(runs)
        return
    if out_k.dim() == 5:
        both = paired_view(out_k, out_v)
        b = 0
        for run in runs:
            r = run.shape[0]
            if both is not None:
                _copy_in_order(both[:, b:b + r], run.permute(1, 0, 3, 4, 2, 5), both)
            else:
                for j, dst in ((0, out_k), (1, out_v)):
                    _copy_in_order(dst[:, b:b + r], run[:, :, j].transpose(0, 1), dst)
            b += r
        if b != out_k.shape[1]:
            raise ShapeError(f"the pages hold {b} blocks, {out_k.shape[1]} wanted")
        return
    n = out_k.shape[1]
    t = 0
    for run in runs:
        r, P = run.shape[0], run.shape[3]
        full = min(r, (n - t) // P)
        if full:
            for j, dst in ((0, out_k), (1, out_v)):
                _copy(dst[:, t:t + full * P].unflatten(1, (full, P)), run[:full, :, j].transpose(0, 1))
            t += full * P
        if full < r and t < n:
            rest = n - t
            for j, dst in ((0, out_k), (1, out_v)):
                dst[:, t:n].copy_(run[full, :, j, :rest])
            t = n
    if t != n:
        raise ShapeError(f"the pages hold {t} tokens, {n} wanted")


def _copy(dst: torch.Tensor, src: torch.Tensor, tally: native_rows.Tally | None = None) -> None:
    """``dst.copy_(src)``, in one C call where it applies (``native.rows.copy_view``)."""
    if not native_rows.copy_view(dst, src, tally=tally):
        if tally is not None:
            tally.unchecked += 1
        dst.copy_(src)


def check_out_kv(out: object, shape: tuple[int, ...], dtype: torch.dtype,
                 page_size: int | None = None) -> tuple:
    """``out`` must be two tensors ``(k, v)`` of ``shape`` ``[L, n, H, D]`` and ``dtype`` (any
    device, any strides); with ``page_size``, block-split ``[L, n / page_size, page_size, H, D]``
    too, where the group is whole pages; or ``EngineBlocks`` of ``n / page_size`` blocks of that
    shape and dtype (returned as ``(out, out)``)."""
    if isinstance(out, EngineBlocks):
        out.check(shape, dtype)
        return out, out
    if not isinstance(out, (tuple, list)) or len(out) != 2 or not all(isinstance(t, torch.Tensor) for t in out):
        raise ShapeError("out must be a pair of tensors (k, v)")
    k, v = out
    L, n, H, D = shape
    blocked = (L, n // page_size, page_size, H, D) if page_size and n % page_size == 0 else None
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != tuple(shape) and tuple(t.shape) != blocked:
            raise ShapeError(f"out {name} is {tuple(t.shape)}, the group is {tuple(shape)}"
                             + (f" (or block-split {blocked})" if blocked else ""))
        if t.dtype != dtype:
            raise DTypeError(f"out {name} is {t.dtype}, the group is {dtype}")
    if k.data_ptr() == v.data_ptr():
        raise ShapeError("out k and v must not share memory")
    return k, v


class EngineBlocks:
    """K/V at ``block_ids`` of an engine's own per-layer paged tensors, as a source for ``put`` and
    a destination for ``read_group(out=)``: block ``i`` is page ``i`` of the group, so each crossing
    is one copy between the engine's blocks and the cache's pages (no stage between them).

    ``layers``: one ``(k, v)`` pair per layer, each ``[blocks, block_size, heads, head_dim]``
    views (any strides: an engine's layout, e.g. vLLM's K|V interleaved per head); all layers of
    one shape, dtype and device. The copies walk the engine's memory order, K and V together
    where they lie side by side (``paired_view``); consecutive block ids move in one copy."""

    def __init__(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], block_ids: Sequence[int]):
        if not layers or not block_ids:
            raise ShapeError("EngineBlocks needs at least one layer and one block")
        k0 = layers[0][0]
        for k, v in layers:
            if (k.dim() != 4 or k.shape != k0.shape or v.shape != k0.shape or k.dtype != k0.dtype
                    or v.dtype != k0.dtype or k.device != k0.device or v.device != k0.device):
                raise ShapeError("EngineBlocks: every layer's k and v must be [blocks, block_size, heads, "
                                 f"head_dim] of one shape, dtype and device; got {tuple(k.shape)}, {tuple(v.shape)}")
        ids = [int(b) for b in block_ids]
        if any(not 0 <= b < k0.shape[0] for b in ids) or len(set(ids)) != len(ids):
            raise ShapeError(f"EngineBlocks: block ids must be distinct, in [0, {k0.shape[0]})")
        self.block_ids = ids
        self.dtype, self.device = k0.dtype, k0.device
        self.block_shape = tuple(k0.shape[1:])                       # (P, H, D)
        self._sides: list[list[tuple[torch.Tensor, list[int]]]] = []  # per layer: (view, memory order)
        for k, v in layers:
            both = paired_view(k, v)       # [blocks, P, H, 2, D]
            views = [both] if both is not None else [k, v]
            self._sides.append([(t, _order(t)) for t in views])
        self._paired = all(len(s) == 1 for s in self._sides)

    @property
    def num_layers(self) -> int:
        return len(self._sides)

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.block_shape[0]

    def check(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """The group ``[L, n, H, D]`` of ``dtype`` must be exactly these blocks."""
        L, n, H, D = shape
        if (self.num_layers, self.num_tokens, *self.block_shape[1:]) != (L, n, H, D):
            raise ShapeError(f"EngineBlocks of {self.num_layers} layers x {len(self.block_ids)} blocks of "
                             f"{self.block_shape}; the group is {tuple(shape)}")
        if self.dtype != dtype:
            raise DTypeError(f"EngineBlocks are {self.dtype}, the group is {dtype}")

    def runs(self) -> list[tuple[int, int, int]]:
        """``[(block_start, index_start, length)]``: runs of consecutive block ids."""
        out: list[tuple[int, int, int]] = []
        for i, b in enumerate(self.block_ids):
            if out and out[-1][0] + out[-1][2] == b:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
            else:
                out.append((b, i, 1))
        return out

    def block_rows(self) -> list[torch.Tensor] | None:
        """Each layer's (and side's) blocks as ``[blocks, block_elements]`` rows, one dense row
        per block (vLLM's layouts: a block is one stretch of memory); ``None`` when some
        block is not dense."""
        out = []
        for sides in self._sides:
            for t, order in sides:
                if order[0] != 0 or not t[0].permute(*[d - 1 for d in order[1:]]).is_contiguous():
                    return None
                per = t[0].numel()
                out.append(torch.as_strided(t, (t.shape[0], per), (t.stride(0), 1), t.storage_offset()))
        return out

    def id_tensor(self) -> torch.Tensor:
        return torch.tensor(self.block_ids, dtype=torch.int64, device=self.device)

    def tensors(self) -> list[torch.Tensor]:
        """Each run of blocks of each layer (and side), as views: what a NaN/Inf scan reads."""
        return [t[b:b + n] for sides in self._sides for t, _ in sides for b, _, n in self.runs()]

    def _moves(self, page_runs: Sequence[tuple[torch.Tensor, int]]):
        """``(page_rows [n, L, 2, P, H, D], block_start, n)`` for each stretch where pages and
        blocks both run on."""
        runs = self.runs()
        for rows, first in page_runs:            # rows of the pages of group indices first..
            r = rows.shape[0]
            for b, i, n in runs:
                lo, hi = max(i, first), min(i + n, first + r)
                if lo < hi:
                    yield rows[lo - first:hi - first], b + lo - i, hi - lo

    def from_pages(self, runs: Sequence[torch.Tensor]) -> None:
        """Pages (runs of ``[r, L, 2, P, H, D]`` in group order) into the blocks (the copy walks
        the blocks' order: they are its output)."""
        at, page_runs = 0, []
        for run in runs:
            page_runs.append((run, at))
            at += run.shape[0]
        if at != len(self.block_ids):
            raise ShapeError(f"the pages hold {at} blocks, {len(self.block_ids)} wanted")
        if self._native(page_runs, to_blocks=True):
            return
        for rows, b, n in self._moves(page_runs):
            if self._paired:
                src = rows.permute(1, 0, 3, 4, 2, 5)                  # [L, n, P, H, 2, D]
                for layer, ((dst, _),) in enumerate(self._sides):
                    dst[b:b + n].copy_(src[layer])
            else:
                src = rows.transpose(0, 1)                            # [L, n, 2, P, H, D]
                for layer, sides in enumerate(self._sides):
                    for j, (dst, _) in enumerate(sides):
                        dst[b:b + n].copy_(src[layer, :, j])

    def into_pages(self, view: torch.Tensor, ids: Sequence[int], tally: native_rows.Tally | None = None) -> None:
        """The blocks into rows ``ids`` of a page-major view (block ``i`` into page ``ids[i]``),
        each copy walked in the blocks' memory order (``_copy_in_order``)."""
        if len(ids) != len(self.block_ids):
            raise ShapeError(f"{len(ids)} pages for {len(self.block_ids)} blocks")
        page_runs = [(view[s:s + n], i) for (s, n), i in _with_index(contiguous_runs(ids))]
        if self._native(page_runs, to_blocks=False, tally=tally):
            return
        if tally is not None:
            tally.unchecked += 1
        for rows, b, n in self._moves(page_runs):
            if self._paired:
                dst = rows.permute(1, 0, 3, 4, 2, 5)                  # [L, n, P, H, 2, D]
                for layer, ((src, order),) in enumerate(self._sides):
                    _copy_ordered(dst[layer], src[b:b + n], order)
            else:
                dst = rows.transpose(0, 1)
                for layer, sides in enumerate(self._sides):
                    for j, (src, order) in enumerate(sides):
                        _copy_ordered(dst[layer, :, j], src[b:b + n], order)


    def _native(self, page_runs: Sequence[tuple[torch.Tensor, int]], *, to_blocks: bool,
                tally: native_rows.Tally | None = None) -> bool:
        """Every layer's (and side's) blocks and their pages in one C call (``native.rows``),
        a unit being one layer of one block; ``False`` where that does not apply (not on the
        CPU, dtypes differ, page runs of differing strides, no native helper): nothing copied."""
        if self.device.type != "cpu" or not page_runs:
            return False
        rows0 = page_runs[0][0]
        if rows0.device.type != "cpu" or rows0.dtype != self.dtype:
            return False
        es = rows0.element_size()
        addrs: list[int] = []
        for rows, _ in page_runs:                     # page addresses, in group order
            if rows.stride()[1:] != rows0.stride()[1:]:
                return False
            base, step = rows.data_ptr(), rows.stride(0) * es
            addrs.extend(base + j * step for j in range(rows.shape[0]))
        pages = torch.tensor(addrs, dtype=torch.int64)
        ids = self.id_tensor().cpu()
        block_units, page_units = [], []
        for layer, sides in enumerate(self._sides):
            for j, (t, _) in enumerate(sides):
                if t.stride() != self._sides[0][j][0].stride():
                    return False
                block_units.append(t.data_ptr() + ids * (t.stride(0) * es))
                side = 0 if self._paired else j * rows0.stride(2) * es
                page_units.append(pages + (layer * rows0.stride(1) * es + side))
        blocks_t = self._sides[0][0][0][0]
        pages_t = rows0[0, 0].permute(1, 2, 0, 3) if self._paired else rows0[0, 0, 0]
        block_units, page_units = torch.cat(block_units), torch.cat(page_units)
        if to_blocks:
            return native_rows.copy_units(block_units, page_units, blocks_t, pages_t)
        return native_rows.copy_units(page_units, block_units, pages_t, blocks_t, tally=tally)


def _copy_ordered(dst: torch.Tensor, src: torch.Tensor, order: list[int]) -> None:
    if order == sorted(order):
        dst.copy_(src)
    else:
        dst.permute(*order).copy_(src.permute(*order))


def _order(t: torch.Tensor) -> list[int]:
    """``t``'s dims from outermost to innermost in memory."""
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))


def _with_index(runs: list[tuple[int, int]]) -> list[tuple[tuple[int, int], int]]:
    """Each ``(start, length)`` run with the index of its first element in the id list."""
    out, at = [], 0
    for run in runs:
        out.append((run, at))
        at += run[1]
    return out
