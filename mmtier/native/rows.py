"""Row copies between two layouts in one C call (``rows.c``): the CPU data path's layout changes.

A copy is a list of *units* (the same small tensor shape at many addresses: one layer of one
engine block, one page's layer) whose innermost axis is contiguous on both sides. torch's
strided ``copy_`` of such views (256-byte rows for a head of 128 bf16 values) runs at about
0.4x a plain copy on the CPU; this walks the rows in the source's memory order with one
``memcpy`` or a streaming store each (non-temporal stores on AVX2 where every destination row
is 32-byte aligned and the copy is large), about 0.75x a plain copy here.

With a ``Tally``, each copy also tests every element it moves for NaN / Inf (float16, bfloat16,
float32) in the registers it loads anyway: a put's finiteness scan fused into its copy.

``copy_units`` and ``copy_view`` return ``False`` (nothing copied) where the helper does not
apply: not on the CPU, dtypes or shapes differ, an innermost axis is strided, more dims than
the C side takes, or no native helper here (``build.library``); the caller then copies with torch.
"""

from __future__ import annotations

import ctypes

import torch

from . import build

MAX_DIMS = 8
STREAM_MIN_BYTES = 1 << 20     # below this the destination may well be read from the cache soon
VIEW_MIN_BYTES = 64 << 10      # ``copy_view`` leaves smaller copies to torch (its call costs less)

_I64P = ctypes.POINTER(ctypes.c_int64)
CHECK_KINDS = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}


class Tally:
    """What the copies of one payload saw: ``complete`` when every copy made for it tested its
    elements (none fell back to an unchecked copy), ``nonfinite`` when one found a NaN / Inf."""

    def __init__(self) -> None:
        self.checked = 0
        self.unchecked = 0
        self.nonfinite = False

    @property
    def complete(self) -> bool:
        return self.checked > 0 and self.unchecked == 0


def _fn():
    lib = build.library("rows")
    if lib is None:
        return None
    fn = lib.mmtier_copy_rows
    if fn.argtypes is None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                       _I64P, _I64P, _I64P, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    return fn


def available() -> bool:
    return _fn() is not None


def row_space(dst: torch.Tensor, src: torch.Tensor) -> tuple[list[int], list[int], list[int], int] | None:
    """``(shape, dst_strides, src_strides, row_bytes)`` in bytes, outer dims in ``src``'s memory
    order with dims that run on in both merged; ``None`` where the innermost axis is not
    contiguous on both sides or too many dims remain."""
    if dst.shape != src.shape or dst.dtype != src.dtype or dst.dim() == 0:
        return None
    es = dst.element_size()
    if dst.shape[-1] > 1 and (dst.stride(-1) != 1 or src.stride(-1) != 1):
        return None
    dims = [(n, ds * es, ss * es) for n, ds, ss in zip(dst.shape[:-1], dst.stride()[:-1], src.stride()[:-1])]
    return merge_dims(dims, dst.shape[-1] * es)


def merge_dims(dims: list[tuple[int, int, int]], row: int) -> tuple[list[int], list[int], list[int], int] | None:
    """``row_space`` of an index space given as ``(size, dst_stride, src_stride)`` per dim (byte
    strides, any order) over rows of ``row`` bytes: dims of size 1 dropped, the rest in the
    source's memory order, dims that run on in both merged, whole rows back to back joined."""
    dims = sorted((d for d in dims if d[0] != 1), key=lambda d: -abs(d[2]))
    merged: list[tuple[int, int, int]] = []
    for n, ds, ss in dims:
        if merged:
            pn, pds, pss = merged[-1]
            if pds == ds * n and pss == ss * n:              # the outer dim runs on into this one
                merged[-1] = (pn * n, ds, ss)
                continue
        merged.append((n, ds, ss))
    while merged and merged[-1][1] == row and merged[-1][2] == row:   # whole rows back to back
        row *= merged.pop()[0]
    if len(merged) > MAX_DIMS:
        return None
    return [m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged], row


def copy_units(dst_addrs: torch.Tensor, src_addrs: torch.Tensor, dst: torch.Tensor, src: torch.Tensor,
               *, stream: bool | None = None, tally: Tally | None = None) -> bool:
    """Copy ``src``-shaped units at ``src_addrs`` to ``dst``-shaped units at ``dst_addrs`` (int64
    byte addresses, one per unit); ``dst`` and ``src`` are one unit's views, read for their
    shape, dtype and strides (and must be CPU tensors into the memory the addresses point at).
    ``stream``: non-temporal stores where they apply (default: when the copy is at least
    ``STREAM_MIN_BYTES``). ``tally``: each element tested for NaN / Inf on the way (a dtype
    without a test counts as unchecked). ``False`` where it does not apply; nothing was copied
    then (and ``tally`` is unchanged)."""
    if dst.device.type != "cpu" or src.device.type != "cpu":
        return False
    fn = _fn()
    space = row_space(dst, src) if fn is not None else None
    if space is None:
        return False
    shape, dstr, sstr, row = space
    n = int(dst_addrs.numel())
    if src_addrs.numel() != n:
        raise ValueError(f"{n} destination units, {src_addrs.numel()} source units")
    check = CHECK_KINDS.get(dst.dtype, 0) if tally is not None else 0
    if n == 0:
        return True
    if stream is None:
        stream = n * dst.numel() * dst.element_size() >= STREAM_MIN_BYTES
    da = dst_addrs.to(torch.int64).contiguous()
    sa = src_addrs.to(torch.int64).contiguous()
    arr = ctypes.c_int64 * max(1, len(shape))
    rc = fn(da.data_ptr(), sa.data_ptr(), n, len(shape), arr(*shape), arr(*dstr), arr(*sstr), row,
            1 if stream else 0, check)
    if rc < 0:
        raise ValueError("mmtier_copy_rows refused its arguments")
    if tally is not None:
        if check:
            tally.checked += 1
            tally.nonfinite |= bool(rc & 2)
        else:
            tally.unchecked += 1
    return True


def copy_view(dst: torch.Tensor, src: torch.Tensor, *, stream: bool | None = None,
              tally: Tally | None = None) -> bool:
    """``dst.copy_(src)`` for two CPU views of one shape and dtype whose innermost axis is
    contiguous, in one C call; ``False`` where that does not apply (nothing copied), and for
    copies under ``VIEW_MIN_BYTES`` without a ``tally``, where torch's own call costs less."""
    if tally is None and dst.numel() * dst.element_size() < VIEW_MIN_BYTES:
        return False
    if dst.numel() == 0:
        return False
    addrs = torch.tensor([[dst.data_ptr(), src.data_ptr()]], dtype=torch.int64)
    return copy_units(addrs[:, 0], addrs[:, 1], dst, src, stream=stream, tally=tally)
