"""The eviction mechanism every policy shares (policy only: no pages, no copies).

A policy sees ``on_insert / on_access / on_release / on_move / on_remove`` and answers
``victims(tier, bytes_needed, modality=None)``: evictable groups in that tier (optionally of one
modality's pool), in eviction order, until their bytes cover ``bytes_needed`` (fewer when not
enough can go; the caller decides what that means). A new policy is one class plus one line in
``POLICIES``.

Mechanism shared by every policy: each group has an entry (``PolicyEntry``) with a static *key*
computed whenever it is touched (insert, access, release); groups sit in one min-heap per
``(tier, modality, lane)`` ordered by key, with stale entries skipped lazily and heaps rebuilt
when stale entries pile up. A *lane* is a policy's queue (one for most; S3-FIFO's small and main
queues, ARC's recent and frequent lists: ``_new_lane`` places a new group, ``_refile`` moves
one). Within one lane the eviction order is the key order; across modalities and lanes
``victims`` merges the heaps' heads by ``_rank(key, modality, lane)``, which a policy may make
depend on the current time or state as long as it is increasing in the key for a fixed modality
and lane. A group that reaches the head of its lane evictable is offered to ``_second_chance``
first: a CLOCK-style policy may re-file it (to another lane, or back with a new key) instead of
handing it out, and does so at most a bounded number of times per touch. So ``victims`` costs
O((k + s + r) log n) for k victims, s skipped (pinned, leased, busy) groups and r second
chances, not O(n).

Evictable means: no sequence reference (``refs``), no pin, no copy in flight (``busy``), no
live lease, judged with the policy's clock (inject the same clock as the ``LeaseTable``), and
no cached child at this tier or above. Leaf-first: a prefix-dependent group (``group.parent``
set by the cache from its key's chain) is useless without its parent, so a policy never
evicts a parent from a tier while a child of it sits in that tier or a faster one (as radix-
tree caches evict leaves only). Every policy gets this from the mechanism: each entry counts
its children per tier; a parent held back only by children that ``victims`` itself chose in
the same call joins the candidates at its own rank, so one call can free a whole cold chain.
Children of another modality sit in another pool, which a pool's ``victims`` call never scans:
a parent held only by such children, all evictable, is handed out as a bundle (its subtree,
leaves first, then the parent; only bytes of the asked modality count toward the need).

Tier changes: the cache should call ``on_move(group, old_tier)`` after moving a group; a policy
also notices a group whose tier changed without the hook (it re-files groups it handed out as
victims, or accessed in a lower tier, at the next ``victims`` call, and any misplaced group
it meets while scanning), so a missing hook costs order quality, never correctness.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..config import CacheConfig
from ..core.groups import ModalityGroup, Tier
from .lanes import LaneBytes

Clock = Callable[[], float]
MAX_BUNDLE = 64                              # descendants evicted with a parent in one bundle
_HeapItem = tuple[float, int, int]          # (key, seq, gid)
_HeapKey = tuple[Tier, str, int]            # (tier, modality, lane)


@dataclass
class PolicyEntry:
    """What the mechanism keeps per group; a policy's hooks (``_key``, ``_second_chance``,
    ``_left``) get it. The group, its key at the latest touch, its touches (``freq``) and its
    lane (a policy may set ``lane``, or re-file with ``_refile``); the live heap item (``seq``,
    ``tier``, ``parked``) and the prefix-chain links (``parent``, ``kids``, ``children``) are
    the mechanism's."""

    group: ModalityGroup
    key: float = 0.0
    seq: int = -1                            # seq of this group's live heap item
    tier: Tier = Tier.DEVICE                 # the heap (tier) that live item sits in
    freq: int = 0                            # insert + accesses
    parent: int | None = None                # gid of the parent group (prefix chains)
    kids: list[int] = field(default_factory=lambda: [0] * len(Tier))   # children per tier
    children: set[int] = field(default_factory=set)                    # their gids
    parked: bool = False                     # out of its heap while a same-pool child holds it
    lane: int = 0                            # the policy's queue within (tier, modality)

    def kids_at_or_above(self, tier: Tier) -> int:
        """Children in ``tier`` or a faster one: they need this group to stay."""
        return sum(self.kids[: tier + 1])


