"""``TieredKVCache``: the in-process cache. Composes pools, groups, tables, keys and policy.

Every public method validates its input completely before it changes anything, so a call that
raises leaves the cache exactly as it was. One lock (``OwnerLock``) guards the bookkeeping only:
attention is planned under it (segments chosen, groups pinned, operands captured), computed
without it, and unpinned under it again; a call that must wait for a copy (a spill that makes
room, a restore from disk) marks the groups it works on and lets go of the lock for the wait.
The cache composes the lower tiers (``residency``) and the attention plans, which know it only
through what it passes them (``GroupOwner``).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from .attention_plan import AttentionPlan
from .batch_attention import check_segments
from .compiled_operands import CompiledOperands
from .config import CacheConfig, ModalitySpec
from .content import ContentKey, KeyMaker, media_digest, tenant_salt, tenant_scope
from .engine_api import EngineAPI
from .errors import (
    CapacityError,
    ClosedError,
    CorruptDataError,
    DTypeError,
    ForeignKeyError,
    ShapeError,
    UnknownKeyError,
    UnknownModalityError,
)
from .eviction import EvictionPolicy, make_policy
from .groups import ModalityGroup, Tier
from .leases import Lease, LeaseTable
from .lineage import Lineage
from .locking import OwnerLock
from .payload import (
    check_kv,
    check_payload,
    slot_mapping,
    token_identity,
    write_embedding,
    write_fresh_pages,
    write_slots,
)
from .pool import DeviceArena, PagePool
from .residency import WAIT_S, LowerTiers
from .room import ROOM_WAIT_S, Room
from .stats import CacheStats, Counters, TierUsage
from .table import Segment, SequenceHandle, SequenceTable, compile_segments

DEFAULT_TENANT = "default"


@dataclass(eq=False)
class _Growth:
    """Pages allocated for ``n`` tokens at a sequence's end, not yet recorded (``_grow``)."""

    table: SequenceTable
    group: ModalityGroup | None         # the tail run they extend; None: a new run
    pool: PagePool
    pages: list[int]                    # the new pages
    n: int
    page_ids: torch.Tensor              # int32 slot mapping of the n tokens (host)
    offsets: torch.Tensor


