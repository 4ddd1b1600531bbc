"""Where a group lives: demotion (device -> host -> disk -> drop), promotion, prefetch, spills.

``LowerTiers`` composes the host tier, the disk tier and the mover for the cache that owns the
groups and is called with that owner's lock held. It knows the owner (``residency.Residency``,
beside it in this package) only through ``GroupOwner`` (dropping and forgetting groups, waiting
for a copy with the lock let go), and
takes the keys, counters and policy as arguments. Whole groups move; none is ever split across
tiers.

Copies and the locks: the mover's done-callbacks never take the cache lock (they run on the
mover's thread, which the cache may be waiting on); they only queue a completion, and the cache
applies completions at the start of its next call (and after it waits for a copy). A copy's
effect on the group (its tier, which copy is its own, removing the copy it leaves) happens only
there, under the lock: the mover never removes a copy the cache may still count on.

- Demotion is staged (``stage_demotion``): the copy is made while the group keeps its device
  pages and tier; ``commit_demotion`` then frees the pages and moves the group, or
  ``undo_demotion`` removes the copy, so a demotion either completes or changes nothing.
- A group with a copy in flight (``busy``) or read by an attention call (``pins``) is never
  promoted, demoted or freed under its reader; a spill that lands while its group is pinned
  is dropped and the group stays on the host.

- Device -> host: a copy into host slab slots (on CUDA, on the host tier's side stream; the
  device pages are freed only after the copy's event completed).
- Host -> disk: asynchronous through the mover, in the background once the host tier passes its
  high-water mark, or on demand when the host needs room now; the host slots stay held until
  the file is durable, and the group flips to the disk tier in the completion.
- A full or failing disk keeps the group where it was, counted (``spill_failures``).
- Attention's operands over host and disk pages are ``mmtier.attention.lower_operands``' (from
  ``host``, ``mover``, ``staging`` and ``storage_key`` here). A disk copy that fails
  verification is a miss: the group is dropped and ``corrupt_reads`` counted; attention over
  it raises ``CorruptDataError`` (the caller recomputes), never returns wrong values.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Container, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import CacheConfig, ModalitySpec
from ..content import ContentKey, KeyMaker, tenant_scope
from ..core.groups import ModalityGroup, Tier
from ..errors import CapacityError, CorruptDataError, MMTierError
from ..eviction import EvictionPolicy
from ..pages.copies import view_runs
from ..pages.pool import PagePool
from ..stats import Counters, TierUsage
from ..storage import DiskTier, HostTier, Mover
from ..storage.dest_pages import DestTokens
from ..storage.host_slabs import HostEntry
from ..storage.staging import StagingPool
from .places import PlaceOwner, tier_places

log = logging.getLogger(__name__)
WAIT_S = 120.0
HIGH_WATER = 0.9
LOW_WATER = 0.75
PRIVATE_SALT = b"private"                  # the salt of private runs' keys (a tenant's salt is 32 bytes)
PRIVATE_SCOPE = tenant_scope(PRIVATE_SALT)


class GroupOwner(PlaceOwner, Protocol):
    """What the lower tiers and their places ask of the cache that owns the groups (called with
    its lock held)."""

    def drop(self, group: ModalityGroup) -> None:
        """Evict a group at the cascade's end (it leaves the cache)."""


@dataclass(frozen=True)
class StagedCopy:
    """A demotion's copy, made while the group still lives on the device."""

    key: ContentKey
    tier: Tier
    location: object
    existing: bool = False            # a disk copy written before (write-behind): undo keeps it


