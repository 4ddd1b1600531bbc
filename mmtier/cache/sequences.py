"""``Sequences``: the sequences of a ``TieredKVCache`` and their tables: creation, lookup,
``append`` with the growth of a sequence's tail run (pages planned, written, then recorded),
``attach`` (a shared group referenced at the next position: its refcount) and ``release``.
Its own state: the tables by sequence id and the ids; the keys, group index and residency are
given to it, the lock is residency's; it registers itself with residency (``held_by``), which asks
it for the groups its sequences hold and how many there are.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import CacheConfig, ModalitySpec
from ..content import ContentKey, tenant_scope
from ..core.groups import ModalityGroup, Tier
from ..core.segments import SequenceHandle, SequenceTable, naming
from ..errors import ForeignKeyError, ShapeError, UnknownKeyError, UnknownModalityError
from ..eviction import EvictionPolicy
from ..pages.payload import check_kv, slot_mapping, token_identity, write_slots
from ..pages.pool import PagePool
from ..stats import Counters
from ..tiers.residency import Residency
from ..tiers.room import ROOM_WAIT_S
from .group_index import GroupIndex
from .keys import DEFAULT_TENANT, CacheKeys


@dataclass(eq=False)
class Growth:
    """Pages allocated for ``n`` tokens at a sequence's end, not yet recorded (``Sequences.grow``)."""

    table: SequenceTable
    group: ModalityGroup | None         # the tail run they extend; None: a new run
    pool: PagePool
    pages: list[int]                    # the new pages
    n: int
    page_ids: torch.Tensor              # int32 slot mapping of the n tokens (host)
    offsets: torch.Tensor


class PerSequence(Protocol):
    """What keeps something per sequence id (compiled operands, step plans): dropped at release."""

    def drop(self, seq_id: int) -> None: ...


