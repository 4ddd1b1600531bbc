"""``BatchPlanner``: one attention call for a batch of sequences (``attention_batch``), what an
engine's decoder layer asks once per layer: every sequence's segments and query positions
(``batch_segments``), the device segments of all of them compiled into one operand per pool
(``plan_batch``), each sequence's host and disk segments planned by the ``AttentionPlanner``,
all under the lock with every group pinned; computed with the lock let go, unpinned under it
again (``unpin_batch``). Its own state: the step plans (a batch's plan made at one layer of a
step and reused by its other layers).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..content import ContentKey
from ..core.groups import Tier
from ..core.segments import Segment, SequenceHandle
from ..errors import ShapeError
from ..eviction import EvictionPolicy
from .batch import BatchPlan, check_segments, query_bounds
from .compile import compile_batch
from .planner import AttentionPlanner, GroupHolder, SequenceTables
from .step_plans import StepPlans


class BatchPlanner:
    """Plans, runs and unpins a batch's attention (see the module's docstring)."""

    def __init__(self, seqs: SequenceTables, residency: GroupHolder,
                 planner: AttentionPlanner, policy: EvictionPolicy):
        self.lock, self.seqs, self.residency, self.planner, self.policy = residency.lock, seqs, residency, planner, policy
        self.steps = StepPlans()               # batch plans, reused by the other layers of a step

    def attention_batch(self, seqs: Sequence[SequenceHandle], layer: int, q: torch.Tensor,
                        q_indptr: torch.Tensor | Sequence[int], *,
                        groups: Sequence[Iterable[ContentKey] | None] | None = None,
                        causal: bool = True, scale: float | None = None) -> torch.Tensor:
        """``TieredKVCache.attention_batch`` (its contract is documented there)."""
        return self.attention_batch_state(seqs, layer, q, q_indptr, groups=groups, causal=causal,
                                          scale=scale)[0]

    def attention_batch_state(self, seqs: Sequence[SequenceHandle], layer: int, q: torch.Tensor,
                              q_indptr: torch.Tensor | Sequence[int], *,
                              groups: Sequence[Iterable[ContentKey] | None] | None = None,
                              causal: bool = True, scale: float | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``TieredKVCache.attention_batch_state`` (its contract is documented there)."""
        self.planner.check_q(q)
        seqs = list(seqs)
        bounds = query_bounds(q_indptr, q.shape[0], len(seqs))
        if groups is not None and len(groups) != len(seqs):
            raise ShapeError(f"{len(groups)} group lists for {len(seqs)} sequences")
        with self.lock:
            self.residency.apply_copies()
            tables = [self.seqs.table(seq) for seq in seqs]
            step = (tuple(seq.id for seq in seqs), tuple(bounds), causal, tuple(q.shape[1:]), q.dtype) \
                if groups is None else None                  # a self-attention batch: kept per step
            kept = self.steps.get(step, tables, layer) if step is not None else None
            if kept is not None:                             # another layer of the step that planned it
                plan = BatchPlan(list(kept.groups), kept.operands(layer), {}, self.planner.device)
                for g in plan.device_groups:
                    g.pins += 1
                q_pos = kept.q_pos
            else:
                batch, q_pos = self.batch_segments(seqs, tables, groups, bounds, causal)
                plan = self.plan_batch(batch, layer, q)
                if step is not None and not plan.lower:
                    self.steps.keep(step, tables, batch, q_pos, plan.device_ops, layer)
        try:
            return plan.run(q, bounds, q_pos, causal=causal, scale=scale, backend=self.planner.backend())
        finally:
            with self.lock:
                self.unpin_batch(plan)

    def batch_segments(self, seqs, tables, groups, bounds: list[int], causal: bool
                        ) -> tuple[list[list[Segment]], torch.Tensor]:
        """Each sequence's segments (those of ``groups[b]`` when given) and the positions of
        every query (each sequence's last ones), checked (lock held)."""
        batch, positions = [], []
        for b, (seq, table) in enumerate(zip(seqs, tables)):
            batch.append(list(self.planner.select(seq, table, None if groups is None else groups[b])))
            n_q, length = bounds[b + 1] - bounds[b], table.length
            if causal and n_q > length:
                raise ShapeError(f"sequence {seq.id}: {n_q} queries but it holds {length} tokens")
            first = max(0, length - n_q)
            positions.append(torch.arange(first, first + n_q, dtype=torch.int32))
        return batch, (torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int32))

    def plan_batch(self, batch: list[list[Segment]], layer: int, q: torch.Tensor) -> BatchPlan:
        """A batch's plan (lock held): the device segments of every sequence compiled into one
        operand per pool (one launch each), their groups pinned; each sequence's host and disk
        segments in a plan of its own (``AttentionPlanner.plan``)."""
        check_segments([s for segs in batch for s in segs], layer, q)
        device_batch = [[s for s in segs if s.group.tier == Tier.DEVICE] for segs in batch]
        plan = BatchPlan([s.group for segs in device_batch for s in segs], [], {}, self.planner.device)
        for g in plan.device_groups:
            g.pins += 1
            self.policy.on_access(g)
        try:
            plan.device_ops = compile_batch(device_batch, layer, self.planner.device_view)
            for b, segs in enumerate(batch):
                lower = [s for s in segs if s.group.tier != Tier.DEVICE]
                if lower:
                    plan.lower[b] = self.planner.plan(lower, layer, q)
        except BaseException:
            self.unpin_batch(plan)
            raise
        return plan

    def unpin_batch(self, plan: BatchPlan) -> None:
        for p in plan.lower.values():
            self.planner.unpin(p)
        plan.lower = {}
        for g in plan.device_groups:
            g.pins -= 1
        for g in dict.fromkeys(plan.device_groups):
            if g.pins == 0 and g.freed:
                self.residency.settle(g)
        plan.device_groups = []
