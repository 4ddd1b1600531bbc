"""``StepPlans``: a batch's attention plan, made at one layer of a step and reused by the others.

An engine's decoder asks ``attention_batch`` once per layer, and every layer of a step reads
the same segments of the same sequences with the same query positions: only the layer differs,
and a layer is an offset in a pool's view, not a table. So the layer-free part of a batch's
plan (the device segments of each sequence, the groups to pin, the query positions, the
compiled operands) is kept per batch and reused while every sequence still has

- the same number of segments,
- for each segment the same group at the same start, with the same page list object (the
  cache never edits a group's ``pages`` in place: growth, a promotion, a demotion or a free
  each assign a new list) and the same token count, still on the device,

and the call has the same query bounds and causality (the query positions follow). Plans with groups in a lower tier, or
restricted to some groups, are never kept (their reads are per layer). Not thread-safe: the
cache uses it under its lock. Mechanism only: the cache decides what to plan and pins what a
reused plan names.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..core.groups import ModalityGroup, Tier
from ..core.segments import Segment, SequenceTable
from .kernels.layout import PagedKV
from .operands import same, stamp

KEPT = 16          # batches remembered (a step's self-attention batch, its cross batch, ...)

_Stamp = tuple[list[tuple[object, list[int], int, int]], ...]


@dataclass(eq=False)
class StepPlan:
    """The layer-free part of a batch's plan."""

    stamp: _Stamp
    layers: int                                 # the layers every segment's pool holds
    groups: list[ModalityGroup]                 # to pin per call (a group may appear twice)
    q_pos: torch.Tensor
    ops: list[PagedKV]                          # compiled at some layer
    by_layer: dict[int, list[PagedKV]] = field(default_factory=dict)

    def operands(self, layer: int) -> list[PagedKV]:
        ops = self.by_layer.get(layer)
        if ops is None:
            ops = self.by_layer[layer] = [op.at_layer(layer) for op in self.ops]
        return ops


def stamp_of(tables: list[SequenceTable]) -> _Stamp | None:
    """What a kept plan must still match: each sequence's ``compiled_operands.stamp``;
    ``None`` when some segment is not on the device."""
    if any(s.group.tier != Tier.DEVICE for t in tables for s in t.segments):
        return None
    return tuple(stamp(t.segments) for t in tables)


def _same(a: _Stamp, b: _Stamp) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


class StepPlans:
    """Kept plans by batch: ``(sequence ids, query bounds, causal)``."""

    def __init__(self, kept: int = KEPT):
        self._kept = kept
        self._plans: OrderedDict[tuple, StepPlan] = OrderedDict()
        self.reuses = 0            # calls answered from a kept plan (tests, stats)

    def get(self, key: tuple, tables: list[SequenceTable], layer: int) -> StepPlan | None:
        """The kept plan of this batch when it still matches ``tables`` and holds ``layer``."""
        plan = self._plans.get(key)
        if plan is None or not 0 <= layer < plan.layers:
            return None
        stamp = stamp_of(tables)
        if stamp is None or not _same(plan.stamp, stamp):
            del self._plans[key]
            return None
        self._plans.move_to_end(key)
        self.reuses += 1
        return plan

    def keep(self, key: tuple, tables: list[SequenceTable], batch: list[list[Segment]],
             q_pos: torch.Tensor, ops: list[PagedKV], layer: int) -> None:
        stamp = stamp_of(tables)
        if stamp is None:
            return
        groups = [s.group for segs in batch for s in segs]
        layers = min((g.spec.num_layers for g in groups), default=0)
        self._plans[key] = StepPlan(stamp, layers, groups, q_pos, ops, {layer: ops})
        self._plans.move_to_end(key)
        while len(self._plans) > self._kept:
            self._plans.popitem(last=False)

    def drop(self, seq_id: int) -> None:
        """Forget every batch with this sequence (released)."""
        for key in [k for k in self._plans if seq_id in k[0]]:
            del self._plans[key]
