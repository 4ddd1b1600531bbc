"""Attention kernels: one public entry point per operation, dispatching by backend.

``backend="auto"`` runs Triton on CUDA tensors and the vectorised torch path (``reference``)
on CPU tensors; ``"triton"`` forces Triton (on CPU tensors only under ``TRITON_INTERPRET=1``);
``"torch"`` forces the torch path. Triton is imported lazily: importing this package needs
neither triton nor a GPU (and never imports Ray).

The choice of backend, what every Triton launch shares (``launch``) and the int32 index arrays
(``INDEX_DTYPE``, ``upload_ints``) are the write kernels' too: they live with them in
``mmtier.pages.kernels``, a layer below, and are imported from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...pages.kernels import BACKENDS, triton_available, upload_ints, uses_triton
from .layout import HostTables, PagedKV, build_paged_kv, check_queries
from .reference import merge_attention_states_torch, paged_attention_torch
from .scales import KVScales, fold_query, spec_scales, unfold_output

__all__ = [
    "BACKENDS", "HostTables", "KVScales", "PagedKV", "build_paged_kv", "check_queries", "merge_attention_states",
    "paged_attention", "spec_scales", "triton_available", "upload_ints",
]


def paged_attention(
    q: torch.Tensor, q_indptr: torch.Tensor, q_pos: torch.Tensor, operands: Sequence[PagedKV],
    *, causal: bool = True, scale: float | None = None, backend: str = "auto",
    out_dtype: torch.dtype | None = None, host_q_indptr: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [total_q, Hq, D]`` over the segments of every operand (one per pool,
    page sizes may differ), merged exactly; returns ``(out [total_q, Hq, D], lse [total_q, Hq])``
    with ``lse`` float32 in natural log (``-inf``, ``out == 0`` where a query sees no key).
    The Triton path computes in the pool's dtype: a float32 ``q`` over a 16-bit pool is rounded
    to it, as if given in it (the dots run on 16-bit tiles with float32 sums).

    ``host_q_indptr``: ``q_indptr``'s values on the CPU; with operands that carry their
    tables on the host too (``PagedKV.host``), the Triton path plans without a device sync."""
    if any(op.scales is not None for op in operands):
        return _scaled_attention(q, q_indptr, q_pos, operands, causal=causal, scale=scale, backend=backend,
                                 out_dtype=out_dtype, host_q_indptr=host_q_indptr)
    if uses_triton(backend, q.device):
        from .triton_attention import paged_attention_triton

        return paged_attention_triton(q, q_indptr, q_pos, operands, causal=causal, scale=scale,
                                      out_dtype=out_dtype, host_q_indptr=host_q_indptr)
    return paged_attention_torch(q, q_indptr, q_pos, operands, causal=causal, scale=scale,
                                 out_dtype=out_dtype)


def _scaled_attention(q, q_indptr, q_pos, operands, *, causal, scale, backend, out_dtype, host_q_indptr):
    """Operands with fp8 scales (``scales.py``): each in a call of its own, the K scale folded
    into the query (float32; the Triton kernel rounds it to its 16-bit tile dtype) and the V
    scale into the output; the unscaled ones in one call; merged."""
    check_queries(q, q_indptr, q_pos)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    plain = [op for op in operands if op.scales is None]
    states = []
    if plain:
        states.append(paged_attention(q, q_indptr, q_pos, plain, causal=causal, scale=scale, backend=backend,
                                      out_dtype=torch.float32, host_q_indptr=host_q_indptr))
    for op in operands:
        if op.scales is None:
            continue
        if q.shape[1] % op.num_kv_heads:
            from ...errors import ShapeError

            raise ShapeError(f"{q.shape[1]} query heads are not a multiple of {op.num_kv_heads} KV heads")
        k_scale, v_scale = op.scales.at(op.layer)
        out, lse = paged_attention(fold_query(q, k_scale), q_indptr, q_pos, [op.unscaled()], causal=causal,
                                   scale=scale, backend=backend, out_dtype=torch.float32,
                                   host_q_indptr=host_q_indptr)
        states.append((unfold_output(out, v_scale), lse))
    if len(states) == 1:
        out, lse = states[0]
    else:
        out, lse = merge_attention_states([o for o, _ in states], [s for _, s in states], backend=backend,
                                          out_dtype=torch.float32)
    return out.to(out_dtype or q.dtype), lse


def merge_attention_states(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], *, backend: str = "auto",
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial ``(out, lse)`` states over disjoint key sets."""
    device = outs[0].device if len(outs) else torch.device("cpu")
    if uses_triton(backend, device):
        from .triton_merge import merge_attention_states_triton

        return merge_attention_states_triton(outs, lses, out_dtype=out_dtype)
    return merge_attention_states_torch(outs, lses, out_dtype=out_dtype)