class Sequences:
    """Sequences, their tables and private runs (see the module's docstring)."""

    def __init__(self, cfg: CacheConfig, keyer: CacheKeys, index: GroupIndex,
                 residency: Residency, policy: EvictionPolicy, counters: Counters):
        self.cfg, self.keyer, self.index, self.residency = cfg, keyer, index, residency
        self.lock = residency.lock               # residency's: it owns the cache's lock
        self.policy, self.counters = policy, counters
        self.tables: dict[int, SequenceTable] = {}
        self._ids = itertools.count(1)
        residency.held_by(self)                  # room making chooses among the groups held here

    def create(self, tenant: str | None = None) -> SequenceHandle:
        self.residency.check_open()
        self.keyer.salt(tenant)
        with self.lock:
            handle = SequenceHandle(next(self._ids), DEFAULT_TENANT if tenant is None else tenant)
            self.tables[handle.id] = SequenceTable(handle)
            return handle

    def table(self, seq: SequenceHandle) -> SequenceTable:
        """``seq``'s table (lock held); ``UnknownKeyError`` for a released or foreign handle."""
        if not isinstance(seq, SequenceHandle):
            raise UnknownKeyError(f"expected a SequenceHandle, got {type(seq).__name__}")
        table = self.tables.get(seq.id)
        if table is None or table.handle != seq:
            raise UnknownKeyError(f"unknown sequence {seq.id} (released or never created)")
        return table

    def sequence(self, seq: SequenceHandle) -> SequenceTable:
        with self.lock:
            return self.table(seq)

    def __len__(self) -> int:
        return len(self.tables)

    def held_groups(self) -> list[ModalityGroup]:
        """Every group a sequence holds, once per reference (lock held)."""
        return [s.group for t in self.tables.values() for s in t.segments]

    def prefix_key(self, seq: SequenceHandle) -> ContentKey:
        with self.lock:
            return self.keyer.prefix_key(seq, self.table(seq))

    def append(self, seq: SequenceHandle, modality: str, k: torch.Tensor, v: torch.Tensor,
               *, tokens: Sequence[int] | None = None, new_run: bool = False) -> None:
        self.residency.check_open()
        spec = self.cfg.spec(modality)
        if spec.kind != "kv":
            raise UnknownModalityError(f"modality {modality!r} holds embeddings; use put_embedding")
        n = check_kv(spec, k, v)
        if tokens is not None and len(tokens) != n:
            raise ShapeError(f"{len(tokens)} token ids for {n} tokens")
        identity = token_identity(modality, k, v, tokens)
        with self.lock:
            self.residency.apply_copies()
            growth = self.grow(self.table(seq), modality, spec, n, new_run)
            try:
                write_slots(growth.pool, k, v, growth.page_ids, growth.offsets, self.cfg.attention_backend)
            except BaseException:
                growth.pool.free(growth.pages)
                raise
            self.commit_growth(growth, identity)

    def grow(self, table: SequenceTable, modality: str, spec: ModalitySpec, n: int,
             new_run: bool = False) -> Growth:
        """Pages for ``n`` more tokens at the end of ``table``'s sequence: the device tail run
        extended (unless ``new_run``, or another thread is moving it down: its staged copy would
        miss the new tokens), or a new run. Nothing is recorded until ``commit_growth``: a write
        that fails in between gives the new pages back and leaves the sequence as it was (lock
        held; making room may let go of it, so the plan is made again after each wait)."""
        pool = self.residency.pools[modality]
        seq = table.handle
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            table = self.table(seq)
            tail = table.tail
            extend = not new_run and tail is not None and tail.group.key is None \
                and tail.group.modality == modality and tail.group.tier == Tier.DEVICE \
                and tail.group.busy == 0
            have = tail.group.num_tokens if extend else 0
            slack = (spec.pages_for(have) * spec.page_size - have) if extend else 0
            new_pages = spec.pages_for(max(0, n - slack))
            if new_pages <= pool.num_free:
                break
            self.residency.make_room(pool, new_pages - pool.num_free, [tail.group] if extend else [],
                                     deadline=deadline)
        pages = pool.allocate(new_pages)
        all_pages = (tail.group.pages + pages) if extend else pages
        page_ids, offsets = slot_mapping(all_pages, have, n, spec.page_size)
        return Growth(table, tail.group if extend else None, pool, pages, n, page_ids, offsets)

    def commit_growth(self, g: Growth, identity: bytes) -> ModalityGroup:
        """Record a growth whose tokens are (or will be) written: the run and the prefix chain."""
        if g.group is not None:
            group = g.group
            group.pages = group.pages + g.pages
            group.num_tokens += g.n
            g.table.grow(identity)
        else:
            group = ModalityGroup(self.index.new_gid(), None, g.pool.spec, g.n, pages=g.pages, refs=1)
            g.table.add(group, identity)
            self.policy.on_insert(group)
        self.counters.add("appended_tokens", group.modality, g.n)
        return group

    def attach(self, seq: SequenceHandle, key: ContentKey, *, placed: bool = False) -> None:
        """``attach``; ``placed``: the caller checked the key's place in a sequence of which
        ``seq`` holds only some parts (a cluster sequence's sub-sequence or proxy on a pool)."""
        self.residency.check_open()
        self.keyer.check_key(key, "kv")
        with self.lock:
            self.residency.apply_copies()
            table = self.table(seq)
            if key.scope != tenant_scope(self.keyer.salt(seq.tenant)):
                raise ForeignKeyError(f"key {key!r} belongs to another tenant than sequence {seq.id}")
            if not placed:
                self.keyer.check_place(seq, table, key, table.chain)
            self.residency.promote(self.index.require(key))    # may let go of the lock while it waits
            table = self.table(seq)              # so the sequence and the group are looked up again
            group = self.index.require(key)
            if not placed:
                self.keyer.check_place(seq, table, key, table.chain)
            shared = group.refs > 0 or group.hits > 0
            table.add(group, b"group:" + key.digest, naming(key, table.chain))
            group.refs += 1
            group.last_access = time.monotonic()
            self.policy.on_access(group)
            self.counters.add("attaches", key.modality)
            if shared:
                self.counters.add("shared_attaches", key.modality)

    def check_attach(self, seq: SequenceHandle, key: ContentKey) -> None:
        """``attach``'s checks (the key is this cache's kv key, of the sequence's tenant, derived
        where the sequence's chain stands), with nothing attached."""
        self.keyer.check_key(key, "kv")
        if key.scope != tenant_scope(self.keyer.salt(seq.tenant)):
            raise ForeignKeyError(f"key {key!r} belongs to another tenant than sequence {seq.id}")
        with self.lock:
            table = self.table(seq)
            self.keyer.check_place(seq, table, key, table.chain)

    def chain_elsewhere(self, seq: SequenceHandle, key: ContentKey) -> None:
        """Extend the sequence's chain by ``key``'s group as an attach would, the group itself
        attended where it lives (another node): later keys derive as after a local attach."""
        with self.lock:
            table = self.table(seq)
            table.extend_chain(b"group:" + key.digest, naming(key, table.chain))

    def release(self, seq: SequenceHandle, per_sequence: Iterable[PerSequence] = ()) -> None:
        """Drop ``seq``'s references (and what ``per_sequence`` keeps for it): private runs are
        freed, shared groups stay; its open reservations end (unpinned, freed with the rest)."""
        with self.lock:
            self.residency.apply_copies()
            table = self.table(seq)
            for kept in per_sequence:
                kept.drop(seq.id)
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
                        self.residency.free_group(group)   # its storage goes once no reader pins it
                elif group.refs == 0:
                    self.policy.on_release(group)
            del self.tables[seq.id]
