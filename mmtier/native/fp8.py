"""fp8 pages widened to float32 in one C call (``fp8.c``): a table lookup per byte.

torch converts ``float8_e4m3fn`` to float32 element by element through bit arithmetic (about
0.3-0.4 GB/s of fp8 on one core of the 2-core EPYC here, e5m2 about 1 GB/s); the attention
path's dequantization of fp8 pages reads every byte of them once per layer and step, so that
conversion would bound a decode over fp8 pages. The table is torch's own conversion of all 256
bytes, so the values are bit-equal to ``.float()``. ``widen`` returns ``False`` (nothing done)
where the helper does not apply (no native library, not CPU, not fp8 into contiguous float32,
a strided innermost axis); the caller then converts with torch.
"""

from __future__ import annotations

import ctypes

import torch

from . import build

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_TABLES: dict[torch.dtype, torch.Tensor] = {}


def _fn():
    lib = build.library("fp8")
    if lib is None:
        return None
    fn = lib.fp8_widen_blocks
    if fn.argtypes is None:
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p]
    return fn


def _table(dtype: torch.dtype) -> torch.Tensor:
    t = _TABLES.get(dtype)
    if t is None:
        t = _TABLES[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return t


def widen(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """``dst.copy_(src)`` for fp8 ``src`` of shape ``[n, ...]`` whose blocks ``src[i]`` are each
    contiguous, into contiguous float32 ``dst`` of the same shape; ``False`` where it does not
    apply (nothing written)."""
    if (src.dtype not in FP8 or dst.dtype != torch.float32 or src.device.type != "cpu"
            or dst.device.type != "cpu" or not dst.is_contiguous() or src.shape != dst.shape or src.dim() < 1):
        return False
    block = src[0].numel() if src.shape[0] else 0
    if src.shape[0] > 1 and src.stride(0) < block:
        return False
    if block and not src[0].is_contiguous():
        return False
    fn = _fn()
    if fn is None:
        return False
    if src.numel():
        fn(src.data_ptr(), src.stride(0) if src.shape[0] > 1 else block, block, src.shape[0], dst.data_ptr(),
           _table(src.dtype).data_ptr())
    return True
