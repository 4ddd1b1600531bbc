"""Triton scatter of new tokens' K/V into their pages from a slot mapping.

Three layers: ``_kernel`` (one program per (block of tokens, layer), all KV heads at once)
-> ``_launch`` (checks shapes, dtypes, devices, index ranges; picks grid) ->
``write_kv_triton`` (torch-facing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import DTypeError, ShapeError
from .indices import INDEX_DTYPE, upload_ints
from .launch import gpu_choices, launch_guard


@triton.jit(do_not_specialize=["n"])
def _kernel(
    kv_ptr, k_ptr, v_ptr, page_ids_ptr, offsets_ptr, n, heads, head_dim,
    s_kp, s_kl, s_kk, s_kt, s_kh, s_kd,
    s_al, s_at, s_ah, s_ad,
    s_bl, s_bt, s_bh, s_bd,
    D_PAD: tl.constexpr, HD_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """For every token ``i`` of the block and the program's layer ``l``:

        kv[page_ids[i], l, 0, offsets[i], :, :] = k[l, i]
        kv[page_ids[i], l, 1, offsets[i], :, :] = v[l, i]

    (cast to the pool's dtype). Two tokens mapped to one slot: one of them wins. int64 offsets.
    """
    i = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    i_ok = i < n
    page = tl.load(page_ids_ptr + i, mask=i_ok, other=0).to(tl.int64)
    slot = tl.load(offsets_ptr + i, mask=i_ok, other=0).to(tl.int64)
    hd = tl.arange(0, HD_PAD).to(tl.int64)
    h = hd // D_PAD
    d = hd % D_PAD
    ok = i_ok[:, None] & ((h < heads) & (d < head_dim))[None, :]
    dst = (kv_ptr + layer * s_kl + (page * s_kp + slot * s_kt)[:, None]
           + (h * s_kh + d * s_kd)[None, :])
    src_k = k_ptr + layer * s_al + (i * s_at)[:, None] + (h * s_ah + d * s_ad)[None, :]
    src_v = v_ptr + layer * s_bl + (i * s_bt)[:, None] + (h * s_bh + d * s_bd)[None, :]
    elt = kv_ptr.dtype.element_ty
    tl.store(dst, tl.load(src_k, mask=ok).to(elt), mask=ok)
    tl.store(dst + s_kk, tl.load(src_v, mask=ok).to(elt), mask=ok)


def check_write(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor,
                offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed errors for a bad write; returns ``(page_ids, offsets)`` on ``kv``'s device.

    Index tensors on the host (the cache builds them there) are range-checked there and
    copied up in one non-blocking transfer; index tensors already on the device cost one small
    device -> host copy for the range check."""
    if kv.dim() != 6 or kv.shape[2] != 2:
        raise ShapeError(f"kv must be [pages, layers, 2, page_size, kv_heads, head_dim], got {tuple(kv.shape)}")
    num_pages, num_layers, _, page_size, heads, head_dim = kv.shape
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[0] != num_layers or t.shape[2:] != (heads, head_dim):
            raise ShapeError(f"{name} must be [{num_layers}, n, {heads}, {head_dim}], got {tuple(t.shape)}")
        if not t.is_floating_point() and not t.dtype == kv.dtype == torch.uint8:   # uint8: fp8 pages' bytes
            raise DTypeError(f"{name} must be floating point, got {t.dtype}")
        if t.device != kv.device:
            raise DTypeError(f"{name} is on {t.device}, kv on {kv.device}")
    if k.shape != v.shape:
        raise ShapeError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    n = k.shape[1]
    for name, t in (("page_ids", page_ids), ("offsets", offsets)):
        if t.dtype != INDEX_DTYPE:
            raise DTypeError(f"{name} must be int32, got {t.dtype}")
        if t.shape != (n,):
            raise ShapeError(f"{name} must be [{n}], got {tuple(t.shape)}")
        if t.device != kv.device and t.device.type != "cpu":
            raise DTypeError(f"{name} is on {t.device}, kv on {kv.device} (give indices there or on the CPU)")
    if page_ids.device != offsets.device:
        raise DTypeError(f"page_ids on {page_ids.device}, offsets on {offsets.device}")
    if n:
        lo_p, hi_p, lo_o, hi_o = torch.stack(
            [page_ids.min(), page_ids.max(), offsets.min(), offsets.max()]).tolist()
        if lo_p < 0 or hi_p >= num_pages:
            raise ShapeError(f"page ids {lo_p}..{hi_p} outside a pool of {num_pages} pages")
        if lo_o < 0 or hi_o >= page_size:
            raise ShapeError(f"slot offsets {lo_o}..{hi_o} outside pages of {page_size} tokens")
    if page_ids.device != kv.device:
        page_ids, offsets = upload_ints([page_ids, offsets], kv.device)
    return page_ids, offsets


def write_kv_triton(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor,
                    offsets: torch.Tensor) -> None:
    """Scatter ``k, v [num_layers, n, Hkv, D]`` into ``kv`` (page-major pool view), token ``i``
    to page ``page_ids[i]``, slot ``offsets[i]``, in every layer (indices on ``kv``'s device or
    on the CPU). In place; bad input raises before anything is written."""
    page_ids, offsets = check_write(kv, k, v, page_ids, offsets)
    num_layers, n, heads, head_dim = k.shape
    if n == 0 or num_layers == 0:
        return
    d_pad = triton.next_power_of_2(head_dim)
    hd_pad = triton.next_power_of_2(heads) * d_pad
    block_t = max(1, min(16, 4096 // hd_pad))
    extra = {"num_warps": 4} if gpu_choices(kv.device) else {}
    grid = (triton.cdiv(n, block_t), num_layers)
    with launch_guard(kv.device.type):
        _kernel[grid](
            kv, k, v, page_ids, offsets, n, heads, head_dim,
            *kv.stride(), *k.stride(), *v.stride(),
            D_PAD=d_pad, HD_PAD=hd_pad, BLOCK_T=block_t, **extra,
        )
