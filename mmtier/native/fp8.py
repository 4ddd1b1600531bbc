"""fp8 pages widened to float32 in one C call (``fp8.c``): vectorised bit arithmetic.

torch converts ``float8_e4m3fn`` to float32 element by element (about 0.3-0.4 GB/s of fp8 on
one core of the 2-core EPYC here, e5m2 about 1 GB/s); the attention path's dequantization of
fp8 pages reads every byte of them once per layer and step, so that conversion would bound a
decode over fp8 pages. ``fp8.c`` builds each float's bits directly, branch-free and vectorised
(4.5 GB/s of e4m3 on one core here; the 256-entry table it replaced ran 1.8 GB/s), bit-equal
to ``.float()`` for all 256 bytes. ``widen`` returns ``False`` (nothing done)
where the helper does not apply (no native library, not CPU, not fp8 into contiguous float32,
a strided innermost axis); the caller then converts with torch.
"""

from __future__ import annotations

import ctypes

import torch

from . import build

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _fn():
    lib = build.library("fp8")
    if lib is None:
        return None
    fn = lib.fp8_widen_blocks
    if fn.argtypes is None:
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int32]
    return fn


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
           int(src.dtype == torch.float8_e5m2))
    return True