class LowerTiers:
    def __init__(self, cfg: CacheConfig, keys: KeyMaker, counters: Counters, policy: EvictionPolicy,
                 owner: GroupOwner, pools: dict[str, PagePool]):
        self.cfg, self.keys, self.counters, self.policy, self.owner = cfg, keys, counters, policy, owner
        self.host = HostTier(cfg.host_bytes) if cfg.host_bytes > 0 else None
        self.disk = None
        if cfg.disk_dir is not None:
            self.disk = DiskTier(cfg.disk_dir, model=cfg.model, capacity_bytes=cfg.disk_bytes,
                                 free_floor_bytes=cfg.disk_free_floor_bytes)
        self.mover = Mover(self.host, self.disk, model=cfg.model,
                           max_inflight_bytes=cfg.max_inflight_bytes) if self.disk is not None else None
        self.staging = StagingPool(cfg.stream_buffer_bytes)
        self._done: collections.deque = collections.deque()
        self._spilling: dict[int, Future] = {}
        self._spill_bytes: dict[int, int] = {}  # gid -> bytes of a host -> disk spill not yet applied
        self._durable_bytes: dict[int, int] = {}  # gid -> bytes of a write-behind copy in flight
        self._private_keys: dict[int, ContentKey] = {}
        self._lock = threading.Lock()
        self.owner_pools = pools
        self.places = tier_places(pools, self, owner)   # Tier -> how a group there is read, freed

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    @property
    def keeps_disk_copies(self) -> bool:
        """Whether a group's disk file stays while the group lives above it (write-behind on: a
        promotion keeps the file, so the group stays durable)."""
        return self.disk is not None and self.cfg.write_behind

    def disk_copy(self, group: ModalityGroup):
        """The group's durable file (``DiskEntry``) when it has one, else ``None``."""
        if self.disk is None or group.key is None:
            return None
        return self.disk.info(group.key)

    # ------------------------------------------------------------------ keys of private runs
    def storage_key(self, group: ModalityGroup) -> ContentKey:
        """Shared groups store under their key; a private run under a one-off internal key."""
        if group.key is not None:
            return group.key
        key = self._private_keys.get(group.gid)
        if key is None:
            digest = hashlib.sha256(b"mmtier/private" + os.urandom(16) + group.gid.to_bytes(8, "big")).digest()
            key = self.keys.chain(modality=group.modality, chain_digest=digest, tenant_salt=PRIVATE_SALT)
            self._private_keys[group.gid] = key
        return key

    # ------------------------------------------------------------------ warm restart
    def adopt_disk_inventory(self, known: Container[ContentKey], new_gid: Callable[[], int]
                             ) -> list[ModalityGroup]:
        """The verified groups found on disk and not in ``known`` (a new cache over the same
        ``disk_dir``), as disk-resident groups for the owner to index.

        A private run's file (a sequence's own K/V, under a one-off key no caller can name) is
        unreachable once its cache is gone: it is removed, freeing its disk budget, and counted
        (``private_runs_removed_at_start``), never adopted."""
        if self.disk is None:
            return []
        found: dict[ContentKey, ModalityGroup] = {}
        for entry in self.disk.inventory():
            key = entry.key
            spec = self.cfg.modalities.get(key.modality)
            if spec is None or not self.keys.is_authentic(key) or key.sharing not in ("content", "prefix"):
                self.counters.add("foreign_files")
                continue
            if key.scope == PRIVATE_SCOPE:
                self.disk.remove(key)
                self.counters.add("private_runs_removed_at_start", key.modality)
                continue
            if key in known or key in found:
                continue
            found[key] = ModalityGroup(new_gid(), key, spec, entry.num_tokens, tier=Tier.DISK, location=entry)
            self.counters.add("adopted_from_disk", key.modality)
        return list(found.values())

    # ------------------------------------------------------------------ completions
    def apply_completions(self) -> None:
        while self._done:
            kind, group, key, fut = self._done.popleft()
            self._spilling.pop(group.gid, None)
            self._spill_bytes.pop(group.gid, None)
            group.busy -= 1
            if kind == "spill":
                self._finish_spill(group, key, fut)
            elif kind == "prefetch":
                self._finish_prefetch(group, key, fut)

    def _finish_spill(self, group: ModalityGroup, key: ContentKey, fut: Future) -> None:
        """A host -> disk spill landed: the group moves to disk and its host copy goes, unless
        it left the host meanwhile, left the cache, or is read right now (then the file goes)."""
        exc = fut.exception()
        if isinstance(exc, CorruptDataError) and not group.freed and group.tier == Tier.HOST:
            self.places[Tier.HOST].corrupt(group)   # the host copy failed its checksums
            return
        if exc is not None:
            self.counters.add("spill_failures", group.modality)
            return
        entry = fut.result()
        if group.freed or group.tier != Tier.HOST or group.pins > 0:
            # the file goes unless it is the live group's durable copy (write-behind keeps it)
            if self.disk is not None and group.tier != Tier.DISK and (group.freed or not self.keeps_disk_copies):
                self.disk.remove(key)
            if group.pins > 0 and not group.freed:
                self.counters.add("spills_undone_for_readers", group.modality)
            return
        if self.host is not None:
            self.host.remove(key)
        self._move(group, Tier.DISK, entry)
        self.counters.add("spills", group.modality)
        self.counters.add("spills_to_disk", group.modality)

    def _finish_prefetch(self, group: ModalityGroup, key: ContentKey, fut: Future) -> None:
        """A disk -> host prefetch landed: the group moves to the host, or, if it is no longer
        on disk (or no longer cached), the host copy the prefetch made goes again."""
        if fut.exception() is not None or fut.result() is None:
            return
        entry = fut.result()
        if group.freed or group.tier != Tier.DISK:
            if group.location is not entry and self.host is not None:
                self.host.remove(key)
            return
        self._move(group, Tier.HOST, entry)
        self.counters.add("restores", group.modality)
        self.counters.add("prefetched", group.modality)

    def _move(self, group: ModalityGroup, tier: Tier, location: object) -> None:
        old = group.tier
        group.tier = tier
        group.location = location
        if tier != Tier.DEVICE:
            group.pages = []
        self.policy.on_move(group, old)

    def _queue(self, kind: str, group: ModalityGroup, key: ContentKey, fut: Future) -> None:
        group.busy += 1
        self._spilling[group.gid] = fut
        fut.add_done_callback(lambda f: self._done.append((kind, group, key, f)))

    # ------------------------------------------------------------------ demotion, staged
    def stage_demotion(self, group: ModalityGroup, pool: PagePool) -> StagedCopy | None:
        """Copy a device group one tier down, leaving the group as it is (``commit_demotion``
        moves it, ``undo_demotion`` removes the copy). ``None``: no lower tier could take it.
        May wait for spills that make room (the owner's lock let go): the caller marks the
        group ``busy`` and re-checks it afterwards."""
        key = self.storage_key(group)
        if self.host is not None and self._host_room(group.nbytes) and not group.freed:
            try:
                entry = self.host.put(key, group.spec, group.num_tokens, pool.view, page_ids=group.pages)
            except CapacityError:
                entry = None
            if entry is not None:
                entry.wait()                              # the device pages are read
                return StagedCopy(key, Tier.HOST, entry)
        written = self.disk_copy(group)
        if written is not None and not group.freed:        # already durable: no second write
            return StagedCopy(key, Tier.DISK, written, existing=True)
        if self.mover is not None and not group.freed and self._disk_room(group.nbytes):
            pages = view_runs(pool.view, group.pages)     # written from the pool's own memory
            try:
                entry = self.owner.wait(self.mover.spill(key, group.spec, group.num_tokens, pages))
            except (MMTierError, OSError):
                self.counters.add("spill_failures", group.modality)
                return None
            return StagedCopy(key, Tier.DISK, entry)
        return None

    def reserve_host(self, key: ContentKey, spec: ModalitySpec, num_tokens: int) -> HostEntry | None:
        """Host slots for a new group written around the device (``tiers.placement``), room made
        by spilling host groups to disk as for a demotion (may wait, the owner's lock let go);
        ``None`` when the host tier cannot take it. The caller fills the slots, then commits or
        aborts the entry (``HostTier.commit`` / ``abort``)."""
        nbytes = spec.pages_for(num_tokens) * spec.page_bytes
        if self.host is None or not self._host_room(nbytes):
            return None
        try:
            return self.host.reserve(key, spec, num_tokens)
        except CapacityError:
            return None

    def commit_demotion(self, group: ModalityGroup, staged: StagedCopy, pool: PagePool) -> None:
        """The staged copy becomes the group's: its device pages are freed (cannot fail)."""
        pool.free(group.pages)
        self._move(group, staged.tier, staged.location)
        self.counters.add("spills", group.modality)
        self.counters.add(self.places[staged.tier].spill_counter, group.modality)
        if staged.tier == Tier.HOST:
            self.maybe_background_spill()

    def undo_demotion(self, staged: StagedCopy) -> None:
        if not staged.existing:
            self.places[staged.tier].remove(staged.key)

    def _host_room(self, nbytes: int, *, wait: bool = True) -> bool:
        """Make room in the host tier for ``nbytes`` by spilling its unreferenced groups to
        disk (``wait``: for those copies, the owner's lock let go); ``False`` when it cannot."""
        host = self.host
        assert host is not None
        if host.free_bytes >= nbytes:
            return True
        if nbytes > host.capacity_bytes:
            return False
        victims = self.policy.victims(Tier.HOST, nbytes - host.free_bytes)
        futures = []
        for g in victims:
            if self.mover is not None:
                futures.append(self._spill_host_group(g))
            else:
                self.owner.drop(g)
        if wait:
            for fut in futures:
                if fut is None:
                    continue
                try:
                    self.owner.wait(fut)
                except (MMTierError, OSError):
                    pass   # counted as a spill failure in the completion; the group stays on host
        return host.free_bytes >= nbytes

    def _disk_room(self, nbytes: int) -> bool:
        """Make room in the disk budget by dropping its policy's victims (the cascade's end),
        counting the spills already started (their bytes are not on disk yet: without them,
        background spills running side by side overcommit the budget and fail)."""
        disk = self.disk
        if disk is None or nbytes > disk.capacity_bytes:
            return False
        need = (disk.used_bytes + sum(self._spill_bytes.values()) + sum(self._durable_bytes.values())
                + nbytes - disk.capacity_bytes)
        if need > 0:
            victims = self.policy.victims(Tier.DISK, need)
            if sum(g.nbytes for g in victims) < need:
                return False
            for g in victims:
                self.owner.drop(g)
        return True

    def _spill_host_group(self, group: ModalityGroup) -> Future | None:
        if group.gid in self._spilling or self.mover is None:
            return None
        written = self.disk_copy(group)
        if written is not None and group.pins == 0 and not group.freed:
            if self.host is not None:                     # already durable: the host copy just goes
                self.host.remove(self.storage_key(group))
            self._move(group, Tier.DISK, written)
            self.counters.add("spills", group.modality)
            self.counters.add("spills_to_disk", group.modality)
            self.counters.add("spills_already_on_disk", group.modality)
            return None
        if not self._disk_room(group.nbytes):
            return None
        key = self.storage_key(group)
        fut = self.mover.spill(key, group.spec, group.num_tokens)   # the host copy goes in the completion
        self._spill_bytes[group.gid] = group.nbytes
        self._queue("spill", group, key, fut)
        return fut

    def maybe_background_spill(self) -> None:
        """Past the high-water mark, spill unreferenced host groups to disk asynchronously."""
        host = self.host
        if host is None or self.mover is None or host.capacity_bytes == 0:
            return
        if host.used_bytes < HIGH_WATER * host.capacity_bytes:
            return
        excess = host.used_bytes - int(LOW_WATER * host.capacity_bytes)
        for g in self.policy.victims(Tier.HOST, excess):
            self._spill_host_group(g)

    def forget(self, group: ModalityGroup, *, keep_file: bool = False) -> None:
        """The group is freed: drop its lower-tier copies (a spill in flight finishes first and
        its completion removes the file). ``keep_file``: another group now holds the key (its
        file is that group's)."""
        key = self.storage_key(group)
        self.places[group.tier].forget(key)
        if self.disk is not None and group.gid not in self._spilling and not keep_file:
            self.disk.remove(key)
        self._private_keys.pop(group.gid, None)
        group.location = None

    # ------------------------------------------------------------------ write-behind copies
    def snapshot(self, group: ModalityGroup) -> torch.Tensor:
        """A device group's pages copied into host memory. The write-behind calls it with the
        cache's lock let go, on a group it pinned: its pages neither move nor change meanwhile."""
        spec = group.spec
        pages = torch.empty((group.num_pages, *spec.page_shape), dtype=spec.torch_dtype)
        at = 0
        for run in view_runs(self.owner_pools[group.modality].view, group.pages):
            pages[at:at + run.shape[0]].copy_(run)
            at += run.shape[0]
        return pages

    def start_durable_copy(self, group: ModalityGroup, snapshot: torch.Tensor | None = None) -> Future | None:
        """Start writing a shared device or host group's copy to disk, leaving the group where
        it is (``durability.WriteBehind``, which calls ``end_durable_copy`` once it is done).
        A device group is written from ``snapshot`` (its pages in host memory, taken by
        ``snapshot``; taken here, lock held, when not given): nothing is pinned while the disk
        writes, so eviction goes on in its own order; a host group is written from its slots,
        held by the mover until written (they never change). ``None``: nothing to write (no
        disk tier, on disk already, no room in the budget)."""
        if self.mover is None or group.key is None or group.freed or group.tier == Tier.DISK:
            return None
        if self.disk_copy(group) is not None or not self._disk_room(group.nbytes) or group.freed:
            return None
        pages = None
        if group.tier == Tier.DEVICE:
            pages = snapshot if snapshot is not None else self.snapshot(group)
        fut = self.mover.spill(group.key, group.spec, group.num_tokens, pages)
        self._durable_bytes[group.gid] = group.nbytes
        return fut

    def end_durable_copy(self, group: ModalityGroup, *, orphan: bool) -> None:
        """A write-behind copy finished; ``orphan``: its group left the cache while it was
        written (and no other group holds the key): the file goes."""
        self._durable_bytes.pop(group.gid, None)
        if orphan and self.disk is not None and group.key is not None and group.gid not in self._spilling:
            self.disk.remove(group.key)

    # ------------------------------------------------------------------ promotion
    def read_disk_async(self, group: ModalityGroup, out: torch.Tensor | DestTokens | None = None) -> Future:
        """Start reading the group's verified pages from disk, into ``out`` (``[n,
        *page_shape]``, or the group's tokens) when given; resolves to them or ``None``."""
        assert self.mover is not None
        return self.mover.fetch(self.storage_key(group), group.spec, out=out)

    def promote_into(self, group: ModalityGroup, pool: PagePool, pages: list[int],
                     src: torch.Tensor | None) -> None:
        """The group's lower copy (host slots, or ``src`` read from disk) into device ``pages``;
        the lower copy is removed and the group lives on the device."""
        key = self.storage_key(group)
        self.places[group.tier].copy_in(group, pool, pages, src, key)
        group.pages = pages
        self._move(group, Tier.DEVICE, None)
        self.counters.add("restores", group.modality)

    def prefetch(self, group: ModalityGroup) -> Future | None:
        """Disk -> host in the background (at prefetch priority); never waits for room."""
        if group.tier != Tier.DISK or group.busy or self.mover is None or self.host is None:
            return None
        if not self._host_room(group.nbytes, wait=False):
            return None
        key = self.storage_key(group)
        fut = self.mover.prefetch(key, group.spec)
        self._queue("prefetch", group, key, fut)
        return fut

    def pending(self) -> list[Future]:
        """The copies this cache started that have not been applied yet."""
        return list(self._spilling.values())

    # ------------------------------------------------------------------ stats and close
    def stats(self, groups: Iterable[ModalityGroup]) -> dict[str, dict[str, TierUsage]]:
        """Usage of the host and disk tiers by modality over ``groups`` (each counted once)."""
        out: dict[str, dict[str, TierUsage]] = {}
        if self.host is not None:
            host = {m: TierUsage(capacity_bytes=self.host.capacity_bytes) for m in self.cfg.modalities}
            out["host"] = host
        if self.disk is not None:
            disk = {m: TierUsage(capacity_bytes=self.disk.capacity_bytes) for m in self.cfg.modalities}
            out["disk"] = disk
        for g in {g.gid: g for g in groups}.values():
            tier = {Tier.HOST: "host", Tier.DISK: "disk"}.get(g.tier)
            if tier is None or tier not in out:
                continue
            usage = out[tier][g.modality]
            usage.groups += 1
            usage.pages += g.num_pages
            usage.bytes += g.nbytes
        return out

    def storage_counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.disk is not None:
            d = self.disk.stats()
            for k in ("corrupt_reads", "quarantined", "quarantined_at_start", "tmp_removed_at_start",
                      "full_errors", "floor_refusals", "io_errors"):
                out[f"disk_{k}"] = int(d.get(k, 0))
            out["disk_read_bytes"] = int(d.get("read_bytes", 0))
        out["stream_buffers_reused"] = self.staging.reused
        out["stream_buffers_allocated"] = self.staging.allocated
        out["stream_buffer_bytes_pooled"] = self.staging.pooled_bytes
        return out

    # ------------------------------------------------------------------ shutdown
    def persist(self, groups: Iterable[ModalityGroup], pools: dict[str, PagePool]) -> int:
        """Write the shared groups held on the device and host tiers to disk (the cache is
        closing), so a cache restarted over the same directory finds them, not only what was
        spilled. Groups already on disk, private runs (their keys die with this cache) and
        groups the disk budget cannot take without dropping what is on disk stay as they are;
        returns how many were written (``persisted_on_close``)."""
        if self.mover is None or self.disk is None:
            return 0
        self.apply_completions()
        seen: set[int] = set()
        pending: list[tuple[ModalityGroup, Future]] = []
        room = self.disk.capacity_bytes - self.disk.used_bytes - sum(self._spill_bytes.values())
        for g in groups:
            if g.gid in seen or g.freed or g.key is None or g.tier not in (Tier.DEVICE, Tier.HOST):
                continue
            seen.add(g.gid)
            if g.gid in self._spilling or self.disk.contains(g.key) or g.nbytes > room:
                continue
            pages = view_runs(pools[g.modality].view, g.pages) if g.tier == Tier.DEVICE else None
            try:
                fut = self.mover.spill(g.key, g.spec, g.num_tokens, pages)
            except MMTierError:
                continue
            room -= g.nbytes
            pending.append((g, fut))
        written = 0
        for g, fut in pending:
            try:
                fut.result(timeout=WAIT_S)
            except Exception:  # noqa: BLE001 - best effort at close: the group is not kept, said here
                log.warning("mmtier: %r not written to disk at close", g.key, exc_info=True)
                self.counters.add("spill_failures", g.modality)
                continue
            written += 1
            self.counters.add("persisted_on_close", g.modality)
        return written

    def close(self) -> None:
        if self.mover is not None:
            self.mover.close(timeout=WAIT_S)
        self.apply_completions()
        if self.host is not None:
            self.host.close()
        if self.disk is not None:
            self.disk.close()
        self.staging.clear()
