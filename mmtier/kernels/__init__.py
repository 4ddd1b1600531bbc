"""Attention kernels: one public entry point per operation, dispatching by backend.

``backend="auto"`` runs Triton on CUDA tensors and the vectorised torch path (``reference``)
on CPU tensors; ``"triton"`` forces Triton (on CPU tensors only under ``TRITON_INTERPRET=1``);
``"torch"`` forces the torch path. Triton is imported lazily: importing this package needs
neither triton nor a GPU (and never imports Ray).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ConfigError
from .layout import HostTables, PagedKV, build_paged_kv, check_queries, upload_ints
from .reference import merge_attention_states_torch, paged_attention_torch, write_kv_torch

BACKENDS = ("auto", "triton", "torch")

__all__ = [
    "BACKENDS", "HostTables", "PagedKV", "build_paged_kv", "check_queries", "merge_attention_states",
    "paged_attention", "triton_available", "upload_ints", "write_kv",
]


def triton_available() -> bool:
    """Whether ``import triton`` works in this process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(backend: str, device: torch.device) -> bool:
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}", fields=("backend",))
    if backend == "torch":
        return False
    if backend == "auto" and device.type != "cuda":
        return False
    if not triton_available():
        if backend == "triton":
            raise ConfigError("backend 'triton' needs the triton package", fields=("backend",))
        return False
    return True


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
    if _use_triton(backend, q.device):
        from .triton_attention import paged_attention_triton

        return paged_attention_triton(q, q_indptr, q_pos, operands, causal=causal, scale=scale,
                                      out_dtype=out_dtype, host_q_indptr=host_q_indptr)
    return paged_attention_torch(q, q_indptr, q_pos, operands, causal=causal, scale=scale,
                                 out_dtype=out_dtype)


def merge_attention_states(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], *, backend: str = "auto",
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial ``(out, lse)`` states over disjoint key sets."""
    device = outs[0].device if len(outs) else torch.device("cpu")
    if _use_triton(backend, device):
        from .triton_merge import merge_attention_states_triton

        return merge_attention_states_triton(outs, lses, out_dtype=out_dtype)
    return merge_attention_states_torch(outs, lses, out_dtype=out_dtype)


def uses_triton(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` runs the Triton kernels for tensors on ``device``."""
    return _use_triton(backend, device)


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor,
             offsets: torch.Tensor, *, backend: str = "auto") -> None:
    """Scatter ``k, v [num_layers, n, Hkv, D]`` into the page-major pool view ``kv``: token
    ``i`` to page ``page_ids[i]``, slot ``offsets[i]``, in every layer. In place. The int32
    indices may be on ``kv``'s device or on the CPU (built on the host: the Triton path checks
    them there and uploads them without a device sync)."""
    if _use_triton(backend, kv.device):
        from .triton_write import write_kv_triton

        write_kv_triton(kv, k, v, page_ids, offsets)
        return
    write_kv_torch(kv, k, v, page_ids.to(kv.device), offsets.to(kv.device))
