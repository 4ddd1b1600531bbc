"""``Residency``: where a ``TieredKVCache``'s groups live and how they move: the lower tiers
(``LowerTiers``), room making (``Room``), freeing and forgetting groups, what the lower tiers call
back (``GroupOwner``: it is the owner), leases, export (``read_group``), inventory, ``flush``,
``prefetch``, promotion to the device and verified host and disk reads (each tier's half in
``places``, dispatched by the group's tier), stats and the life cycle.
Its own state: the cache's lock (``OwnerLock``: it creates it; the cache's facade and parts take
it from here, ``Residency.lock``), the lower tiers, the room maker, the leases and whether the
cache is closed; the pools and the group index are given to it. It sits in ``tiers/`` beside
``LowerTiers``, so the ``GroupOwner`` calls between them stay inside this package; it checks keys
with ``core.key_checks`` and knows the cache's group index and sequences only through
``GroupDirectory`` (given at construction) and ``SequenceHolder`` (the sequences part registers
itself, ``held_by``), so nothing calls back up into the facade.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from ..config import CacheConfig, ModalitySpec
from ..content import ContentKey, KeyMaker
from ..core.groups import ModalityGroup, Tier
from ..core.key_checks import spec_of_key
from ..core.locking import OwnerLock
from ..errors import CapacityError, ClosedError, CorruptDataError, ShapeError
from ..eviction import EvictionPolicy
from ..pages.copies import check_out_kv, pages_into_kv
from ..pages.pool import PagePool
from ..stats import CacheStats, Counters, TierUsage
from ..storage import HostTier
from ..storage.host_slabs import HostEntry
from .leases import Lease, LeaseTable
from .lower import WAIT_S, LowerTiers
from .placement import PutPlacement
from .room import Room


class GroupDirectory(Protocol):
    """The cache's group index, as residency uses it (``cache.group_index.GroupIndex`` has it)."""

    groups: dict[ContentKey, ModalityGroup]

    def new_gid(self) -> int: ...

    def __contains__(self, key: ContentKey) -> bool: ...

    def __iter__(self) -> Iterator[ModalityGroup]: ...

    def require(self, key: ContentKey) -> ModalityGroup: ...

    def adopt(self, groups: Iterable[ModalityGroup]) -> None: ...

    def insert(self, key: ContentKey, spec: ModalitySpec, n: int, pages: list[int], *,
               tier: Tier = Tier.DEVICE, location: object = None) -> ModalityGroup: ...

    def unindex(self, group: ModalityGroup) -> None: ...


class SequenceHolder(Protocol):
    """The cache's sequences, as residency asks of them (``cache.sequences.Sequences`` has it and
    registers itself with ``Residency.held_by``); asked with the lock held."""

    def held_groups(self) -> list[ModalityGroup]:
        """Every group a sequence holds, once per reference."""

    def __len__(self) -> int:
        """How many sequences there are."""


