"""``EngineSurface``: what an engine's model runner calls once per layer on a ``TieredKVCache``:
per-layer writes (``reserve`` / ``write_layer``, sealed into a shared group by ``seal``) and one
attention call for a batch of sequences (``attention_batch``). Used by the transformers adapter
and the vLLM / SGLang connectors. Its own state: the step plans (a batch's plan made at one layer
of a step and reused by its other layers).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from ..attention.batch import BatchPlan, check_segments, query_bounds
from ..attention.compile import compile_batch
from ..attention.step_plans import StepPlans
from ..config import CacheConfig
from ..content import ContentKey, tenant_scope
from ..core.groups import Tier
from ..core.locking import OwnerLock
from ..core.segments import Segment, SequenceHandle, naming
from ..errors import ForeignKeyError, ShapeError, UnknownKeyError, UnknownModalityError
from ..eviction import EvictionPolicy
from ..pages.layer_writes import Reservation, write_one_layer
from ..pages.payload import token_identity
from .attention import AttentionPlanner
from .group_index import GroupIndex
from .keys import CacheKeys
from .residency import Residency
from .sequences import Sequences


class EngineSurface:
    """Per-layer writes and batched attention (see the module's docstring)."""

    def __init__(self, cfg: CacheConfig, lock: OwnerLock, keyer: CacheKeys, index: GroupIndex,
                 seqs: Sequences, residency: Residency, planner: AttentionPlanner,
                 policy: EvictionPolicy):
        self.cfg, self.lock, self.keyer, self.index = cfg, lock, keyer, index
        self.seqs, self.residency, self.planner, self.policy = seqs, residency, planner, policy
        self.steps = StepPlans()               # batch plans, reused by the other layers of a step


    def reserve(self, seq: SequenceHandle, modality: str, n: int, *,
                tokens: Sequence[int] | None = None, new_run: bool = False) -> Reservation:
        """``TieredKVCache.reserve`` (its contract is documented there)."""
        self.residency.check_open()
        spec = self.cfg.spec(modality)
        if spec.kind != "kv":
            raise UnknownModalityError(f"modality {modality!r} holds embeddings; use put_embedding")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ShapeError(f"reserve needs n > 0 tokens, got {n!r}")
        if tokens is not None and len(tokens) != n:
            raise ShapeError(f"{len(tokens)} token ids for {n} tokens")
        identity = token_identity(modality, None, None, tokens) if tokens is not None else \
            b"unique:" + os.urandom(16)
        with self.lock:
            self.residency.lower.apply_completions()
            growth = self.seqs.grow(self.seqs.table(seq), modality, spec, n, new_run)
            group = self.seqs.commit_growth(growth, identity)
            group.pins += 1
            res = Reservation(group, growth.pool, growth.page_ids, growth.offsets, n)
            table = growth.table
            table.open_runs = [r for r in table.open_runs if r.open] + [res]
            return res

    def write_layer(self, res: Reservation, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``TieredKVCache.write_layer`` (its contract is documented there)."""
        self.residency.check_open()
        with self.lock:
            write_one_layer(res, layer, k, v, self.planner.backend())
            if res.complete:
                res.open = False
                res.group.pins -= 1

    def seal(self, seq: SequenceHandle, key: ContentKey, run: Reservation | None = None) -> bool:
        """``TieredKVCache.seal`` (its contract is documented there)."""
        self.keyer.check_key(key, "kv")
        with self.lock:
            table = self.seqs.table(seq)
            if key.scope != tenant_scope(self.keyer.salt(seq.tenant)):
                raise ForeignKeyError(f"key {key!r} belongs to another tenant than sequence {seq.id}")
            if run is None:
                group = table.tail.group if table.tail is not None else None
                which = "its last run"
            else:
                if not isinstance(run, Reservation):
                    raise ShapeError(f"run must be a Reservation of sequence {seq.id}, got {type(run).__name__}")
                group = run.group if any(s.group is run.group for s in table.segments) else None
                which = "the reserved run"
                if group is None:
                    raise UnknownKeyError(f"the reservation is not a run of sequence {seq.id}")
            if group is None or group.key is not None or group.modality != key.modality:
                raise UnknownKeyError(f"sequence {seq.id}: {which} is no private {key.modality} run to seal")
            if group.pins:
                raise ShapeError(f"sequence {seq.id}: {which} is still being written")
            index = next(i for i, s in enumerate(table.segments) if s.group is group)
            self.keyer.check_place(seq, table, key, table.segments[index].before)
            names = naming(key, table.segments[index].before)
            if names is not None:
                table.name_segment(index, names)       # what follows may chain it, held or not
            if key in self.index or group.tier != Tier.DEVICE:
                return False                      # held already, or moved down meanwhile
            self.index.name(key, group)
            return True

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
            self.residency.lower.apply_completions()
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
