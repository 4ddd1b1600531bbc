"""Tier movement of a ``TieredKVCache``: making room and freeing groups, what the lower tiers call
back (``GroupOwner``), leases, ``read_group`` (export), inventory, ``flush``, ``prefetch`` and the
promotion of a lower-tier group to the device. A part of ``TieredKVCache`` (this class is one of
its bases), kept in its own file.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import torch

from .content import ContentKey
from .errors import CapacityError, CorruptDataError, ShapeError
from .groups import ModalityGroup, Tier
from .leases import Lease
from .page_copies import check_out_kv, pages_into_kv, view_runs
from .pool import PagePool
from .residency import WAIT_S


class TierAPI:
    """Residency, eviction callbacks, leases and export over ``TieredKVCache``'s own state (its
    lock, pools, group index, policy, room and lower tiers)."""

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

    def read_group(self, key: ContentKey, *, lease: Lease | None = None,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A stored group's ``(k, v)`` ``[num_layers, n, num_kv_heads, head_dim]``, from whichever
        tier holds it (export, transfer to another node): new CPU tensors, or ``out`` (two
        tensors of that shape and dtype, any device and strides, or block-split ``[num_layers,
        n / page_size, page_size, num_kv_heads, head_dim]`` for a group of whole pages: an
        engine's staging in its own block layout), which is returned. The pages
        are copied once, run by run, straight into the result (a disk group is read into a
        reused staging buffer first). With a ``lease``, the copy is returned only if the lease
        was still live when it finished (``LeaseExpiredError`` otherwise): memory reused
        meanwhile is never returned."""
        return self._export([key], [out] if out is not None else None, lease)[0]

    def read_groups(self, keys: Sequence[ContentKey], *,
                    out: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``read_group`` of several groups in one call: the disk reads all start first and run
        side by side (the mover's workers, up to ``max_inflight_bytes``), the groups in memory
        are copied meanwhile. ``out``: one ``(k, v)`` pair per key, or ``None``."""
        if out is not None and len(out) != len(keys):
            raise ShapeError(f"{len(out)} out pairs for {len(keys)} keys")
        return self._export(list(keys), list(out) if out is not None else None, None)

    def _export(self, keys: list[ContentKey], out: list | None, lease: Lease | None) -> list:
        specs = [self._check_key(key, "kv") for key in keys]
        with self._lock:
            self._open()
            self.lower.apply_completions()
            groups = [self._require(key) for key in keys]
            if lease is not None:
                self.leases.check(lease)
            shapes = [(s.num_layers, g.num_tokens, s.num_kv_heads, s.head_dim) for s, g in zip(specs, groups)]
            if out is not None:            # all checked before anything is read or counted
                dests = [check_out_kv(o, shape, s.torch_dtype, s.page_size) for o, shape, s in zip(out, shapes, specs)]
            else:
                dests = [(torch.empty(shape, dtype=s.torch_dtype), torch.empty(shape, dtype=s.torch_dtype))
                         for shape, s in zip(shapes, specs)]
            on_disk = [i for i, g in enumerate(groups) if g.tier == Tier.DISK]
            for i in on_disk:
                groups[i].pins += 1        # nothing removes their files while they are read
            reads: dict[int, tuple] = {}
            try:
                for i in on_disk:
                    reads[i] = self._start_disk_read(groups[i])
                for i, g in enumerate(groups):           # the lock is held throughout: in place
                    if i in reads:
                        continue
                    if g.tier == Tier.DEVICE:
                        pages_into_kv(view_runs(self.pools[g.modality].view, g.pages), *dests[i])
                    else:
                        self._copy_host_checked(g, *dests[i])
                for i in on_disk:
                    buf, pages, fut = reads[i]
                    if self.wait(fut) is None:           # lets go of the lock while it waits
                        self.counters.add("corrupt_reads", groups[i].modality)
                        self._forget_corrupt(groups[i])
                        raise CorruptDataError(f"{groups[i]!r}: stored copy missing or failed verification "
                                               "(a miss)")
                    pages_into_kv([pages], *dests[i])
            finally:
                for buf, _, fut in reads.values():
                    if fut.done():
                        self.lower.staging.give(buf)
                    else:                                # a failed wait: the read may still land
                        fut.add_done_callback(lambda _f, b=buf: self.lower.staging.give(b))
                for i in on_disk:
                    groups[i].pins -= 1
                    self._settle(groups[i])
            if lease is not None:
                self.leases.check(lease)
            for key, g in zip(keys, groups):
                g.hits += 1
                self.policy.on_access(g)
                self.counters.add("exports", key.modality)
        return dests

    def _copy_host_checked(self, group: ModalityGroup, k: torch.Tensor, v: torch.Tensor) -> None:
        """A host group's tokens into ``k, v``, page by page, each page checked against its
        digest just before its copy (``HostEntry.checked_pages``: the copy reads it from the
        CPU's cache). On a mismatch the group is a miss from now on (``_host_corrupt``) and
        ``CorruptDataError`` is raised; ``k, v`` then hold only the verified pages before it,
        never a byte of the bad one. (Measured on the benchmark's 2 MiB pages: 1.08x the bare
        copy against 1.23x for a whole check first, on a quiet machine.)"""
        try:
            pages_into_kv(group.location.checked_pages(), k, v)
        except CorruptDataError:
            self._host_corrupt(group)
            raise

    def _verified_host(self, group: ModalityGroup):
        """The group's host entry after checking every page against its digest; on a
        mismatch the group is a miss from now on (``_host_corrupt``) and ``CorruptDataError``
        is raised, never wrong KV."""
        entry = group.location
        try:
            entry.verify()
        except CorruptDataError:
            self._host_corrupt(group)
            raise
        return entry

    def _host_corrupt(self, group: ModalityGroup) -> None:
        """The host copy failed its checksums: counted, dropped, the group forgotten."""
        self.counters.add("corrupt_reads", group.modality)
        self.counters.add("host_corrupt_reads", group.modality)
        if self.lower.host is not None:
            self.lower.host.remove(self.lower.storage_key(group))
        self._forget_corrupt(group)

    def _start_disk_read(self, group: ModalityGroup) -> tuple:
        """Start reading a (pinned) disk group's verified pages into a staging buffer:
        ``(buffer, pages view, future)``; the future resolves to the pages or ``None``."""
        spec, n = group.spec, group.num_pages
        buf = self.lower.staging.take(n * spec.page_bytes)
        pages = self.lower.staging.pages(buf, n, tuple(spec.page_shape), spec.torch_dtype)
        try:
            return buf, pages, self.lower.read_disk_async(group, out=pages)
        except BaseException:
            self.lower.staging.give(buf)
            raise

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
            if group.tier == Tier.HOST:
                self._verified_host(group)
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
            runs = view_runs(self.pools[group.modality].view, group.pages)
            return runs[0].clone() if len(runs) == 1 else torch.cat(runs)
        if group.tier == Tier.HOST:
            runs = self._verified_host(group).runs()
            return runs[0].clone() if len(runs) == 1 else torch.cat(runs)
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

class _Moved(Exception):
    """A group changed tier while the lock was let go (internal to ``_promote``)."""
