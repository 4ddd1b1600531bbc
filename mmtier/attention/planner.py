"""``AttentionPlanner``: attention of a ``TieredKVCache`` over a sequence's pages, in whichever
tier they live: ``attention``, ``attention_state`` and ``attention_state_parts``, planned under
the lock (segments chosen, groups pinned, operands captured), computed without it, unpinned under
it again. Its own state: the compiled device operands per sequence (reused while unchanged).

It knows the cache's parts only by what it asks of them (``GroupHolder``: the residency part;
``SequenceTables``: the sequences part), so attention imports nothing of the cache.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from ..config import CacheConfig
from ..content import ContentKey, KeyMaker
from ..core.groups import ModalityGroup, Tier
from ..core.locking import OwnerLock
from ..core.segments import Segment, SequenceHandle, SequenceTable
from ..errors import DTypeError, ShapeError, UnknownKeyError
from ..eviction import EvictionPolicy
from ..pages.pool import PagePool
from ..stats import Counters
from ..tiers.lower import LowerTiers
from .batch import check_segments
from .compile import compile_segments
from .lower_operands import disk_stream, host_operands, release_held
from .operands import CompiledOperands
from .plan import AttentionPlan


class GroupHolder(Protocol):
    """What attention asks of the part that owns where groups live (``tiers.residency.Residency``
    has it); called with the lock held, but ``check_open``."""

    lock: OwnerLock          # the cache's lock: residency owns it, attention takes it from there
    lower: LowerTiers
    pools: dict[str, PagePool]

    def check_open(self) -> None: ...

    def apply_copies(self) -> None: ...

    def forget_corrupt(self, group: ModalityGroup) -> None: ...

    def settle(self, group: ModalityGroup) -> None: ...


class SequenceTables(Protocol):
    """A sequence's table (``cache.sequences.Sequences`` has it)."""

    def table(self, seq: SequenceHandle) -> SequenceTable: ...


