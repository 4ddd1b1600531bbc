"""Where a group lives, one class a tier: ``DevicePlace``, ``HostPlace``, ``DiskPlace`` each own
that tier's half of what ``Residency`` and ``LowerTiers`` do to a group there (the mechanism):
read its pages (verified), copy it out into K and V destinations, release or forget its storage
there, remove a staged copy, copy it into device pages when it is promoted. ``tier_places``
builds the ``Tier -> place`` mapping they dispatch through; which tier and when (the policy)
stays with them. Called with the cache's lock held; a disk read lets go of it where it always
did (``DiskPlace.read_pinned``, the group pinned). The places know the lower tiers' stores only
through ``Stores`` and the owner of the groups only through ``PlaceOwner``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

import torch

from ..config import ModalitySpec
from ..content import ContentKey
from ..core.groups import ModalityGroup, Tier
from ..errors import CorruptDataError
from ..pages.copies import pages_into_kv, view_runs
from ..pages.pool import PagePool
from ..stats import Counters
from ..storage import DiskTier, HostTier
from ..storage.dest_pages import DestTokens, usable_tokens
from ..storage.page_digests import copy_out_verified
from ..storage.staging import StagingPool


class Stores(Protocol):
    """The lower tiers' stores, as the places use them (``lower.LowerTiers`` has them)."""

    host: HostTier | None
    disk: DiskTier | None
    staging: StagingPool
    counters: Counters

    @property
    def keeps_disk_copies(self) -> bool: ...

    def storage_key(self, group: ModalityGroup) -> ContentKey: ...

    def read_disk_async(self, group: ModalityGroup, out: torch.Tensor | DestTokens | None = None) -> Future: ...


class PlaceOwner(Protocol):
    """What the places ask of the cache that owns the groups (called with its lock held)."""

    def forget_corrupt(self, group: ModalityGroup) -> None:
        """A stored copy of the group failed verification: it is a miss from now on."""

    def wait(self, fut: Future) -> object:
        """The copy's result, waited for with the owner's lock let go (bounded in time); the
        completions that landed meanwhile are applied before it returns or raises."""

    def settle(self, group: ModalityGroup) -> None:
        """Release the storage of a freed group once nothing pins it."""


def tier_places(pools: dict[str, PagePool], stores: Stores, owner: PlaceOwner
                ) -> dict[Tier, DevicePlace | HostPlace | DiskPlace]:
    """The ``Tier -> place`` mapping of one cache."""
    return {Tier.DEVICE: DevicePlace(pools), Tier.HOST: HostPlace(stores, owner),
            Tier.DISK: DiskPlace(stores, owner)}


def _joined(runs: list[torch.Tensor]) -> torch.Tensor:
    return runs[0].clone() if len(runs) == 1 else torch.cat(runs)


class DevicePlace:
    """A group in device pages of its modality's pool."""

    def __init__(self, pools: dict[str, PagePool]):
        self.pools = pools

    def read_pages(self, group: ModalityGroup) -> torch.Tensor:
        """A copy of the group's pages ``[n, *page_shape]``."""
        return _joined(view_runs(self.pools[group.modality].view, group.pages))

    def copy_out(self, group: ModalityGroup, k: torch.Tensor, v: torch.Tensor) -> None:
        """The group's tokens into ``k, v`` (in place, the lock held)."""
        pages_into_kv(view_runs(self.pools[group.modality].view, group.pages), k, v)

    def release(self, group: ModalityGroup) -> None:
        """A freed, unpinned group's device pages go back to the pool."""
        if group.pages:
            self.pools[group.modality].free(group.pages)
            group.pages = []

    def forget(self, key: ContentKey) -> None:
        """Nothing of the group is kept on the device under ``key``."""


class HostPlace:
    """A group in host slab slots (``HostEntry``, its ``location``), read verified."""

    spill_counter = "spills_to_host"

    def __init__(self, stores: Stores, owner: PlaceOwner):
        self.stores, self.owner = stores, owner

    def read_pages(self, group: ModalityGroup) -> torch.Tensor:
        """A copy of the group's pages ``[n, *page_shape]``, every page checked first."""
        return _joined(self.verified(group).runs())

    def copy_out(self, group: ModalityGroup, k: torch.Tensor, v: torch.Tensor) -> None:
        """The group's tokens into ``k, v``, run by run (up to ``host.CHECK_BYTES`` of pages),
        each run's pages checked against their digests just before the run is copied
        (``HostEntry.checked_pages``: the copy reads them from the CPU's cache). On a mismatch
        the group is a miss from now on (``corrupt``) and ``CorruptDataError`` is raised;
        ``k, v`` then hold only verified runs before it, never a byte of the bad page's run.
        (Measured in one process at load 3.5-5: one page at a time 1.15-1.26x the bare copy,
        two pages 1.10-1.23x, the whole group checked first 1.27x.) Where the native helper is
        built, the copy checks each page itself (``page_digests.copy_out_verified``: the pages
        before the bad one land, the bad one's destination is poisoned, nothing after it)."""
        try:
            if not copy_out_verified(group.location, k, v):     # checked by the copy itself
                pages_into_kv(group.location.checked_pages(), k, v)
        except CorruptDataError:
            self.corrupt(group)
            raise

    def verified(self, group: ModalityGroup):
        """The group's host entry after checking every page against its digest; on a
        mismatch the group is a miss from now on (``corrupt``) and ``CorruptDataError``
        is raised, never wrong KV."""
        entry = group.location
        try:
            entry.verify()
        except CorruptDataError:
            self.corrupt(group)
            raise
        return entry

    def corrupt(self, group: ModalityGroup) -> None:
        """The host copy failed its checksums: counted, dropped, the group forgotten."""
        counters = self.stores.counters
        counters.add("corrupt_reads", group.modality)
        counters.add("host_corrupt_reads", group.modality)
        if self.stores.host is not None:
            self.stores.host.remove(self.stores.storage_key(group))
        self.owner.forget_corrupt(group)

    def promotion_source(self, group: ModalityGroup) -> None:
        """Check the group's pages before promotion (the copy itself reads the slots)."""
        self.verified(group)

    def copy_in(self, group: ModalityGroup, pool: PagePool, pages: list[int], src: None,
                key: ContentKey) -> None:
        """The host slots into device ``pages``; the host copy is removed."""
        group.location.copy_to(pool.view, pages, check=False)   # the owner verified it
        assert self.stores.host is not None
        self.stores.host.remove(key)

    def release(self, group: ModalityGroup) -> None:
        """Nothing to release here (``forget`` removes the host copy)."""

    def remove(self, key: ContentKey) -> None:
        """Remove the host copy under ``key`` (a staged one undone, or the group's own)."""
        if self.stores.host is not None:
            self.stores.host.remove(key)

    forget = remove