class Residency:
    """Tiers, room, promotion, leases and export of one cache (see the module's docstring)."""

    def __init__(self, cfg: CacheConfig, pools: dict[str, PagePool], maker: KeyMaker,
                 index: GroupDirectory, policy: EvictionPolicy, counters: Counters):
        self.lock = OwnerLock()                # the cache's one lock: the parts take it from here
        self.cfg, self.pools, self.maker, self.index = cfg, pools, maker, index
        self.policy, self.counters = policy, counters
        self.sequences: SequenceHolder | None = None
        self.leases = LeaseTable(ttl=30.0, clock=policy.clock)
        self.lower = LowerTiers(cfg, maker, counters, policy, owner=self, pools=pools)
        self.places = self.lower.places        # Tier -> that tier's read, copy out, release
        self.room = Room(self.lock, policy, self.lower, self.live_groups, self.drop, pools)
        self.placement = PutPlacement(cfg.put_placement, self.lower.host is not None, self.live_groups)
        self.closed = False
        index.adopt(self.lower.adopt_disk_inventory(index.groups, index.new_gid))

    def held_by(self, sequences: SequenceHolder) -> None:
        """The part whose sequences hold groups outside the index (it registers itself once)."""
        self.sequences = sequences

    def live_groups(self) -> list[ModalityGroup]:
        """Every indexed group and every group a sequence holds (a group may appear twice; lock
        held): room making and put placement choose among them."""
        held = self.sequences.held_groups() if self.sequences is not None else []
        return list(self.index.groups.values()) + held

    def check_key(self, key: ContentKey, kind: str | None = None) -> ModalitySpec:
        return spec_of_key(self.cfg, self.maker, key, kind)

    # ------------------------------------------------------------------ life cycle and stats
    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("the cache is closed")

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.lower.cfg.persist_on_close:
                self.lower.persist(self.live_groups(), self.pools)
            self.lower.close()

    def stats(self) -> CacheStats:
        """The cache's stats (``TieredKVCache.stats``)."""
        with self.lock:
            self.apply_copies()
            device: dict[str, TierUsage] = {}
            for name, pool in self.pools.items():
                device[name] = TierUsage(0, pool.num_used, pool.num_used * pool.spec.page_bytes,
                                         pool.num_pages * pool.spec.page_bytes)
            seen: set[int] = set()
            groups = self.live_groups()
            for g in groups:
                if g.gid in seen or g.tier != Tier.DEVICE:
                    continue
                seen.add(g.gid)
                device[g.modality].groups += 1
            counters, by_modality = self.counters.snapshot()
            counters.update(self.lower.storage_counters())
            lower = self.lower.stats(groups) if self.lower.enabled else {}
            return CacheStats(tiers={"device": device, **lower}, counters=counters,
                              by_modality=by_modality,
                              sequences=len(self.sequences) if self.sequences is not None else 0)

    def apply_copies(self) -> None:
        """Apply the copies that landed since the last call (spills, prefetches: their effect on
        the groups happens only here, lock held). The one entry point for the cache's parts and
        attention: each public call makes it once under the lock before it looks at a group's
        tier, and attention again when it unpins; ``wait`` makes it after each wait."""
        self.lower.apply_completions()

    # ------------------------------------------------------------------ room and residency
    def allocate(self, pool: PagePool, n: int, protect: list[ModalityGroup]) -> list[int]:
        """``n`` pages of ``pool`` (``Room.allocate``; may let go of the lock while it waits)."""
        return self.room.allocate(pool, n, protect)

    def make_room(self, pool: PagePool, pages_needed: int, protect: list[ModalityGroup],
                   referenced: bool = True, deadline: float | None = None) -> None:
        self.room.make_room(pool, pages_needed, protect, referenced=referenced, deadline=deadline)

    def drop(self, group: ModalityGroup) -> None:
        """Evict a group (it leaves the cache; ``GroupOwner``)."""
        self.counters.add("evictions", group.modality)
        self.free_group(group)

    def free_group(self, group: ModalityGroup) -> None:
        """The group leaves the cache now; its pages and copies go once no reader pins it."""
        self.index.unindex(group)
        if group.freed:
            return
        group.freed = True
        self.policy.on_remove(group)
        self.settle(group)

    def settle(self, group: ModalityGroup) -> None:
        """Release the storage of a freed group once nothing pins it (lock held; called once:
        at the free, or at the unpin that dropped the last pin)."""
        if not group.freed or group.pins > 0:
            return
        self.places[group.tier].release(group)
        if self.lower.enabled:          # a later group under the key owns the file now
            self.lower.forget(group, keep_file=self.index.groups.get(group.key) not in (None, group))

    def store_host(self, key: ContentKey, spec: ModalitySpec, n: int,
                   write_host: Callable[[HostTier, HostEntry], None],
                   ready: Callable[[], None] | None, *, generated: bool = False) -> bool | None:
        """A put written around the device (``tiers.placement``): host slots (room made below as
        for a demotion; may let go of the lock), ``write_host(host tier, entry)``, ``ready()``,
        commit, index. ``None``: the host tier could not take it (the caller takes the device
        path); ``False``: the key was put meanwhile. A refusal gives the slots back and records
        nothing (lock held)."""
        lower = self.lower
        entry = lower.reserve_host(key, spec, n)
        if entry is None:
            return None
        if key in self.index:
            lower.host.abort(entry)
            return False
        try:
            write_host(lower.host, entry)
            if ready is not None:
                ready()
            lower.host.commit(entry)
        except BaseException:
            lower.host.abort(entry)
            raise
        self.index.insert(key, spec, n, [], tier=Tier.HOST, location=entry, generated=generated)
        self.counters.add("puts_written_around", key.modality)
        lower.maybe_background_spill()
        return True

    # ------------------------------------------------------------------ GroupOwner (for residency)
    def wait(self, fut: Future) -> object:
        try:
            with self.lock.unlocked():
                return fut.result(timeout=WAIT_S)
        finally:
            self.apply_copies()

    # ------------------------------------------------------------------ leases and export
    def lease(self, key: ContentKey, ttl: float = 30.0) -> Lease:
        """``TieredKVCache.lease`` (its contract is documented there)."""
        self.check_key(key)
        with self.lock:
            return self.leases.grant(self.index.require(key), ttl)

    def release_lease(self, lease: Lease) -> None:
        with self.lock:
            self.leases.release(lease)

    def read_group(self, key: ContentKey, *, lease: Lease | None = None,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``TieredKVCache.read_group`` (its contract is documented there)."""
        return self.export([key], [out] if out is not None else None, lease)[0]

    def read_groups(self, keys: Sequence[ContentKey], *,
                    out: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``TieredKVCache.read_groups`` (its contract is documented there)."""
        if out is not None and len(out) != len(keys):
            raise ShapeError(f"{len(out)} out pairs for {len(keys)} keys")
        return self.export(list(keys), list(out) if out is not None else None, None)

    def export(self, keys: list[ContentKey], out: list | None, lease: Lease | None) -> list:
        specs = [self.check_key(key, "kv") for key in keys]
        with self.lock:
            self.check_open()
            self.apply_copies()
            groups = [self.index.require(key) for key in keys]
            if lease is not None:
                self.leases.check(lease)
            shapes = [(s.num_layers, g.num_tokens, s.num_kv_heads, s.head_dim) for s, g in zip(specs, groups)]
            if out is not None:            # all checked before anything is read or counted
                dests = [check_out_kv(o, shape, s.torch_dtype, s.page_size) for o, shape, s in zip(out, shapes, specs)]
            else:
                staging = self.lower.staging         # pooled memory: no fault per 4 KiB written
                dests = [(staging.empty(shape, s.torch_dtype), staging.empty(shape, s.torch_dtype))
                         for shape, s in zip(shapes, specs)]
            on_disk = [i for i, g in enumerate(groups) if g.tier == Tier.DISK]
            for i in on_disk:
                groups[i].pins += 1        # nothing removes their files while they are read
            reads: dict[int, tuple] = {}
            try:
                for i in on_disk:
                    reads[i] = self.places[Tier.DISK].start_read(groups[i], dests[i])
                for i, g in enumerate(groups):           # the lock is held throughout: in place
                    if i in reads:
                        continue
                    self.places[g.tier].copy_out(g, *dests[i])
                for i in on_disk:
                    buf, pages, fut = reads[i]
                    if self.wait(fut) is None:           # lets go of the lock while it waits
                        self.counters.add("corrupt_reads", groups[i].modality)
                        self.forget_corrupt(groups[i])
                        raise CorruptDataError(f"{groups[i]!r}: stored copy missing or failed verification "
                                               "(a miss)")
                    if pages is not None:                # staged: the layout change
                        pages_into_kv([pages], *dests[i])
            finally:
                for buf, _, fut in reads.values():
                    if buf is None:
                        continue
                    if fut.done():
                        self.lower.staging.give(buf)
                    else:                                # a failed wait: the read may still land
                        fut.add_done_callback(lambda _f, b=buf: self.lower.staging.give(b))
                for i in on_disk:
                    groups[i].pins -= 1
                    self.settle(groups[i])
            if lease is not None:
                self.leases.check(lease)
            for key, g in zip(keys, groups):
                g.hits += 1
                self.policy.on_access(g)
                self.counters.add("exports", key.modality)
        return dests

    def inventory(self) -> list[tuple[ContentKey, str, int]]:
        """``TieredKVCache.inventory`` (its contract is documented there)."""
        with self.lock:
            self.apply_copies()
            return [(g.key, g.tier.name.lower(), g.nbytes) for g in self.index]

    def holds(self, keys: Iterable[ContentKey]) -> list[bool]:
        """``TieredKVCache.holds`` (its contract is documented there)."""
        with self.lock:
            self.apply_copies()
            return [k in self.index for k in keys]

    def forget_corrupt(self, group: ModalityGroup) -> None:
        """A stored copy failed verification: the group is a miss from now on (``GroupOwner``)."""
        self.index.unindex(group)
        self.policy.on_remove(group)
        group.location = None

    def flush(self) -> None:
        """``TieredKVCache.flush`` (its contract is documented there)."""
        if not self.lower.enabled:
            return
        with self.lock:
            pending = self.lower.pending()
        if pending:
            concurrent.futures.wait(pending, timeout=WAIT_S)
        with self.lock:
            self.apply_copies()

    def prefetch(self, key: ContentKey) -> bool:
        """``TieredKVCache.prefetch`` (its contract is documented there)."""
        self.check_key(key)
        with self.lock:
            self.apply_copies()
            group = self.index.require(key)
            return self.lower.prefetch(group) is not None

    def promote(self, group: ModalityGroup) -> bool:
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
                self.make_room(pool, need - pool.num_free, [group], referenced=False)
            except CapacityError:
                return False
            finally:
                group.pins -= 1
                self.settle(group)
            if need > pool.num_free or group.pins or group.busy or group.freed or group.tier == Tier.DEVICE:
                return False
        pages = pool.allocate(need)
        tier = group.tier
        try:
            src = self.places[tier].promotion_source(group)     # a disk read lets go of the lock
            if group.pins or group.busy or group.freed or group.tier != tier:
                raise _Moved()             # changed while it was read: it stays where it is now
        except (_Moved, CorruptDataError):
            pool.free(pages)
            return False
        except BaseException:
            pool.free(pages)
            raise
        self.lower.promote_into(group, pool, pages, src)
        return True

    def read_pages(self, group: ModalityGroup) -> torch.Tensor:
        """A copy of the group's pages ``[n, *page_shape]`` from whichever tier holds it,
        verified (``tiers.places``; a disk read lets go of the lock)."""
        return self.places[group.tier].read_pages(group)


class _Moved(Exception):
    """A group changed tier while the lock was let go (internal to ``promote``)."""
