"""Attention straight over fp8 pages in one C call (``fp8_attention.c``): no float32 copy.

The torch path over fp8 pages widens each chunk into a float32 buffer (``fp8.widen``: four
times the fp8 bytes written, then read again by torch's flash kernel, whose GEMMs pack their
operands for a few query rows). At a decode step over millions of fp8 tokens that is most of
the step's CPU time. ``attend`` widens each page row in registers where it is used (K once for
all query rows of its KV head, V once into their accumulators), with the softmax online, and
returns the exact partial state ``(out, lse)`` that merges with any other by log-sum-exp.

``None`` where it does not apply (no native helper, not fp8 on the CPU, more than 8 query rows
per KV head, a head dim that is not a multiple of 8 or over 512, a page whose layer is not one
contiguous ``[P, Hkv, D]`` block); the caller then takes the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from . import build
from .fp8 import FP8

MAX_ROWS = 8


def _fn():
    lib = build.library("fp8_attention")
    if lib is None:
        return None
    fn = lib.mmtier_fp8_attend
    if fn.argtypes is None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_int]
    return fn


def available() -> bool:
    return _fn() is not None


def attend(qh: torch.Tensor, kv: torch.Tensor, layer: int, page_ids: torch.Tensor, scale: float, *,
           threads: int | None = None, scalar: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of ``qh [Hkv, R, D]`` (float32, unscaled) over every token of pages ``page_ids``
    of pool ``kv [pages, layers, 2, P, Hkv, D]`` (fp8) in ``layer``: ``(out [Hkv, R, D], lse
    [Hkv, R])`` float32, fp8 values as stored. ``threads``: split the pages (default torch's
    intra-op threads); ``scalar``: the portable code only (tests). ``None`` where this does not
    apply (nothing computed)."""
    if (kv.dtype not in FP8 or kv.device.type != "cpu" or qh.device.type != "cpu" or kv.dim() != 6
            or qh.dim() != 3 or page_ids.numel() == 0):
        return None
    _, _, _, size, hkv, head_dim = kv.shape
    rows = qh.shape[1]
    if (qh.shape[0] != hkv or qh.shape[2] != head_dim or rows > MAX_ROWS or head_dim % 8 or head_dim > 512
            or kv.stride(5) != 1 or kv.stride(4) != head_dim or kv.stride(3) != hkv * head_dim):
        return None
    fn = _fn()
    if fn is None:
        return None
    q = (qh.float() * scale).contiguous()
    addrs = (kv.data_ptr() + layer * kv.stride(1) + page_ids.to(torch.int64).cpu() * kv.stride(0)).contiguous()
    out = torch.empty(hkv, rows, head_dim, dtype=torch.float32)
    lse = torch.empty(hkv, rows, dtype=torch.float32)
    threads = torch.get_num_threads() if threads is None else threads
    rc = fn(addrs.data_ptr(), addrs.numel(), kv.stride(2), size, hkv, head_dim, rows,
            int(kv.dtype == torch.float8_e5m2), q.data_ptr(), out.data_ptr(), lse.data_ptr(), max(1, threads),
            int(scalar))
    if rc != 0:
        return None
    return out, lse
