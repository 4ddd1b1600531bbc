"""``SharedGroups``: content-keyed groups through a ``ClusterCache``: ``contains`` / ``locate``
(batched registry lookups), ``put`` / ``put_embedding`` (stored once in the cluster, claimed in
the registry first), ``get_embedding`` and ``offload`` (a group moved to its nodes' stores)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..content import ContentKey
from ..errors import HolderLostError, UnknownKeyError
from .client_holders import Holders
from .client_keys import ClusterKeys
from .client_sequences import SequenceBook
from .metrics import ClientMetrics
from .registry import Location
from .settings import ClusterSettings
from .transfer_copies import GroupCopier


class SharedGroups:
    def __init__(self, settings: ClusterSettings, keys: ClusterKeys, holders: Holders, book: SequenceBook,
                 copier: GroupCopier, metrics: ClientMetrics, client_id: str):
        self.settings = settings
        self.keys = keys
        self.holders = holders
        self.book = book                      # where a put goes when no node is named
        self.copier = copier
        self.metrics = metrics
        self.client_id = client_id            # this client's claims in the registry

    async def contains(self, key: ContentKey) -> bool:
        self.keys.check(key)
        loc = (await self.holders.lookup([key]))[0]
        self.metrics.hit(key.modality, loc is not None)
        return loc is not None

    async def contains_many(self, keys: Sequence[ContentKey]) -> list[bool]:
        """One registry call for many keys."""
        for k in keys:
            self.keys.check(k)
        return [loc is not None for loc in await self.holders.lookup(keys)]

    async def locate_many(self, keys: Sequence[ContentKey]) -> list[Location | None]:
        """Where each group lives (``None``: nowhere), in one registry call."""
        for k in keys:
            self.keys.check(k)
        return await self.holders.lookup(keys) if keys else []

    async def locate(self, key: ContentKey) -> Location | None:
        self.keys.check(key)
        return (await self.holders.lookup([key]))[0]

    async def put(self, key: ContentKey, k: torch.Tensor, v: torch.Tensor, *, node: str | None = None) -> bool:
        """Store a group once in the cluster; ``False`` when some actor already holds it."""
        self.keys.check(key, "kv")
        return await self._put(key, node, "put", k.detach().cpu(), v.detach().cpu())

    async def put_embedding(self, key: ContentKey, x: torch.Tensor, *, node: str | None = None) -> bool:
        self.keys.check(key, "embedding")
        return await self._put(key, node, "put_embedding", x.detach().cpu())

    async def _put(self, key: ContentKey, node: str | None, method: str, *payload) -> bool:
        h, registry, wire = self.holders, self.holders.registry, key.to_wire()
        status = await h.call(registry.claim(key.address, self.client_id, wire))
        if status == "pending":           # another client is storing it: wait for that put
            wait = self.settings.lease_ttl_s
            loc = await h.call(registry.wait_held(key.address, wait), timeout=wait + self.settings.call_timeout_s)
            if loc is not None:
                return False
            status = await h.call(registry.claim(key.address, self.client_id, wire))
        if status != "granted":
            return False
        target = self.book.least_used(h.pools(node)) if node is not None and h.pools(node) \
            else self.book.default_home()
        try:
            item, evicted = await h.call(getattr(h.actor(target), method).remote(wire, *payload), target)
        except BaseException:
            registry.unclaim(key.address, self.client_id)
            raise
        h.forget_evicted(target, evicted)
        if item is None:
            registry.unclaim(key.address, self.client_id)
            return False
        await h.announce(target, [item])
        return True

    async def get_embedding(self, key: ContentKey) -> torch.Tensor:
        self.keys.check(key, "embedding")
        h = self.holders
        loc = (await h.lookup([key]))[0]
        self.metrics.hit(key.modality, loc is not None)
        if loc is None:
            raise UnknownKeyError(f"{key!r} is not in the cluster cache (put it first)")
        contradicted = False
        for holder, _tier in loc.holders:
            if holder not in h.actors or h.kind(holder) != "pool":
                continue
            try:           # the holder answers for the full key only: a stale location is a miss
                return await h.call(h.actors[holder].get_embedding.remote(key.to_wire()), holder)
            except HolderLostError:
                continue
            except UnknownKeyError:
                h.forget_evicted(holder, [key.address])
                contradicted = True
        if contradicted:
            raise UnknownKeyError(f"{key!r} left its holders (a stale location: a miss)")
        raise HolderLostError(f"{key!r}: no live holder")

    async def offload(self, key: ContentKey) -> bool:
        """Move a group from its pools to their nodes' stores (outlives the pool actors)."""
        self.keys.check(key, "kv")
        h = self.holders
        loc = (await h.lookup([key]))[0]
        if loc is None:
            return False
        moved = False
        for holder, _ in loc.holders:
            info = h.info.get(holder)
            if info is None or info.kind != "pool" or not h.stores(info.node):
                continue
            store = h.stores(info.node)[0]
            await self.copier.copy(key, loc, holder, store)
            dropped = await h.call(h.actors[holder].drop.remote([key.to_wire()]), holder)
            h.forget_evicted(holder, dropped)
            moved = moved or bool(dropped)
        return moved