class AttentionPlanner:
    """Plans, runs and unpins attention (see the module's docstring)."""

    def __init__(self, cfg: CacheConfig, device: torch.device, maker: KeyMaker,
                 seqs: SequenceTables, residency: GroupHolder, policy: EvictionPolicy, counters: Counters):
        self.cfg, self.lock, self.device, self.maker = cfg, residency.lock, device, maker
        self.seqs, self.residency, self.policy, self.counters = seqs, residency, policy, counters
        self.compiled = CompiledOperands()     # device operands per sequence, reused while unchanged

    def attention(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                  groups: Iterable[ContentKey] | None = None, causal: bool = True,
                  scale: float | None = None, modalities: Iterable[str] | None = None) -> torch.Tensor:
        """``TieredKVCache.attention`` (its contract is documented there)."""
        out, _ = self.attention_state(seq, layer, q, groups=groups, causal=causal, scale=scale,
                                      modalities=modalities)
        return out

    def attention_state(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                        groups: Iterable[ContentKey] | None = None, causal: bool = True,
                        scale: float | None = None, q_positions: torch.Tensor | None = None,
                        modalities: Iterable[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``TieredKVCache.attention_state`` (its contract is documented there)."""
        self.check_q(q)
        with self.lock:
            self.residency.apply_copies()
            table = self.seqs.table(seq)
            segments = self.select(seq, table, groups)
            if modalities is not None:
                mods = set(modalities)
                for m in mods:
                    self.cfg.spec(m)
                segments = [s for s in segments if s.group.modality in mods]
            n_q = q.shape[0]
            length = table.length
            if q_positions is None:
                if causal and n_q > length:
                    raise ShapeError(f"{n_q} queries but the sequence holds {length} tokens")
                q_pos = torch.arange(max(0, length - n_q), max(0, length - n_q) + n_q, dtype=torch.int32)
            else:
                q_pos = self.positions(q_positions, n_q)
            plan = self.plan(segments, layer, q, seq_id=seq.id)
        return self.run(plan, q, q_pos, causal, scale)

    def attention_state_parts(self, parts: Sequence[tuple[SequenceHandle, Iterable[ContentKey] | None, int, int | None]],
                              layer: int, q: torch.Tensor, q_positions: torch.Tensor, *,
                              causal: bool = True, scale: float | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``TieredKVCache.attention_state_parts`` (its contract is documented there)."""
        self.check_q(q)
        with self.lock:
            self.residency.apply_copies()
            segments, seen = [], set()
            for seq, keys, offset, start in parts:
                for s in self.select(seq, self.seqs.table(seq), keys):
                    if start is not None and s.start != start:
                        continue
                    if (seq.id, s.start) in seen:
                        raise ShapeError(f"sequence {seq.id}: the segment at {s.start} is in two parts")
                    seen.add((seq.id, s.start))
                    segments.append(Segment(s.group, s.start + int(offset)))
            plan = self.plan(segments, layer, q)
        return self.run(plan, q, self.positions(q_positions, q.shape[0]), causal, scale)

    @staticmethod
    def positions(q_positions, n_q: int) -> torch.Tensor:
        """Caller-given query positions as int32, left on their device (no copy back to the
        host: a CUDA tensor stays there)."""
        if not isinstance(q_positions, torch.Tensor) or q_positions.shape != (n_q,) \
                or q_positions.is_floating_point() or q_positions.is_complex():
            raise ShapeError(f"q_positions must be {n_q} integer positions, got "
                             f"{tuple(q_positions.shape) if isinstance(q_positions, torch.Tensor) else type(q_positions).__name__}")
        return q_positions if q_positions.dtype == torch.int32 else q_positions.to(torch.int32)

    def check_q(self, q) -> None:
        self.residency.check_open()
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ShapeError(f"q must be [n_q, num_q_heads, head_dim], got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise DTypeError(f"q dtype {q.dtype} is not float32, float16 or bfloat16")

    def select(self, seq: SequenceHandle, table: SequenceTable, groups: Iterable[ContentKey] | None):
        """The segments of ``table``, or of those groups (verified, all attached)."""
        if groups is None:
            return table.segments
        wanted = set(groups)
        for key in wanted:
            self.maker.verify(key)
        missing = wanted - {s.group.key for s in table.segments}
        if missing:
            raise UnknownKeyError(f"groups not attached to sequence {seq.id}: {sorted(map(str, missing))}")
        return [s for s in table.segments if s.group.key in wanted]

    def plan(self, segments: list[Segment], layer: int, q: torch.Tensor,
              seq_id: int | None = None) -> AttentionPlan:
        """Check the segments fit ``q`` and ``layer``, pin their groups and capture what the
        computation reads (lock held; ``run`` computes it without the lock). With ``seq_id``
        (the segments are that sequence's), its device operands are reused while unchanged."""
        check_segments(segments, layer, q)
        for s in segments:
            s.group.pins += 1
            self.policy.on_access(s.group)
        device_segs = [s for s in segments if s.group.tier == Tier.DEVICE]
        host_segs = [s for s in segments if s.group.tier == Tier.HOST]
        disk_segs = [s for s in segments if s.group.tier == Tier.DISK]
        plan = AttentionPlan(segments, None, self.device, disk_segments=disk_segs)
        try:
            plan.stream = disk_stream(self.residency.lower, disk_segs, layer)   # disk reads first:
            if device_segs or not segments:                                       # they overlap the rest
                if seq_id is None:
                    plan.device_ops = compile_segments(device_segs, layer, self.device_view)
                else:
                    plan.device_ops = self.compiled.operands(
                        seq_id, device_segs, layer, lambda segs, lay: compile_segments(segs, lay, self.device_view))
            if host_segs:
                plan.host_ops, plan.held = host_operands(self.residency.lower, host_segs, layer)
        except BaseException:
            self.unpin(plan)
            raise
        return plan

    def run(self, plan: AttentionPlan, q, q_pos, causal, scale) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute a plan without the lock, then unpin it under the lock."""
        try:
            return plan.run(q, q_pos, causal=causal, scale=scale, backend=self.backend())
        finally:
            with self.lock:
                self.unpin(plan)

    def unpin(self, plan: AttentionPlan) -> None:
        """Release what a plan holds (lock held): pins, host entries, stream buffers; groups a
        stream found corrupt become misses; groups freed while pinned release their storage."""
        plan.close(functools.partial(release_held, self.residency.lower))
        for g in plan.failed:
            self.counters.add("corrupt_reads", g.modality)
            self.residency.forget_corrupt(g)
        for g in plan.groups:
            g.pins -= 1
        for g in dict.fromkeys(plan.groups):
            if g.pins == 0 and g.freed:
                self.residency.settle(g)
        if plan.lower:
            self.counters.add("lower_tier_attentions")
        self.residency.apply_copies()

    def device_view(self, group: ModalityGroup):
        pool = self.residency.pools[group.modality]
        return (group.modality, pool.view, group.pages)

    def backend(self) -> str:
        return self.cfg.attention_backend
