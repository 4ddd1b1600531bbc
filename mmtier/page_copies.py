"""K/V between ``[num_layers, n, num_kv_heads, head_dim]`` tensors and page-major pages, by slices.

A group's pages are ``[pages, num_layers, 2, page_size, num_kv_heads, head_dim]`` rows of a pool
view or a host slab. Its pages lie in runs of consecutive rows; each run of ``r`` pages holds
``r * page_size`` consecutive tokens. So a run moves in one strided copy of a view on each side
(``copy_`` of ``view[s:s + r, :, j]`` against the tokens' ``[L, r, P, H, D]`` view, transposed):
no index tensor, no gather into a temporary, each byte copied once. Whatever the source's
device or dtype, ``copy_`` converts on the way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import DTypeError, ShapeError


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


def kv_into_pages(view: torch.Tensor, ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Token ``t`` of ``k, v [L, n, H, D]`` into page ``ids[t // P]``, slot ``t % P`` of a
    page-major ``view`` (pages from token 0; the last may be partial), run by run."""
    P = view.shape[3]
    if k.dim() == 5:                                  # block-split [L, blocks, P, H, D]
        _blocks_into_pages(view, ids, k, v)
        return
    n = k.shape[1]
    t = 0
    for run in view_runs(view, ids):
        r = run.shape[0]
        full = min(r, (n - t) // P)
        if full:
            for j, src in ((0, k), (1, v)):
                run[:full, :, j].copy_(src[:, t:t + full * P].unflatten(1, (full, P)).transpose(0, 1))
            t += full * P
        if full < r and t < n:                        # the partial last page
            rest = n - t
            for j, src in ((0, k), (1, v)):
                run[full, :, j, :rest].copy_(src[:, t:n])
            t = n
    if t != n:
        raise ShapeError(f"{len(ids)} pages of {P} tokens do not hold {n} tokens")


def _blocks_into_pages(view: torch.Tensor, ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Block ``b`` of ``k, v [L, blocks, P, H, D]`` into page ``ids[b]``, one copy per run."""
    if len(ids) != k.shape[1]:
        raise ShapeError(f"{len(ids)} pages for {k.shape[1]} blocks")
    both = paired_view(k, v)
    b = 0
    for run in view_runs(view, ids):
        r = run.shape[0]
        if both is not None:          # K and V in one copy: [L, r, P, H, 2, D] of the run
            _copy_in_order(run.permute(1, 0, 3, 4, 2, 5), both[:, b:b + r], both)
        else:
            for j, src in ((0, k), (1, v)):
                _copy_in_order(run[:, :, j].transpose(0, 1), src[:, b:b + r], src)
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


def _copy_in_order(dst: torch.Tensor, src: torch.Tensor, order_of: torch.Tensor) -> None:
    """``dst.copy_(src)`` walked in ``order_of``'s memory order (an engine's stage is head-major
    within a block, a page token-major: left to itself, the copy walks the page's order and
    reads the stage ~3x slower than in its own)."""
    order = sorted(range(order_of.dim()), key=lambda d: (-order_of.stride(d), d))
    dst.permute(*order).copy_(src.permute(*order))


def pages_into_kv(runs: Sequence[torch.Tensor], out_k: torch.Tensor, out_v: torch.Tensor) -> None:
    """The reverse: the tokens of page runs (in page order; the last page may be partial) into
    ``out_k, out_v [L, n, H, D]`` (or block-split ``[L, blocks, P, H, D]``, whole pages), one
    strided copy per run and side."""
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
                dst[:, t:t + full * P].unflatten(1, (full, P)).copy_(run[:full, :, j].transpose(0, 1))
            t += full * P
        if full < r and t < n:
            rest = n - t
            for j, dst in ((0, out_k), (1, out_v)):
                dst[:, t:n].copy_(run[full, :, j, :rest])
            t = n
    if t != n:
        raise ShapeError(f"the pages hold {t} tokens, {n} wanted")


def check_out_kv(out: object, shape: tuple[int, ...], dtype: torch.dtype,
                 page_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` must be two tensors ``(k, v)`` of ``shape`` ``[L, n, H, D]`` and ``dtype`` (any
    device, any strides); with ``page_size``, block-split ``[L, n / page_size, page_size, H, D]``
    too, where the group is whole pages."""
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