class EvictionPolicy:
    """Base: heap-per-(tier, modality) mechanism. Subclasses define ``_key`` (and ``_rank``)."""

    name = "base"
    lanes = 1                                 # queues per (tier, modality); > 1: bytes counted per lane

    def __init__(self, cfg: CacheConfig, clock: Clock | None = None):
        self.cfg = cfg
        self.clock: Clock = clock or time.monotonic
        self.tick = 0                         # logical clock: one per insert / access / release
        self._entries: dict[int, PolicyEntry] = {}
        self._heaps: dict[_HeapKey, list[_HeapItem]] = {}
        self._seq = itertools.count()
        self._items = 0                       # heap items, live and stale
        self._watch: set[int] = set()         # gids whose tier may have changed without on_move
        self._scanning = False                # no heap rebuild while victims() holds popped items
        self.lane_bytes = LaneBytes()         # bytes per (tier, modality, lane), when lanes > 1

    # ------------------------------------------------------------------ hooks
    def on_insert(self, group: ModalityGroup) -> None:
        """A new group exists (in ``group.tier``)."""
        self.tick += 1
        entry = PolicyEntry(group, freq=1, tier=group.tier, lane=self._new_lane(group))
        parent = group.parent
        if parent is not None and parent.gid in self._entries and parent.gid != group.gid:
            entry.parent = parent.gid
            self._entries[parent.gid].kids[entry.tier] += 1
            self._entries[parent.gid].children.add(group.gid)
        self._entries[group.gid] = entry
        self._file(entry, self._key(entry))

    def on_access(self, group: ModalityGroup) -> None:
        """A hit, attach or attention over the group."""
        entry = self._entries.get(group.gid)
        if entry is None:
            self.on_insert(group)
            return
        self.tick += 1
        entry.freq += 1
        self._file(entry, self._key(entry))
        if group.tier != Tier.DEVICE:
            self._watch.add(group.gid)        # likely promoted next

    def on_release(self, group: ModalityGroup) -> None:
        """The last reference went away: the group became a candidate; its last use is now."""
        entry = self._entries.get(group.gid)
        if entry is None:
            return
        self.tick += 1
        self._file(entry, self._key(entry))

    def on_move(self, group: ModalityGroup, old_tier: Tier) -> None:
        """The cache moved the group from ``old_tier`` to ``group.tier`` (demotion, promotion)."""
        entry = self._entries.get(group.gid)
        if entry is not None:
            self._resync(entry)

    def on_remove(self, group: ModalityGroup) -> None:
        """The group was freed (dropped at the bottom, or deleted)."""
        entry = self._entries.pop(group.gid, None)
        self.lane_bytes.drop(group.gid)
        if entry is not None:
            self._left(entry.tier, entry)
            self._count_kid(entry, entry.tier, None)
            parent = self._entries.get(entry.parent) if entry.parent is not None else None
            if parent is not None:
                parent.children.discard(group.gid)
        self._watch.discard(group.gid)

    # ------------------------------------------------------------------ queries
    def victims(self, tier: Tier, bytes_needed: int, modality: str | None = None) -> list[ModalityGroup]:
        out: list[ModalityGroup] = []
        if bytes_needed <= 0:
            return out
        self._flush_watch()
        self._plan(tier)
        self._scanning = True
        held: list[tuple[_HeapKey, _HeapItem]] = []
        try:
            now = self.clock()
            if self.lanes > 1:                  # a group may change lanes while scanned
                for m in [m for (t, m, lane) in self._heaps if t == tier and lane == 0]:
                    for lane in range(1, self.lanes):
                        self._heaps.setdefault((tier, m, lane), [])
            hkeys = [h for h in self._heaps if h[0] == tier and modality in (None, h[1])]
            blocked: dict[int, PolicyEntry] = {}     # evictable but for children, by gid
            taken: dict[int, int] = {}          # parent gid -> children chosen in this call
            scans = [self._scan(h, now, held, blocked, taken) for h in hkeys]
            merge: list[tuple[float, int, int, list[ModalityGroup]]] = []
            for i, scan in enumerate(scans):
                self._advance(merge, scans, i, scan)
            got = 0
            chosen: set[int] = set()
            while merge and got < bytes_needed:
                _, _, i, bundle = heapq.heappop(merge)
                if i >= 0:
                    self._advance(merge, scans, i, scans[i])
                for group in bundle:
                    if group.gid in chosen:
                        continue
                    chosen.add(group.gid)
                    out.append(group)
                    if modality is None or group.modality == modality:
                        got += group.nbytes
                    self._unblock(self._entries[group.gid].parent, tier, modality, now, taken,
                                  blocked, merge)
        finally:
            for hkey, item in held:
                heapq.heappush(self._heaps.setdefault(hkey, []), item)
            self._scanning = False
        self._watch.update(g.gid for g in out)
        return out

    def order(self, tier: Tier, modality: str | None = None) -> list[ModalityGroup]:
        """Every evictable group of the tier in eviction order (for tests and reports)."""
        return self.victims(tier, 1 << 62, modality)

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ policy hooks
    def _key(self, entry: PolicyEntry) -> float:
        """Static key of a group at its latest touch: smaller goes first."""
        raise NotImplementedError

    def _rank(self, key: float, modality: str, lane: int = 0) -> float:
        """Merge rank across modalities (and a policy's lanes) at this moment; must increase
        with ``key`` for a fixed modality and lane."""
        return key

    def _plan(self, tier: Tier) -> None:
        """A ``victims`` call on ``tier`` starts: fix what ``_rank`` needs for it."""

    def _new_lane(self, group: ModalityGroup) -> int:
        """The lane a new group starts in (policies with one queue: 0)."""
        return 0

    def _second_chance(self, entry: PolicyEntry) -> bool:
        """An evictable group reached the head of its lane: ``True`` when the policy re-files
        it instead (moved to another lane or back to the tail, by ``_refile``), as CLOCK-style
        policies do at eviction time. Must not return ``True`` forever for the same group."""
        return False

    def _refile(self, entry: PolicyEntry, key: float, lane: int) -> None:
        """Put ``entry`` in ``lane`` with ``key`` (its old heap item becomes stale)."""
        entry.lane = lane
        self._file(entry, key)

    def _left(self, tier: Tier, entry: PolicyEntry) -> None:
        """The group left ``tier`` (demoted or dropped)."""

    # ------------------------------------------------------------------ mechanism
    def _evictable(self, group: ModalityGroup, now: float) -> bool:
        return group.refs == 0 and group.pins == 0 and group.busy == 0 and group.live_leases(now) == 0

    def _count_kid(self, entry: PolicyEntry, old: Tier | None, new: Tier | None) -> None:
        """Keep the parent's per-tier child counts in step with ``entry``'s tier."""
        parent = self._entries.get(entry.parent) if entry.parent is not None else None
        if parent is None or old == new:
            return
        if old is not None:
            parent.kids[old] -= 1
        if new is not None:
            parent.kids[new] += 1
        if parent.parked and old is not None:
            self._file(parent, parent.key)      # a child left: scan the parent again

    def _unblock(self, gid: int | None, tier: Tier, modality: str | None, now: float,
                 taken: dict[int, int], blocked: dict[int, PolicyEntry], merge: list) -> None:
        """A child of ``gid`` was chosen: if that frees its held-back parent (scanned in this
        call, or parked by an earlier one), the parent becomes a candidate at its own rank."""
        if gid is None:
            return
        taken[gid] = taken.get(gid, 0) + 1
        entry = blocked.get(gid)
        if entry is None:
            parked = self._entries.get(gid)
            if (parked is not None and parked.parked and parked.tier == tier
                    and parked.group.tier == tier
                    and modality in (None, parked.group.modality)
                    and self._evictable(parked.group, now)):
                entry = blocked[gid] = parked
        if entry is not None and entry.kids_at_or_above(tier) <= taken[gid]:
            del blocked[gid]
            if self._second_chance(entry):
                return                          # re-filed by the policy: not a victim now
            heapq.heappush(merge, (self._rank(entry.key, entry.group.modality, entry.lane),
                                   entry.seq, -1, [entry.group]))

    def _file(self, entry: PolicyEntry, key: float) -> None:
        entry.parked = False
        entry.key = key
        entry.seq = next(self._seq)
        self._count_kid(entry, entry.tier, entry.group.tier)
        entry.tier = entry.group.tier
        heapq.heappush(self._heaps.setdefault((entry.tier, entry.group.modality, entry.lane), []),
                       (key, entry.seq, entry.group.gid))
        if self.lanes > 1:
            self.lane_bytes.place(entry.group.gid, (entry.tier, entry.group.modality, entry.lane),
                                  entry.group.nbytes)
        self._items += 1
        if self._items > 4 * len(self._entries) + 1024 and not self._scanning:
            self._rebuild()

    def _resync(self, entry: PolicyEntry) -> None:
        if entry.group.tier != entry.tier:
            old = entry.tier
            self._file(entry, entry.key)
            self._left(old, entry)

    def _flush_watch(self) -> None:
        for gid in self._watch:
            entry = self._entries.get(gid)
            if entry is not None:
                self._resync(entry)
        self._watch.clear()

    def _rebuild(self) -> None:
        self._heaps = {}
        for entry in self._entries.values():
            if entry.tier != entry.group.tier:
                self._left(entry.tier, entry)
                self._count_kid(entry, entry.tier, entry.group.tier)
                entry.tier = entry.group.tier
            self._heaps.setdefault((entry.tier, entry.group.modality, entry.lane), []).append(
                (entry.key, entry.seq, entry.group.gid))
            if self.lanes > 1:
                self.lane_bytes.place(entry.group.gid, (entry.tier, entry.group.modality, entry.lane),
                                      entry.group.nbytes)
        for heap in self._heaps.values():
            heapq.heapify(heap)
        self._items = len(self._entries)

    def _scan(self, hkey: _HeapKey, now: float, held: list[tuple[_HeapKey, _HeapItem]],
              blocked: dict[int, PolicyEntry], taken: dict[int, int]) -> Iterator[list[ModalityGroup]]:
        """Evictable groups of one heap in key order, each as a bundle: the group alone, or,
        when only cached children of other modalities (other pools, which this scan never
        reaches) hold it back and they can all go, its subtree leaves first, then the group.
        Popped items are kept in ``held``; groups held back by children go to ``blocked`` (and,
        when a child in the same pool holds them, are parked out of the heap)."""
        tier = hkey[0]
        heap = self._heaps.get(hkey, [])
        while heap:
            item = heapq.heappop(heap)
            entry = self._entries.get(item[2])
            if entry is None or entry.seq != item[1]:
                self._items -= 1              # stale: dropped for good
                continue
            if entry.group.tier != tier:      # moved without on_move: re-file it, never hand it out
                self._items -= 1
                self._resync(entry)
                continue
            if not self._evictable(entry.group, now):
                held.append((hkey, item))
                continue
            if entry.kids_at_or_above(tier) <= taken.get(entry.group.gid, 0):
                if self._second_chance(entry):
                    self._items -= 1          # re-filed: this item is stale now
                    continue
                held.append((hkey, item))
                yield [entry.group]
                continue
            blocked[entry.group.gid] = entry
            if self._same_pool_child(entry, tier):
                # park it: out of the heap until a child leaves (``_count_kid`` re-files it),
                # so long chains are not rescanned parent by parent at every call
                entry.parked = True
                self._items -= 1
                continue
            held.append((hkey, item))
            sub = self._subtree(entry, tier, now)
            if sub is not None:
                del blocked[entry.group.gid]
                yield sub

    def _same_pool_child(self, entry: PolicyEntry, tier: Tier) -> bool:
        for gid in entry.children:
            c = self._entries.get(gid)
            if c is not None and c.tier <= tier and c.group.modality == entry.group.modality:
                return True
        return False

    def _subtree(self, entry: PolicyEntry, tier: Tier, now: float) -> list[ModalityGroup] | None:
        """``entry``'s group after every cached descendant that holds it in ``tier`` (post-order:
        leaves first), when the children holding it are all of other modalities and the whole
        subtree can go; else ``None`` (children of its own modality come up in this scan)."""
        out: list[ModalityGroup] = []

        def visit(e: PolicyEntry) -> bool:
            for gid in e.children:
                c = self._entries.get(gid)
                if c is None or c.tier > tier:
                    continue                      # slower tiers never hold a parent back
                if (c.tier != tier or len(out) >= MAX_BUNDLE
                        or (e is entry and c.group.modality == entry.group.modality)
                        or not self._evictable(c.group, now) or not visit(c)):
                    return False
                out.append(c.group)
            return True

        if not visit(entry):
            return None
        out.append(entry.group)
        return out

    def _advance(self, merge: list, scans: list, i: int, scan: Iterator[list[ModalityGroup]]) -> None:
        bundle = next(scan, None)
        if bundle is not None:
            entry = self._entries[bundle[-1].gid]
            heapq.heappush(merge, (self._rank(entry.key, entry.group.modality, entry.lane), entry.seq, i,
                                   bundle))
