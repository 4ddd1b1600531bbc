"""Where a group lives: demotion (device -> host -> disk -> drop), promotion, lower-tier attention.

``LowerTiers`` composes the host tier, the disk tier and the mover for one ``TieredKVCache``
and is called with the cache's lock held. Whole groups move; none is ever split across tiers.

Copies and the locks: the mover's done-callbacks never take the cache lock (they run on the
mover's thread, which the cache may be waiting on); they only queue a completion, and the cache
applies completions at the start of its next call (and while it waits for a copy).

- Device -> host: a copy into host slab slots (on CUDA, on the host tier's side stream; the
  device pages are freed only after the copy's event completed).
- Host -> disk: asynchronous through the mover, in the background once the host tier passes its
  high-water mark, or on demand when the host needs room now; the host slots stay held until
  the file is durable, and the group flips to the disk tier in the completion.
- A full or failing disk keeps the group where it was, counted (``spill_failures``).
- Attention over host pages runs in place on the slabs (CPU path); over disk pages it streams
  the group's verified pages (only the attended layer's slice of each) into a host buffer
  first. A disk copy that fails verification is a miss: the group is dropped and
  ``corrupt_reads`` counted; attention over it raises ``CorruptDataError`` (the caller
  recomputes), never returns wrong values.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from .content import ContentKey, tenant_scope
from .errors import CapacityError, CorruptDataError, MMTierError
from .groups import ModalityGroup, Tier
from .kernels import paged_attention
from .stats import TierUsage
from .storage import DiskTier, HostTier, Mover
from .storage.staging import StagingPool
from .streaming import DiskStream
from .table import compile_segments

if TYPE_CHECKING:
    from .cache import TieredKVCache

WAIT_S = 120.0
HIGH_WATER = 0.9
LOW_WATER = 0.75
PRIVATE_SALT = b"private"                  # the salt of private runs' keys (a tenant's salt is 32 bytes)
PRIVATE_SCOPE = tenant_scope(PRIVATE_SALT)


class LowerTiers:
    def __init__(self, cache: TieredKVCache):
        cfg = cache.cfg
        self.cache = cache
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
        self._private_keys: dict[int, ContentKey] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    # ------------------------------------------------------------------ keys of private runs
    def storage_key(self, group: ModalityGroup) -> ContentKey:
        """Shared groups store under their key; a private run under a one-off internal key."""
        if group.key is not None:
            return group.key
        key = self._private_keys.get(group.gid)
        if key is None:
            digest = hashlib.sha256(b"mmtier/private" + os.urandom(16) + group.gid.to_bytes(8, "big")).digest()
            key = self.cache.keys.chain(modality=group.modality, chain_digest=digest, tenant_salt=PRIVATE_SALT)
            self._private_keys[group.gid] = key
        return key

    # ------------------------------------------------------------------ warm restart
    def adopt_disk_inventory(self) -> None:
        """Index every verified group found on disk (a new cache over the same ``disk_dir``).

        A private run's file (a sequence's own K/V, under a one-off key no caller can name) is
        unreachable once its cache is gone: it is removed, freeing its disk budget, and counted
        (``private_runs_removed_at_start``), never adopted."""
        if self.disk is None:
            return
        cache = self.cache
        for entry in self.disk.inventory():
            key = entry.key
            spec = cache.cfg.modalities.get(key.modality)
            if spec is None or not cache.keys.is_authentic(key) or key.sharing not in ("content", "prefix"):
                cache.counters.add("foreign_files")
                continue
            if key.scope == PRIVATE_SCOPE:
                self.disk.remove(key)
                cache.counters.add("private_runs_removed_at_start", key.modality)
                continue
            if key in cache._groups:
                continue
            group = ModalityGroup(next(cache._gids), key, spec, entry.num_tokens, tier=Tier.DISK,
                                  location=entry)
            cache._groups[key] = group
            cache.policy.on_insert(group)
            cache.counters.add("adopted_from_disk", key.modality)

    # ------------------------------------------------------------------ completions
    def apply_completions(self) -> None:
        while self._done:
            kind, group, fut = self._done.popleft()
            self._spilling.pop(group.gid, None)
            group.busy -= 1
            if kind == "spill":
                self._finish_spill(group, fut)
            elif kind == "prefetch":
                self.finish_prefetch(group, fut)

    def _finish_spill(self, group: ModalityGroup, fut: Future) -> None:
        cache = self.cache
        exc = fut.exception()
        if exc is not None:
            cache.counters.add("spill_failures", group.modality)
            return
        entry = fut.result()
        if group.tier != Tier.HOST or self._dead(group):
            if self.disk is not None and (group.key is None or group.key not in cache._groups):
                self.disk.remove(self.storage_key(group))
            return
        self._move(group, Tier.DISK, entry)
        cache.counters.add("spills", group.modality)
        cache.counters.add("spills_to_disk", group.modality)

    def _move(self, group: ModalityGroup, tier: Tier, location: object) -> None:
        old = group.tier
        group.tier = tier
        group.location = location
        if tier != Tier.DEVICE:
            group.pages = []
        self.cache.policy.on_move(group, old)

    def _dead(self, group: ModalityGroup) -> bool:
        cache = self.cache
        if group.key is not None:
            return cache._groups.get(group.key) is not group
        return group.refs <= 0

    def _queue(self, kind: str, group: ModalityGroup, fut: Future) -> None:
        group.busy += 1
        self._spilling[group.gid] = fut
        fut.add_done_callback(lambda f: self._done.append((kind, group, f)))

    def wait_for(self, fut: Future) -> object:
        try:
            return fut.result(timeout=WAIT_S)
        finally:
            self.apply_completions()

    # ------------------------------------------------------------------ demotion
    def demote_from_device(self, group: ModalityGroup) -> bool:
        """Move a device group down, whole. ``False``: no lower tier could take it (unchanged)."""
        cache = self.cache
        pool = cache.pools[group.modality]
        key = self.storage_key(group)
        if self.host is not None and self._host_room(group.nbytes):
            try:
                entry = self.host.put(key, group.spec, group.num_tokens, pool.view, page_ids=group.pages)
            except CapacityError:
                entry = None
            if entry is not None:
                entry.wait()                              # the device pages are read: free them
                pool.free(group.pages)
                self._move(group, Tier.HOST, entry)
                cache.counters.add("spills", group.modality)
                cache.counters.add("spills_to_host", group.modality)
                self.maybe_background_spill()
                return True
        if self.mover is not None and self._disk_room(group.nbytes):
            pages = pool.view[torch.tensor(group.pages, device=pool.device)].cpu()
            try:
                entry = self.wait_for(self.mover.spill(key, group.spec, group.num_tokens, pages))
            except (CapacityError, MMTierError, OSError):
                cache.counters.add("spill_failures", group.modality)
                return False
            pool.free(group.pages)
            self._move(group, Tier.DISK, entry)
            cache.counters.add("spills", group.modality)
            cache.counters.add("spills_to_disk", group.modality)
            return True
        return False

    def _host_room(self, nbytes: int) -> bool:
        """Make room in the host tier for ``nbytes`` (spilling its unreferenced groups to disk,
        waiting for those copies); ``False`` when it cannot."""
        host = self.host
        assert host is not None
        if host.free_bytes >= nbytes:
            return True
        if nbytes > host.capacity_bytes:
            return False
        victims = self.cache.policy.victims(Tier.HOST, nbytes - host.free_bytes)
        futures = []
        for g in victims:
            if self.mover is not None:
                futures.append(self._spill_host_group(g))
            else:
                self.cache._drop(g)
        for fut in futures:
            if fut is None:
                continue
            try:
                self.wait_for(fut)
            except (MMTierError, OSError):
                pass   # counted as a spill failure in the completion; the group stays on host
        self.apply_completions()
        return host.free_bytes >= nbytes

    def _disk_room(self, nbytes: int) -> bool:
        """Make room in the disk budget by dropping its policy's victims (the cascade's end)."""
        disk = self.disk
        if disk is None or nbytes > disk.capacity_bytes:
            return False
        need = disk.used_bytes + nbytes - disk.capacity_bytes
        if need > 0:
            victims = self.cache.policy.victims(Tier.DISK, need)
            if sum(g.nbytes for g in victims) < need:
                return False
            for g in victims:
                self.cache._drop(g)
        return True

    def _spill_host_group(self, group: ModalityGroup) -> Future | None:
        if group.gid in self._spilling or self.mover is None:
            return None
        if not self._disk_room(group.nbytes):
            return None
        key = self.storage_key(group)
        fut = self.mover.spill(key, group.spec, group.num_tokens, remove_from_host=True)
        self._queue("spill", group, fut)
        return fut

    def maybe_background_spill(self) -> None:
        """Past the high-water mark, spill unreferenced host groups to disk asynchronously."""
        host = self.host
        if host is None or self.mover is None or host.capacity_bytes == 0:
            return
        if host.used_bytes < HIGH_WATER * host.capacity_bytes:
            return
        excess = host.used_bytes - int(LOW_WATER * host.capacity_bytes)
        for g in self.cache.policy.victims(Tier.HOST, excess):
            self._spill_host_group(g)

    def demote_from_host(self, group: ModalityGroup) -> None:
        """Drop a host group (the policy chose it and no disk tier exists)."""
        self.host.remove(self.storage_key(group))
        group.location = None

    def forget(self, group: ModalityGroup) -> None:
        """The group is freed: drop its lower-tier copies (a spill in flight finishes first)."""
        key = self.storage_key(group)
        if group.tier == Tier.HOST and self.host is not None:
            self.host.remove(key)
        if self.disk is not None and group.gid not in self._spilling:
            self.disk.remove(key)
        self._private_keys.pop(group.gid, None)
        group.location = None

    # ------------------------------------------------------------------ promotion
    def promote(self, group: ModalityGroup) -> bool:
        """Bring a lower-tier group to the device when room can be made without demoting
        referenced groups. ``False``: it stays where it is (attention serves it there)."""
        cache = self.cache
        pool = cache.pools[group.modality]
        need = group.num_pages
        if need > pool.num_free:
            group.pins += 1        # making room below must never choose the group itself
            try:
                cache._make_room(pool, need - pool.num_free, [group], referenced=False)
            except CapacityError:
                return False
            finally:
                group.pins -= 1
        key = self.storage_key(group)
        if group.tier == Tier.DISK:
            src = self._read_disk(group)
            pages = pool.allocate(need)
            pool.view[torch.tensor(pages, device=pool.device)] = src.to(pool.device)
            self.disk.remove(key)
        else:
            pages = pool.allocate(need)
            group.location.copy_to(pool.view, pages)
            self.host.remove(key)
        group.pages = pages
        self._move(group, Tier.DEVICE, None)
        cache.counters.add("restores", group.modality)
        return True

    def _read_disk(self, group: ModalityGroup) -> torch.Tensor:
        """The group's verified pages from disk, or ``CorruptDataError`` (group dropped)."""
        key = self.storage_key(group)
        pages = self.wait_for(self.mover.fetch(key, group.spec)) if self.mover is not None else None
        if pages is None:
            self.cache.counters.add("corrupt_reads", group.modality)
            self.cache._forget_corrupt(group)
            raise CorruptDataError(f"{key!r}: stored copy missing or failed verification (a miss)")
        return pages

    def stream(self, segments, layer: int) -> DiskStream | None:
        """Queue the reads of the disk-resident groups among ``segments`` (in batches; only
        ``layer``'s bytes of each page) so they overlap the device and host parts of an
        attention call over that layer."""
        groups = [s.group for s in segments if s.group.tier == Tier.DISK]
        if not groups or self.mover is None:
            return None
        return DiskStream(self, groups, layer)

    def prefetch(self, group: ModalityGroup) -> Future | None:
        """Disk -> host in the background (at prefetch priority)."""
        if group.tier != Tier.DISK or self.mover is None or self.host is None:
            return None
        if not self._host_room(group.nbytes):
            return None
        fut = self.mover.prefetch(self.storage_key(group), group.spec)
        self._queue("prefetch", group, fut)
        return fut

    def flush(self, timeout: float = WAIT_S) -> None:
        """Wait for every copy this cache started, then apply their completions."""
        import concurrent.futures

        pending = list(self._spilling.values())
        if pending:
            concurrent.futures.wait(pending, timeout=timeout)
        self.apply_completions()

    def finish_prefetch(self, group: ModalityGroup, fut: Future) -> None:
        if fut.exception() is not None or fut.result() is None or group.tier != Tier.DISK:
            return
        self._move(group, Tier.HOST, fut.result())
        self.cache.counters.add("restores", group.modality)
        self.cache.counters.add("prefetched", group.modality)

    # ------------------------------------------------------------------ attention
    def lower_states(self, segments, layer, q, q_pos, causal, scale, stream: DiskStream | None = None):
        """Partial ``(out, lse)`` states of the host- and disk-resident segments (CPU path): the
        host part in place on the slabs, then the disk part batch by batch as reads land."""
        host_segs = [s for s in segments if s.group.tier == Tier.HOST]
        disk_segs = [s for s in segments if s.group.tier == Tier.DISK]
        if not host_segs and not disk_segs:
            return []
        if disk_segs and stream is None:
            with contextlib.closing(self.stream(disk_segs, layer)) as own:
                return self.lower_states(segments, layer, q, q_pos, causal, scale, own)
        qc = q.cpu()
        q_pos = q_pos.cpu()
        q_indptr = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        states = []
        if disk_segs:     # what has landed while the device part ran, before the host part
            states.extend(stream.states(disk_segs, qc, q_indptr, q_pos, causal, scale, WAIT_S, wait=False))
        if host_segs:
            with stream.sharing_cores() if stream is not None else contextlib.nullcontext():
                states.append(self._host_state(host_segs, layer, qc, q_indptr, q_pos, causal, scale))
        if disk_segs:
            states.extend(stream.states(disk_segs, qc, q_indptr, q_pos, causal, scale, WAIT_S))
        self.cache.counters.add("lower_tier_attentions")
        return states

    def _host_state(self, segments, layer, q, q_indptr, q_pos, causal, scale):
        held = []
        try:
            for s in segments:
                entry = self.host.hold(self.storage_key(s.group))
                if entry is None:
                    raise CorruptDataError(f"{s.group!r}: host copy vanished")
                held.append(entry)

            def view_of(group: ModalityGroup):
                return group.modality, self.host.slab_view(group.spec), list(group.location.slots)

            ops = compile_segments(segments, layer, view_of)
            return paged_attention(q, q_indptr, q_pos, ops, causal=causal, scale=scale,
                                   backend="torch", out_dtype=torch.float32)
        finally:
            for entry in held:
                self.host.release(entry)

    # ------------------------------------------------------------------ stats and close
    def stats(self) -> dict[str, dict[str, TierUsage]]:
        out: dict[str, dict[str, TierUsage]] = {}
        cache = self.cache
        groups = {g.gid: g for g in cache._groups.values()}
        for t in cache._seqs.values():
            for s in t.segments:
                groups[s.group.gid] = s.group
        if self.host is not None:
            host = {m: TierUsage(capacity_bytes=self.host.capacity_bytes) for m in cache.cfg.modalities}
            out["host"] = host
        if self.disk is not None:
            disk = {m: TierUsage(capacity_bytes=self.disk.capacity_bytes) for m in cache.cfg.modalities}
            out["disk"] = disk
        for g in groups.values():
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

    def close(self) -> None:
        if self.mover is not None:
            self.mover.close(timeout=WAIT_S)
        self.apply_completions()
        if self.host is not None:
            self.host.close()
        if self.disk is not None:
            self.disk.close()
        self.staging.clear()
