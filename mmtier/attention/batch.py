"""Attention for a batch of sequences in one call: what an engine's decoder layer needs.

``TieredKVCache.attention_batch`` plans every sequence of the batch (its segments, the positions
of its queries), compiles the device-resident segments of all of them into one operand per pool
(``compile_batch``: one kernel launch per pool, whatever the batch size), and plans the host-
and disk-resident parts of each sequence as an ``AttentionPlan`` of its own, all under its lock
with every group pinned; ``BatchPlan.run`` computes it with the lock let go, merging each
sequence's lower parts into its rows by log-sum-exp on the device part's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.groups import ModalityGroup
from ..core.segments import Segment
from ..errors import ShapeError
from .kernels import merge_attention_states, paged_attention, upload_ints
from .kernels.layout import PagedKV
from .plan import AttentionPlan


def query_bounds(q_indptr, total_q: int, batch: int) -> list[int]:
    """``q_indptr`` as a checked list: ``batch + 1`` non-decreasing ints from 0 to ``total_q``."""
    if isinstance(q_indptr, torch.Tensor):
        if q_indptr.dim() != 1 or q_indptr.dtype.is_floating_point:
            raise ShapeError(f"q_indptr must be a 1-D integer tensor, got {q_indptr.dtype} {tuple(q_indptr.shape)}")
        bounds = [int(x) for x in q_indptr.tolist()]
    else:
        bounds = [int(x) for x in q_indptr]
    if len(bounds) != batch + 1:
        raise ShapeError(f"q_indptr has {len(bounds)} entries for {batch} sequences (want {batch + 1})")
    if bounds[0] != 0 or bounds[-1] != total_q or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ShapeError(f"q_indptr must rise from 0 to {total_q} queries, got {bounds}")
    return bounds


def check_segments(segments: Sequence[Segment], layer: int, q: torch.Tensor) -> None:
    """The segments must hold KV of ``layer`` with ``q``'s head dim and a KV head count that
    divides ``q``'s heads (the same rules as single-sequence attention)."""
    for s in segments:
        spec = s.group.spec
        if spec.kind != "kv":
            raise ShapeError(f"segment of {spec.name!r} holds embeddings, not KV")
        if not 0 <= layer < spec.num_layers:
            raise ShapeError(f"layer {layer} out of range for {spec.name!r} ({spec.num_layers} layers)")
        if spec.head_dim != q.shape[2]:
            raise ShapeError(f"q head dim {q.shape[2]} != {spec.name!r} head dim {spec.head_dim}; "
                             "restrict with groups=")
        if q.shape[1] % spec.num_kv_heads:
            raise ShapeError(f"{q.shape[1]} query heads are not a multiple of "
                             f"{spec.num_kv_heads} KV heads of {spec.name!r}")



@dataclass(eq=False)
class BatchPlan:
    """What one batched attention call reads (captured under the cache's lock, groups pinned)."""

    device_groups: list[ModalityGroup]        # pinned by this plan (a group may appear twice)
    device_ops: list[PagedKV]                 # one operand per pool over every sequence's segments
    lower: dict[int, AttentionPlan]           # batch item -> its host / disk part
    device: torch.device

    def run(self, q: torch.Tensor, bounds: list[int], q_pos: torch.Tensor, *, causal: bool,
            scale: float | None, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of every sequence's rows; runs without the cache's lock."""
        dev = self.device
        host_q_indptr = torch.tensor(bounds, dtype=torch.int32)
        q_indptr, q_pos_dev = upload_ints([host_q_indptr, q_pos], dev)
        out, lse = paged_attention(q.to(dev), q_indptr, q_pos_dev, self.device_ops, causal=causal,
                                   scale=scale, backend=backend, out_dtype=torch.float32,
                                   host_q_indptr=host_q_indptr)
        for b, part in self.lower.items():
            q0, q1 = bounds[b], bounds[b + 1]
            if q0 == q1:
                continue
            o, s = part.run(q[q0:q1].float(), q_pos[q0:q1], causal=causal, scale=scale, backend=backend)
            o, s = merge_attention_states([out[q0:q1], o.to(dev)], [lse[q0:q1], s.to(dev)],
                                          backend=backend, out_dtype=torch.float32)
            out[q0:q1], lse[q0:q1] = o, s
        return out.to(device=q.device, dtype=q.dtype), lse.to(q.device)