class TieredKVCache(EngineAPI):
    """Paged, modality-aware KV cache with content-keyed sharing (see docs/design.md's contract)."""

    def __init__(self, cfg: CacheConfig, policy: EvictionPolicy | None = None):
        """``policy``: an eviction policy instance to use instead of ``cfg.eviction_policy``'s
        (an offline reference in a benchmark, say); it must be new (it has seen no group)."""
        self.cfg = cfg
        self.arena = DeviceArena(cfg)
        self.pools: dict[str, PagePool] = self.arena.pools
        self.keys = KeyMaker(cfg.model, cfg.key_secret)
        self.policy = policy if policy is not None else make_policy(cfg)
        self.counters = Counters()
        self._compiled = CompiledOperands()     # device operands per sequence, reused while unchanged
        self._lock = OwnerLock()
        self._groups: dict[ContentKey, ModalityGroup] = {}
        self._seqs: dict[int, SequenceTable] = {}
        self._gids = itertools.count(1)
        self._seq_ids = itertools.count(1)
        self._closed = False
        self.leases = LeaseTable(ttl=30.0, clock=self.policy.clock)
        self.lineage = Lineage()
        self.lower = LowerTiers(cfg, self.keys, self.counters, self.policy, owner=self)
        self.room = Room(self._lock, self.policy, self.lower, self._live_groups, self._drop, self.pools)
        for group in self.lower.adopt_disk_inventory(self._groups, lambda: next(self._gids)):
            self._groups[group.key] = group
            self.policy.on_insert(group)

    # ------------------------------------------------------------------ keys and tenants
    def _salt(self, tenant: str | None) -> bytes:
        tenant = DEFAULT_TENANT if tenant is None else tenant
        if not isinstance(tenant, str) or not tenant:
            raise ForeignKeyError(f"tenant must be a non-empty string, got {tenant!r}")
        return tenant_salt(self.cfg.key_secret, tenant)

    def content_key(
        self,
        modality: str,
        media: bytes | bytearray | memoryview,
        *,
        tenant: str | None = None,
        parent: ContentKey | None = None,
        params: dict[str, object] | None = None,
    ) -> ContentKey:
        """The key of a media item: hashes the bytes here (never trusts a caller's id).

        ``parent`` (a ``prefix_key``) makes the key prefix-dependent; ``params`` are the
        preprocessing parameters that change the tokens (resolution, sample rate, ...)."""
        spec = self.cfg.spec(modality)
        if not isinstance(media, (bytes, bytearray, memoryview)):
            raise DTypeError(f"media must be bytes-like, got {type(media).__name__}")
        key = self.keys.derive(
            modality=modality, layout=spec.layout_fields(), media=media_digest(media, params),
            tenant_salt=self._salt(tenant), parent=parent)
        if parent is not None:
            with self._lock:
                self.lineage.note(key, parent)
        return key

    def prefix_key(self, seq: SequenceHandle) -> ContentKey:
        """A key naming everything ``seq`` holds so far; pass it as ``parent=`` to chain."""
        with self._lock:
            table = self._table(seq)
            modality = table.tail.group.modality if table.tail else next(iter(self.cfg.modalities))
            key = self.keys.chain(modality=modality, chain_digest=table.chain,
                                  tenant_salt=self._salt(seq.tenant))
            last = next((s.group.key for s in reversed(table.segments) if s.group.key is not None), None)
            if last is not None:
                self.lineage.note(key, last)
            return key

    def _check_key(self, key: ContentKey, kind: str | None = None) -> ModalitySpec:
        self.keys.verify(key)
        spec = self.cfg.spec(key.modality)
        if kind is not None and spec.kind != kind:
            raise UnknownModalityError(f"modality {key.modality!r} holds {spec.kind!r} payloads, not {kind!r}")
        return spec

    # ------------------------------------------------------------------ sequences
    def create_sequence(self, tenant: str | None = None) -> SequenceHandle:
        self._open()
        self._salt(tenant)
        with self._lock:
            handle = SequenceHandle(next(self._seq_ids), DEFAULT_TENANT if tenant is None else tenant)
            self._seqs[handle.id] = SequenceTable(handle)
            return handle

    def _table(self, seq: SequenceHandle) -> SequenceTable:
        if not isinstance(seq, SequenceHandle):
            raise UnknownKeyError(f"expected a SequenceHandle, got {type(seq).__name__}")
        table = self._seqs.get(seq.id)
        if table is None or table.handle != seq:
            raise UnknownKeyError(f"unknown sequence {seq.id} (released or never created)")
        return table

    def sequence(self, seq: SequenceHandle) -> SequenceTable:
        """The sequence's table (segments, views by modality and by key)."""
        with self._lock:
            return self._table(seq)

    def append(self, seq: SequenceHandle, modality: str, k: torch.Tensor, v: torch.Tensor,
               *, tokens: Sequence[int] | None = None, new_run: bool = False) -> None:
        """Append tokens' K/V (``[num_layers, n, num_kv_heads, head_dim]``) to the sequence.

        ``tokens`` (their ids) name the content for the prefix chain; without them the chain
        hashes the K/V bytes. ``new_run``: the tokens start a segment of their own instead of
        extending the tail run (a boundary the caller needs: an embedded pool places a group
        attended elsewhere between the two)."""
        self._open()
        spec = self.cfg.spec(modality)
        if spec.kind != "kv":
            raise UnknownModalityError(f"modality {modality!r} holds embeddings; use put_embedding")
        n = self._check_kv(spec, k, v)
        if tokens is not None and len(tokens) != n:
            raise ShapeError(f"{len(tokens)} token ids for {n} tokens")
        identity = token_identity(modality, k, v, tokens)
        with self._lock:
            self.lower.apply_completions()
            growth = self._grow(self._table(seq), modality, spec, n, new_run)
            try:
                self._write(growth.pool, k, v, growth.page_ids, growth.offsets)
            except BaseException:
                growth.pool.free(growth.pages)
                raise
            self._commit_growth(growth, identity)

    def _grow(self, table: SequenceTable, modality: str, spec: ModalitySpec, n: int,
              new_run: bool = False) -> _Growth:
        """Pages for ``n`` more tokens at the end of ``table``'s sequence: the device tail run
        extended (unless ``new_run``, or another thread is moving it down: its staged copy would
        miss the new tokens), or a new run. Nothing is recorded until ``_commit_growth``: a write
        that fails in between gives the new pages back and leaves the sequence as it was (lock
        held; making room may let go of it, so the plan is made again after each wait)."""
        pool = self.pools[modality]
        seq = table.handle
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            table = self._table(seq)
            tail = table.tail
            extend = not new_run and tail is not None and tail.group.key is None \
                and tail.group.modality == modality and tail.group.tier == Tier.DEVICE \
                and tail.group.busy == 0
            have = tail.group.num_tokens if extend else 0
            slack = (spec.pages_for(have) * spec.page_size - have) if extend else 0
            new_pages = spec.pages_for(max(0, n - slack))
            if new_pages <= pool.num_free:
                break
            self._make_room(pool, new_pages - pool.num_free, [tail.group] if extend else [], deadline=deadline)
        pages = pool.allocate(new_pages)
        all_pages = (tail.group.pages + pages) if extend else pages
        page_ids, offsets = slot_mapping(all_pages, have, n, spec.page_size)
        return _Growth(table, tail.group if extend else None, pool, pages, n, page_ids, offsets)

    def _commit_growth(self, g: _Growth, identity: bytes) -> ModalityGroup:
        """Record a growth whose tokens are (or will be) written: the run and the prefix chain."""
        if g.group is not None:
            group = g.group
            group.pages = group.pages + g.pages
            group.num_tokens += g.n
            g.table.extend_chain(identity)
        else:
            group = ModalityGroup(next(self._gids), None, g.pool.spec, g.n, pages=g.pages, refs=1)
            g.table.add(group, identity)
            self.policy.on_insert(group)
        self.counters.add("appended_tokens", group.modality, g.n)
        return group

    # ------------------------------------------------------------------ shared groups
    def contains(self, key: ContentKey) -> bool:
        self._check_key(key)
        with self._lock:
            self.lower.apply_completions()
            group = self._groups.get(key)
            self.counters.add("hits" if group is not None else "misses", key.modality)
            if group is not None:
                group.hits += 1          # a lookup hit; recency moves on use (attach, read)
            return group is not None

    def put(self, key: ContentKey, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Store a group's K/V once; ``False`` (and nothing written) when it is already held."""
        self._open()
        spec = self._check_key(key, "kv")
        n = self._check_kv(spec, k, v)
        return self._store(key, spec, n, lambda pool, pages: self._write_fresh(pool, k, v, pages))

    def put_embedding(self, key: ContentKey, x: torch.Tensor) -> bool:
        """Store encoder outputs ``[n_tokens, width]`` under a content-only key."""
        self._open()
        spec = self._check_key(key, "embedding")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != spec.width or x.shape[0] == 0:
            raise ShapeError(f"{key.modality}: embedding must be [n_tokens > 0, {spec.width}], "
                             f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        self._check_dtype(spec, x)
        return self._store(key, spec, x.shape[0], lambda pool, pages: write_embedding(pool, x, pages))

    def _store(self, key: ContentKey, spec: ModalitySpec, n: int, write) -> bool:
        """A new shared group of ``n`` tokens: pages (making room), ``write(pool, pages)``, index."""
        with self._lock:
            self.lower.apply_completions()
            if key in self._groups:
                return False
            pool = self.pools[key.modality]
            pages = self._allocate(pool, spec.pages_for(n), [])
            if key in self._groups:          # put by another thread while room was made
                pool.free(pages)
                return False
            try:
                write(pool, pages)
            except BaseException:            # nothing recorded: the call changes nothing
                pool.free(pages)
                raise
            self._insert_group(key, spec, n, pages)
            return True

    def get_embedding(self, key: ContentKey) -> torch.Tensor:
        """A copy of the stored encoder outputs ``[n_tokens, width]``."""
        spec = self._check_key(key, "embedding")
        with self._lock:
            self.lower.apply_completions()
            group = self._require(key)
            group.hits += 1
            self.counters.add("embedding_reads", key.modality)
            self.policy.on_access(group)
            self._promote(group)                 # may let go of the lock while it waits
            group = self._require(key)
            pages = self._read_pages(group)
            return pages.reshape(-1, spec.width)[: group.num_tokens].clone()

    def attach(self, seq: SequenceHandle, key: ContentKey) -> None:
        """Reference a stored group at the sequence's next position (no copy)."""
        self._open()
        spec = self._check_key(key, "kv")
        del spec
        with self._lock:
            self.lower.apply_completions()
            self._table(seq)
            if key.scope != tenant_scope(self._salt(seq.tenant)):
                raise ForeignKeyError(f"key {key!r} belongs to another tenant than sequence {seq.id}")
            self._promote(self._require(key))    # may let go of the lock while it waits
            table = self._table(seq)             # so the sequence and the group are looked up again
            group = self._require(key)
            shared = group.refs > 0 or group.hits > 0
            table.add(group, b"group:" + key.digest)
            group.refs += 1
            group.last_access = time.monotonic()
            self.policy.on_access(group)
            self.counters.add("attaches", key.modality)
            if shared:
                self.counters.add("shared_attaches", key.modality)

    def release(self, seq: SequenceHandle) -> None:
        """Drop the sequence's references; its private runs are freed, shared groups stay cached.
        Reservations of it that are not fully written (a step that failed part-way) end here:
        their runs are unpinned and freed with the rest, and writing to them is refused."""
        with self._lock:
            self.lower.apply_completions()
            table = self._table(seq)
            self._compiled.drop(seq.id)
            for res in table.open_runs:
                if res.open:
                    res.open = False
                    res.group.pins -= 1
            table.open_runs = []
            for seg in table.segments:
                group = seg.group
                group.refs -= 1
                if group.key is None:
                    if group.refs == 0:
                        self._free_group(group)      # its storage goes once no reader pins it
                elif group.refs == 0:
                    self.policy.on_release(group)
            del self._seqs[seq.id]

    def _insert_group(self, key: ContentKey, spec: ModalitySpec, n: int, pages: list[int]) -> ModalityGroup:
        group = ModalityGroup(next(self._gids), key, spec, n, pages=pages,
                              parent=self.lineage.parent_of(key, self._groups))
        self._groups[key] = group
        self.policy.on_insert(group)
        self.counters.add("puts", key.modality)
        self.counters.add("stored_tokens", key.modality, n)
        return group

    def _require(self, key: ContentKey) -> ModalityGroup:
        group = self._groups.get(key)
        if group is None:
            raise UnknownKeyError(f"{key!r} is not in the cache (put it first)")
        return group

    # ------------------------------------------------------------------ attention
    def attention(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                  groups: Iterable[ContentKey] | None = None, causal: bool = True,
                  scale: float | None = None, modalities: Iterable[str] | None = None) -> torch.Tensor:
        """Attention of ``q [n_q, num_q_heads, head_dim]`` over the sequence's pages.

        Queries are the last ``n_q`` positions; causal by absolute position; ``groups`` restricts
        the keys to those groups (cross-attention)."""
        out, _ = self.attention_state(seq, layer, q, groups=groups, causal=causal, scale=scale,
                                      modalities=modalities)
        return out

    def attention_state(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                        groups: Iterable[ContentKey] | None = None, causal: bool = True,
                        scale: float | None = None, q_positions: torch.Tensor | None = None,
                        modalities: Iterable[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``: the partial state that merges exactly with others (other tiers, nodes)."""
        self._check_q(q)
        with self._lock:
            self.lower.apply_completions()
            table = self._table(seq)
            segments = self._select(seq, table, groups)
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
                q_pos = self._positions(q_positions, n_q)
            plan = self._plan(segments, layer, q, seq_id=seq.id)
        return self._run(plan, q, q_pos, causal, scale)

    def attention_state_parts(self, parts: Sequence[tuple[SequenceHandle, Iterable[ContentKey] | None, int, int | None]],
                              layer: int, q: torch.Tensor, q_positions: torch.Tensor, *,
                              causal: bool = True, scale: float | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` over parts of local sequences that hold pieces of a bigger sequence
        (a pool's runs and proxies of a cluster sequence), all in one call: part ``(seq, keys,
        offset, start)`` adds the segments of ``seq`` (those of ``keys`` when given; only the one
        at local position ``start`` when given) at ``local position + offset``; ``q_positions``
        are positions of the bigger sequence. A segment named by two parts is refused."""
        self._check_q(q)
        with self._lock:
            self.lower.apply_completions()
            segments, seen = [], set()
            for seq, keys, offset, start in parts:
                for s in self._select(seq, self._table(seq), keys):
                    if start is not None and s.start != start:
                        continue
                    if (seq.id, s.start) in seen:
                        raise ShapeError(f"sequence {seq.id}: the segment at {s.start} is in two parts")
                    seen.add((seq.id, s.start))
                    segments.append(Segment(s.group, s.start + int(offset)))
            plan = self._plan(segments, layer, q)
        return self._run(plan, q, self._positions(q_positions, q.shape[0]), causal, scale)

    @staticmethod
    def _positions(q_positions, n_q: int) -> torch.Tensor:
        """Caller-given query positions as int32, left on their device (no copy back to the
        host: a CUDA tensor stays there)."""
        if not isinstance(q_positions, torch.Tensor) or q_positions.shape != (n_q,) \
                or q_positions.is_floating_point() or q_positions.is_complex():
            raise ShapeError(f"q_positions must be {n_q} integer positions, got "
                             f"{tuple(q_positions.shape) if isinstance(q_positions, torch.Tensor) else type(q_positions).__name__}")
        return q_positions if q_positions.dtype == torch.int32 else q_positions.to(torch.int32)

    def _check_q(self, q) -> None:
        self._open()
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ShapeError(f"q must be [n_q, num_q_heads, head_dim], got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise DTypeError(f"q dtype {q.dtype} is not float32, float16 or bfloat16")

    def _select(self, seq: SequenceHandle, table: SequenceTable, groups: Iterable[ContentKey] | None):
        """The segments of ``table``, or of those groups (verified, all attached)."""
        if groups is None:
            return table.segments
        wanted = set(groups)
        for key in wanted:
            self.keys.verify(key)
        missing = wanted - {s.group.key for s in table.segments}
        if missing:
            raise UnknownKeyError(f"groups not attached to sequence {seq.id}: {sorted(map(str, missing))}")
        return [s for s in table.segments if s.group.key in wanted]

    def _plan(self, segments: list[Segment], layer: int, q: torch.Tensor,
              seq_id: int | None = None) -> AttentionPlan:
        """Check the segments fit ``q`` and ``layer``, pin their groups and capture what the
        computation reads (lock held; ``_run`` computes it without the lock). With ``seq_id``
        (the segments are that sequence's), its device operands are reused while unchanged."""
        check_segments(segments, layer, q)
        for s in segments:
            s.group.pins += 1
            self.policy.on_access(s.group)
        device_segs = [s for s in segments if s.group.tier == Tier.DEVICE]
        host_segs = [s for s in segments if s.group.tier == Tier.HOST]
        disk_segs = [s for s in segments if s.group.tier == Tier.DISK]
        plan = AttentionPlan(segments, None, self.arena.device, disk_segments=disk_segs)
        try:
            plan.stream = self.lower.stream(disk_segs, layer)   # disk reads first:
            if device_segs or not segments:                                       # they overlap the rest
                if seq_id is None:
                    plan.device_ops = compile_segments(device_segs, layer, self._device_view)
                else:
                    plan.device_ops = self._compiled.operands(
                        seq_id, device_segs, layer, lambda segs, lay: compile_segments(segs, lay, self._device_view))
            if host_segs:
                plan.host_ops, plan.held = self.lower.plan_host(host_segs, layer)
        except BaseException:
            self._unpin(plan)
            raise
        return plan

    def _run(self, plan: AttentionPlan, q, q_pos, causal, scale) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute a plan without the lock, then unpin it under the lock."""
        try:
            return plan.run(q, q_pos, causal=causal, scale=scale, backend=self._backend())
        finally:
            with self._lock:
                self._unpin(plan)

    def _unpin(self, plan: AttentionPlan) -> None:
        """Release what a plan holds (lock held): pins, host entries, stream buffers; groups a
        stream found corrupt become misses; groups freed while pinned release their storage."""
        plan.close(self.lower.release_held)
        for g in plan.failed:
            self.counters.add("corrupt_reads", g.modality)
            self._forget_corrupt(g)
        for g in plan.groups:
            g.pins -= 1
        for g in dict.fromkeys(plan.groups):
            if g.pins == 0 and g.freed:
                self._settle(g)
        if plan.lower:
            self.counters.add("lower_tier_attentions")
        self.lower.apply_completions()

    def _device_view(self, group: ModalityGroup):
        pool = self.pools[group.modality]
        return (group.modality, pool.view, group.pages)

    def _backend(self) -> str:
        return self.cfg.attention_backend

    # ------------------------------------------------------------------ room and residency
    def _allocate(self, pool: PagePool, n: int, protect: list[ModalityGroup]) -> list[int]:
        """``n`` pages of ``pool`` (``Room.allocate``; may let go of the lock while it waits)."""
        return self.room.allocate(pool, n, protect)

    def _make_room(self, pool: PagePool, pages_needed: int, protect: list[ModalityGroup],
                   referenced: bool = True, deadline: float | None = None) -> None:
        self.room.make_room(pool, pages_needed, protect, referenced=referenced, deadline=deadline)

    def _live_groups(self) -> list[ModalityGroup]:
        """Every indexed group and every group a sequence holds (a group may appear twice)."""
        return list(self._groups.values()) + [s.group for t in self._seqs.values() for s in t.segments]

    def _drop(self, group: ModalityGroup) -> None:
        self.counters.add("evictions", group.modality)
        self._free_group(group)

    def _free_group(self, group: ModalityGroup) -> None:
        """The group leaves the cache now; its pages and copies go once no reader pins it."""
        if group.key is not None and self._groups.get(group.key) is group:
            del self._groups[group.key]
        if group.freed:
            return
        group.freed = True
        self.policy.on_remove(group)
        self._settle(group)

    def _settle(self, group: ModalityGroup) -> None:
        """Release the storage of a freed group once nothing pins it (lock held; called once:
        at the free, or at the unpin that dropped the last pin)."""
        if not group.freed or group.pins > 0:
            return
        if group.tier == Tier.DEVICE and group.pages:
            self.pools[group.modality].free(group.pages)
            group.pages = []
        if self.lower.enabled:
            self.lower.forget(group)

    # ------------------------------------------------------------------ GroupOwner (for residency)
    def drop(self, group: ModalityGroup) -> None:
        self._drop(group)

    def forget_corrupt(self, group: ModalityGroup) -> None:
        self._forget_corrupt(group)

    def wait(self, fut: Future) -> object:
        try:
            with self._lock.unlocked():
                return fut.result(timeout=WAIT_S)
        finally:
            self.lower.apply_completions()

    # ------------------------------------------------------------------ leases and export
    def lease(self, key: ContentKey, ttl: float = 30.0) -> Lease:
        """Protect a group from eviction for ``ttl`` seconds (a read or transfer in progress)."""
        self._check_key(key)
        with self._lock:
            return self.leases.grant(self._require(key), ttl)

    def release_lease(self, lease: Lease) -> None:
        with self._lock:
            self.leases.release(lease)

    def read_group(self, key: ContentKey, *, lease: Lease | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of a stored group's ``(k, v)`` ``[num_layers, n, num_kv_heads, head_dim]`` on
        the CPU, from whichever tier holds it (export, transfer to another node). With a
        ``lease``, the copy is returned only if the lease was still live when it finished
        (``LeaseExpiredError`` otherwise): memory reused meanwhile is never returned."""
        spec = self._check_key(key, "kv")
        with self._lock:
            self._open()
            self.lower.apply_completions()
            group = self._require(key)
            if lease is not None:
                self.leases.check(lease)
            pages = self._read_pages(group).cpu()      # a disk read lets go of the lock
            if lease is not None:
                self.leases.check(lease)
            group.hits += 1
            self.policy.on_access(group)
            self.counters.add("exports", key.modality)
        n = group.num_tokens
        flat = pages.permute(1, 2, 0, 3, 4, 5).reshape(spec.num_layers, 2, -1, spec.num_kv_heads, spec.head_dim)
        return flat[:, 0, :n].contiguous(), flat[:, 1, :n].contiguous()

    def inventory(self) -> list[tuple[ContentKey, str, int]]:
        """Every stored shared group: ``(key, tier name, bytes)`` (registries rebuild from it)."""
        with self._lock:
            self.lower.apply_completions()
            return [(g.key, g.tier.name.lower(), g.nbytes) for g in self._groups.values()]

    def holds(self, keys: Iterable[ContentKey]) -> list[bool]:
        """Whether each key is stored in some tier, counting no hit or miss (a transfer's check,
        not a use)."""
        with self._lock:
            self.lower.apply_completions()
            return [k in self._groups for k in keys]

    def _forget_corrupt(self, group: ModalityGroup) -> None:
        """A stored copy failed verification: the group is a miss from now on."""
        if group.key is not None and self._groups.get(group.key) is group:
            del self._groups[group.key]
        self.policy.on_remove(group)
        group.location = None

    def flush(self) -> None:
        """Wait for the copies in flight (background spills, prefetches) and apply them; the
        wait is outside the lock, bounded in time."""
        if not self.lower.enabled:
            return
        with self._lock:
            pending = self.lower.pending()
        if pending:
            concurrent.futures.wait(pending, timeout=WAIT_S)
        with self._lock:
            self.lower.apply_completions()

    def prefetch(self, key: ContentKey) -> bool:
        """Start bringing a disk-resident group up to host memory; ``True`` if a copy started."""
        self._check_key(key)
        with self._lock:
            self.lower.apply_completions()
            group = self._require(key)
            return self.lower.prefetch(group) is not None

    def _promote(self, group: ModalityGroup) -> bool:
        """Bring a lower-tier group to the device when room can be made without demoting
        referenced groups; ``False`` when it stays below (attention serves it there). A group
        that a reader pins or a copy is in flight for stays where it is. The device pages are
        taken first, then a disk copy is read with the lock let go (the group pinned), so the
        caller looks the group up again afterwards."""
        if group.tier == Tier.DEVICE:
            return True
        if not self.lower.enabled or group.pins or group.busy or group.freed:
            return False
        pool = self.pools[group.modality]
        need = group.num_pages
        if need > pool.num_free:
            group.pins += 1        # making room below must never choose the group itself
            try:
                self._make_room(pool, need - pool.num_free, [group], referenced=False)
            except CapacityError:
                return False
            finally:
                group.pins -= 1
                self._settle(group)
            if need > pool.num_free or group.pins or group.busy or group.freed or group.tier == Tier.DEVICE:
                return False
        pages = pool.allocate(need)
        src = None
        try:
            if group.tier == Tier.DISK:
                src = self._read_pinned(group)
                if group.pins or group.busy or group.freed or group.tier != Tier.DISK:
                    raise _Moved()         # changed while it was read: it stays where it is now
        except (_Moved, CorruptDataError):
            pool.free(pages)
            return False
        except BaseException:
            pool.free(pages)
            raise
        self.lower.promote_into(group, pool, pages, src)
        return True

    def _read_pages(self, group: ModalityGroup) -> torch.Tensor:
        """A copy of the group's pages ``[n, *page_shape]`` from whichever tier holds it (a
        disk read lets go of the lock)."""
        if group.tier == Tier.DEVICE:
            pool = self.pools[group.modality]
            return pool.view[torch.tensor(group.pages, device=pool.device)]
        if group.tier == Tier.HOST:
            return group.location.gather()
        return self._read_pinned(group)

    def _read_pinned(self, group: ModalityGroup) -> torch.Tensor:
        """The disk group's verified pages, read with the lock let go and the group pinned
        (so nothing removes its file meanwhile); ``CorruptDataError`` (the group dropped) when
        the copy is missing or fails verification."""
        group.pins += 1
        try:
            pages = self.wait(self.lower.read_disk_async(group))
        finally:
            group.pins -= 1
            self._settle(group)
        if pages is None:
            self.counters.add("corrupt_reads", group.modality)
            self._forget_corrupt(group)
            raise CorruptDataError(f"{group!r}: stored copy missing or failed verification (a miss)")
        return pages

    # ------------------------------------------------------------------ I/O helpers
    def _check_kv(self, spec: ModalitySpec, k, v) -> int:
        return check_kv(spec, k, v)

    def _check_dtype(self, spec: ModalitySpec, t: torch.Tensor) -> None:
        check_payload(spec, t)

    def _write_fresh(self, pool: PagePool, k, v, pages: list[int]) -> None:
        write_fresh_pages(pool, k, v, pages, self._backend())

    def _write(self, pool: PagePool, k, v, page_ids: torch.Tensor, offsets: torch.Tensor) -> None:
        write_slots(pool, k, v, page_ids, offsets, self._backend())

    # ------------------------------------------------------------------ stats and life cycle
    def stats(self) -> CacheStats:
        with self._lock:
            self.lower.apply_completions()
            device: dict[str, TierUsage] = {}
            for name, pool in self.pools.items():
                device[name] = TierUsage(0, pool.num_used, pool.num_used * pool.spec.page_bytes,
                                         pool.num_pages * pool.spec.page_bytes)
            seen: set[int] = set()
            groups = self._live_groups()
            for g in groups:
                if g.gid in seen or g.tier != Tier.DEVICE:
                    continue
                seen.add(g.gid)
                device[g.modality].groups += 1
            counters, by_modality = self.counters.snapshot()
            counters.update(self.lower.storage_counters())
            return CacheStats(tiers={"device": device, **self._lower_stats()}, counters=counters,
                              by_modality=by_modality, sequences=len(self._seqs))

    def _lower_stats(self) -> dict[str, dict[str, TierUsage]]:
        if not self.lower.enabled:
            return {}
        return self.lower.stats(self._live_groups())

    def _open(self) -> None:
        if self._closed:
            raise ClosedError("the cache is closed")

    def close(self) -> None:
        """Wait for in-flight copies, then close the lower tiers (files stay for a restart)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.lower.close()

    def __enter__(self) -> TieredKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Moved(Exception):
    """A group changed tier while the lock was let go (internal to ``_promote``)."""