class DiskPlace:
    """A group in a file of the disk tier, read verified through the mover."""

    spill_counter = "spills_to_disk"

    def __init__(self, stores: Stores, owner: PlaceOwner):
        self.stores, self.owner = stores, owner

    def read_pages(self, group: ModalityGroup) -> torch.Tensor:
        """A copy of the group's pages ``[n, *page_shape]`` (lets go of the lock)."""
        return self.read_pinned(group)

    def read_pinned(self, group: ModalityGroup) -> torch.Tensor:
        """The disk group's verified pages, read with the lock let go and the group pinned
        (so nothing removes its file meanwhile); ``CorruptDataError`` (the group dropped) when
        the copy is missing or fails verification."""
        group.pins += 1
        try:
            pages = self.owner.wait(self.stores.read_disk_async(group))
        finally:
            group.pins -= 1
            self.owner.settle(group)
        if pages is None:
            self.stores.counters.add("corrupt_reads", group.modality)
            self.owner.forget_corrupt(group)
            raise CorruptDataError(f"{group!r}: stored copy missing or failed verification (a miss)")
        return pages

    def start_read(self, group: ModalityGroup, dest: tuple) -> tuple:
        """Start reading a (pinned) disk group's verified pages: straight into ``dest`` where it
        is token-major K and V on the CPU (``DestTokens``: one copy, from the file's bytes),
        ``(None, None, future)``; else into a staging buffer, ``(buffer, pages view, future)``,
        whose pages the caller copies into ``dest``. The future resolves to ``None`` on a miss."""
        spec, n = group.spec, group.num_pages
        staging = self.stores.staging
        tokens = token_dest(spec, n, *dest)
        if tokens is not None:
            return None, None, self.stores.read_disk_async(group, out=tokens)
        buf = staging.take(n * spec.page_bytes)
        pages = staging.pages(buf, n, tuple(spec.page_shape), spec.torch_dtype)
        try:
            return buf, pages, self.stores.read_disk_async(group, out=pages)
        except BaseException:
            staging.give(buf)
            raise

    def promotion_source(self, group: ModalityGroup) -> torch.Tensor:
        """The group's verified pages for promotion (lets go of the lock, the group pinned)."""
        return self.read_pinned(group)

    def copy_in(self, group: ModalityGroup, pool: PagePool, pages: list[int], src: torch.Tensor | None,
                key: ContentKey) -> None:
        """``src`` (read from disk) into device ``pages``; the file is removed, unless the
        write-behind keeps it (the group stays durable)."""
        assert src is not None and self.stores.disk is not None
        at = 0
        for run in view_runs(pool.view, pages):
            run.copy_(src[at:at + run.shape[0]])
            at += run.shape[0]
        if not self.stores.keeps_disk_copies:
            self.stores.disk.remove(key)

    def release(self, group: ModalityGroup) -> None:
        """Nothing to release here (``LowerTiers.forget`` removes the file)."""

    def remove(self, key: ContentKey) -> None:
        """Remove the file under ``key`` (a staged copy undone)."""
        if self.stores.disk is not None:
            self.stores.disk.remove(key)

    def forget(self, key: ContentKey) -> None:
        """Nothing beyond what ``LowerTiers.forget`` does for every tier (the file, unless a
        spill is in flight)."""


def token_dest(spec: ModalitySpec, n: int, k: object, v: object) -> DestTokens | None:
    """``k, v`` as the direct destination of a disk read of ``n`` pages, where they can be one:
    CPU tensors ``[L, T, H, D]`` (or block-split ``[L, T / P, P, H, D]`` over the same memory)
    with each layer's tokens contiguous; else ``None`` (staged)."""
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k is v:
        return None
    if k.dim() == 5:
        try:
            k, v = k.view(k.shape[0], -1, *k.shape[3:]), v.view(v.shape[0], -1, *v.shape[3:])
        except RuntimeError:              # strides a flat token view cannot take
            return None
    if not (usable_tokens(k, spec) and usable_tokens(v, spec)):
        return None
    return DestTokens(spec, k, v, n)
