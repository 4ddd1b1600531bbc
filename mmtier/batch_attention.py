"""Attention for a batch of sequences in one call: what an engine's decoder layer needs.

``TieredKVCache.attention_batch`` plans every sequence of the batch (its segments, the positions
of its queries), compiles the device-resident segments of all of them into one operand per pool
(``compile_batch``: one kernel launch per pool, whatever the batch size), and computes the host-
and disk-resident parts of each sequence where they live, merging them into that sequence's rows
by log-sum-exp. Called with the cache's lock held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .errors import ShapeError
from .groups import Tier
from .kernels import merge_attention_states, paged_attention
from .table import Segment, compile_batch

if TYPE_CHECKING:
    from .cache import TieredKVCache


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


def attend_batch(cache: TieredKVCache, batch: list[list[Segment]], layer: int, q: torch.Tensor,
                 bounds: list[int], q_pos: torch.Tensor, causal: bool, scale: float | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of every sequence's queries over its segments (checked, pinned here)."""
    flat = [s for segs in batch for s in segs]
    check_segments(flat, layer, q)
    for s in flat:
        s.group.pins += 1
        cache.policy.on_access(s.group)
    try:
        return _attend(cache, batch, layer, q, bounds, q_pos, causal, scale)
    finally:
        for s in flat:
            s.group.pins -= 1


def _attend(cache, batch, layer, q, bounds, q_pos, causal, scale):
    dev = cache.arena.device
    device_batch = [[s for s in segs if s.group.tier == Tier.DEVICE] for segs in batch]
    ops = compile_batch(device_batch, layer, cache._device_view)
    q_indptr = torch.tensor(bounds, dtype=torch.int32, device=dev)
    out, lse = paged_attention(q.to(dev), q_indptr, q_pos.to(dev), ops, causal=causal, scale=scale,
                               backend=cache._backend(), out_dtype=torch.float32)
    if cache.lower.enabled:
        for b, segs in enumerate(batch):
            q0, q1 = bounds[b], bounds[b + 1]
            if q0 == q1 or all(s.group.tier == Tier.DEVICE for s in segs):
                continue
            states = cache.lower.lower_states(segs, layer, q[q0:q1], q_pos[q0:q1].cpu(), causal, scale)
            if not states:
                continue
            o, s = merge_attention_states([out[q0:q1].cpu(), *(x[0].cpu() for x in states)],
                                          [lse[q0:q1].cpu(), *(x[1].cpu() for x in states)],
                                          backend="torch", out_dtype=torch.float32)
            out[q0:q1], lse[q0:q1] = o.to(dev), s.to(dev)
    return out.to(device=q.device, dtype=q.dtype), lse.to(q.device)
