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


def pages_into_kv(runs: Sequence[torch.Tensor], out_k: torch.Tensor, out_v: torch.Tensor) -> None:
    """The reverse: the tokens of page runs (in page order; the last page may be partial) into
    ``out_k, out_v [L, n, H, D]``, one strided copy per run and side."""
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


def check_out_kv(out: object, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` must be two tensors ``(k, v)`` of ``shape`` and ``dtype`` (any device, any strides)."""
    if not isinstance(out, (tuple, list)) or len(out) != 2 or not all(isinstance(t, torch.Tensor) for t in out):
        raise ShapeError("out must be a pair of tensors (k, v)")
    k, v = out
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != tuple(shape):
            raise ShapeError(f"out {name} is {tuple(t.shape)}, the group is {tuple(shape)}")
        if t.dtype != dtype:
            raise DTypeError(f"out {name} is {t.dtype}, the group is {dtype}")
    if k.data_ptr() == v.data_ptr():
        raise ShapeError("out k and v must not share memory")
    return k, v
