"""Triton exact merge of attention states ``(out, lse)`` by log-sum-exp.

Three layers: ``_kernel`` (one program per block of (query, head) rows, partials read in
wide tiles) -> ``merge_partials`` (checks strides and shapes, picks the grid) ->
``merge_attention_states_triton`` (torch-facing: a sequence of ``(out, lse)`` pairs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ...errors import DTypeError, ShapeError
from ...pages.kernels.launch import gpu_choices, launch_guard


@triton.jit(do_not_specialize=["n_parts", "n_rows", "num_heads"])
def _kernel(
    parts_ptr, lses_ptr, out_ptr, lse_out_ptr,
    n_parts, n_rows, num_heads, head_dim,
    s_pn, s_pt, s_ph, s_pd,
    s_ln, s_lt, s_lh,
    s_ot, s_oh, s_od,
    s_rt, s_rh,
    D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """For each row (query t, head h), with ``M = max_i lse_i`` over the partials:

        w_i = exp(lse_i - M);  out = sum_i w_i out_i / sum_i w_i;  lse = M + log(sum_i w_i)

    A program holds ``BLOCK_R`` rows and reads ``BLOCK_P`` partials per step as one
    ``[BLOCK_R, BLOCK_P, D]`` tile (many partials, as split-KV makes, cost a few wide loads,
    not a chain of dependent ones). A partial with ``lse_i = -inf`` has weight 0 and its
    ``out_i`` is not read; a row where every partial is empty gets ``out = 0`` and
    ``lse = -inf``. Addresses are int64.
    """
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    r_ok = r < n_rows
    t = r // num_heads
    h = r % num_heads
    i = tl.arange(0, BLOCK_P).to(tl.int64)
    d = tl.arange(0, D_PAD).to(tl.int64)
    d_ok = d < head_dim
    lse_row = (t * s_lt + h * s_lh)[:, None]  # [R, 1]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        ip = p0 + i
        ok = r_ok[:, None] & (ip < n_parts)[None, :]
        li = tl.load(lses_ptr + lse_row + ip[None, :] * s_ln, mask=ok, other=float("-inf"))
        m = tl.maximum(m, tl.max(li, 1))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D_PAD], tl.float32)
    part_row = (t * s_pt + h * s_ph)[:, None, None]  # [R, 1, 1]
    for p0 in range(0, n_parts, BLOCK_P):
        ip = p0 + i
        ok = r_ok[:, None] & (ip < n_parts)[None, :]
        li = tl.load(lses_ptr + lse_row + ip[None, :] * s_ln, mask=ok, other=float("-inf"))
        w = tl.where(li == float("-inf"), 0.0, tl.exp(li - m_safe[:, None]))  # [R, P]
        o_ptrs = parts_ptr + part_row + ip[None, :, None] * s_pn + d[None, None, :] * s_pd
        o_mask = (w > 0.0)[:, :, None] & d_ok[None, None, :]
        o = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)  # [R, P, D]
        acc += tl.sum(w[:, :, None] * o, 1)
        total += tl.sum(w, 1)
    seen = total > 0.0
    t_safe = tl.where(seen, total, 1.0)
    out = acc / t_safe[:, None]
    lse = tl.where(seen, m_safe + tl.log(t_safe), float("-inf"))
    tl.store(out_ptr + t[:, None] * s_ot + h[:, None] * s_oh + d[None, :] * s_od,
             out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    tl.store(lse_out_ptr + t * s_rt + h * s_rh, lse, mask=r_ok)


def merge_partials(parts: torch.Tensor, lses: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor) -> None:
    """Merge ``parts [N, T, H, D]`` with ``lses [N, T, H]`` (float32) into ``out [T, H, D]``
    and ``lse [T, H]`` (float32), in place."""
    n, total_q, num_heads, head_dim = parts.shape
    if lses.shape != (n, total_q, num_heads) or out.shape != (total_q, num_heads, head_dim) \
            or lse.shape != (total_q, num_heads):
        raise ShapeError(f"merge: parts {tuple(parts.shape)}, lses {tuple(lses.shape)}, "
                         f"out {tuple(out.shape)}, lse {tuple(lse.shape)} do not fit")
    if lses.dtype != torch.float32 or lse.dtype != torch.float32:
        raise DTypeError("merge: lse tensors must be float32")
    devs = {t.device for t in (parts, lses, out, lse)}
    if len(devs) != 1:
        raise DTypeError(f"merge: tensors on several devices {sorted(map(str, devs))}")
    n_rows = total_q * num_heads
    if n_rows == 0:
        return
    d_pad = triton.next_power_of_2(head_dim)
    # a [BLOCK_R, BLOCK_P, D] float32 tile of at most 4096 values (32 a thread at 4 warps;
    # 8192 spilled on sm_80 at head dim 256)
    block_p = min(triton.next_power_of_2(n), max(1, 4096 // d_pad))
    block_r = max(1, min(64, 4096 // (d_pad * block_p)))
    gpu = gpu_choices(parts.device)
    if gpu:  # enough programs to spread the reads over the device
        while block_r > 1 and triton.cdiv(n_rows, block_r) < 256:
            block_r //= 2
    # maxnreg: else ptxas spilled 16 B at 40 registers (sm_90, 16-bit partials, head dim 64, 64 a tile)
    extra = {"num_warps": 4, "maxnreg": 255} if gpu else {}
    grid = (triton.cdiv(n_rows, block_r),)
    with launch_guard(parts.device.type):
        _kernel[grid](
            parts, lses, out, lse, n, n_rows, num_heads, head_dim,
            *parts.stride(), *lses.stride(), *out.stride(), *lse.stride(),
            D_PAD=d_pad, BLOCK_R=block_r, BLOCK_P=block_p, **extra,
        )


def merge_attention_states_triton(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor],
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of ``(out_i [T, H, D], lse_i [T, H] float32)`` pairs; returns ``(out, lse)``."""
    if len(outs) != len(lses) or not outs:
        raise ShapeError(f"merge needs matching, non-empty lists; got {len(outs)} outs, {len(lses)} lses")
    shape = outs[0].shape
    if len(shape) != 3:
        raise ShapeError(f"merge: out must be [T, H, D], got {tuple(shape)}")
    for o, s in zip(outs, lses):
        if o.shape != shape or s.shape != shape[:2]:
            raise ShapeError(f"merge: out {tuple(o.shape)} / lse {tuple(s.shape)} do not match {tuple(shape)}")
        if s.dtype != torch.float32:
            raise DTypeError(f"merge: lse must be float32, got {s.dtype}")
        if not o.is_floating_point():
            raise DTypeError(f"merge: out must be floating point, got {o.dtype}")
    out_dtype = out_dtype or outs[0].dtype
    dev = outs[0].device
    parts = outs[0].unsqueeze(0) if len(outs) == 1 else torch.stack(list(outs))
    lse_parts = lses[0].unsqueeze(0) if len(lses) == 1 else torch.stack(list(lses))
    out = torch.empty(shape, dtype=out_dtype, device=dev)
    lse = torch.empty(shape[:2], dtype=torch.float32, device=dev)
    merge_partials(parts, lse_parts, out, lse)
    return out, lse
