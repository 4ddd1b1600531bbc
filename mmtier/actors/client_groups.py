"""Shared groups through a ``ClusterCache``: ``contains`` / ``locate`` (batched registry lookups),
``put`` / ``put_embedding`` (stored once in the cluster, claimed in the registry first),
``get_embedding`` and ``offload`` (a group moved to its nodes' stores). A part of
``ClusterCache`` (this class is one of its bases), kept in its own file.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..content import ContentKey
from ..errors import HolderLostError, UnknownKeyError
from .client_calls import _info_dict
from .registry import Location


class GroupOps:
    """Content-keyed groups over ``ClusterCache``'s own state (its registry handle and the
    holders it knows)."""

    async def contains_async(self, key: ContentKey) -> bool:
        self._check_key(key)
        loc = (await self._lookup([key]))[0]
        self.metrics.hit(key.modality, loc is not None)
        return loc is not None

    async def contains_many_async(self, keys: Sequence[ContentKey]) -> list[bool]:
        """One registry call for many keys."""
        for k in keys:
            self._check_key(k)
        return [loc is not None for loc in await self._lookup(keys)]

    async def locate_many_async(self, keys: Sequence[ContentKey]) -> list[Location | None]:
        """Where each group lives (``None``: nowhere), in one registry call."""
        for k in keys:
            self._check_key(k)
        return await self._lookup(keys) if keys else []

    async def locate_async(self, key: ContentKey) -> Location | None:
        self._check_key(key)
        return (await self._lookup([key]))[0]

    async def put_async(self, key: ContentKey, k: torch.Tensor, v: torch.Tensor, *,
                        node: str | None = None) -> bool:
        """Store a group once in the cluster; ``False`` when some actor already holds it."""
        self._check_key(key, "kv")
        k, v = k.detach().cpu(), v.detach().cpu()
        return await self._put(key, node, "put", k, v)

    async def put_embedding_async(self, key: ContentKey, x: torch.Tensor, *, node: str | None = None) -> bool:
        self._check_key(key, "embedding")
        return await self._put(key, node, "put_embedding", x.detach().cpu())

    async def _put(self, key: ContentKey, node: str | None, method: str, *payload) -> bool:
        wire = key.to_wire()
        status = await self._call(self._registry.claim.remote(key.hex, self._id, wire))
        if status == "pending":           # another client is storing it: wait for that put
            wait = self.settings.lease_ttl_s
            loc = await self._call(self._registry.wait_held.remote(key.hex, wait),
                                   timeout=wait + self.settings.call_timeout_s)
            if loc is not None:
                return False
            status = await self._call(self._registry.claim.remote(key.hex, self._id, wire))
        if status != "granted":
            return False
        target = self._least_used(self.pools(node)) if node is not None and self.pools(node) \
            else self._default_home()
        try:
            item, evicted = await self._call(getattr(self._actor(target), method).remote(wire, *payload), target)
        except BaseException:
            self._registry.unclaim.remote(key.hex, self._id)
            raise
        self._forget_evicted(target, evicted)
        if item is None:
            self._registry.unclaim.remote(key.hex, self._id)
            return False
        await self._call(self._registry.add.remote(target, [item], _info_dict(self._info[target])))
        return True

    async def get_embedding_async(self, key: ContentKey) -> torch.Tensor:
        self._check_key(key, "embedding")
        loc = (await self._lookup([key]))[0]
        self.metrics.hit(key.modality, loc is not None)
        if loc is None:
            raise UnknownKeyError(f"{key!r} is not in the cluster cache (put it first)")
        for holder, _tier in loc.holders:
            if holder not in self._actors or self._info[holder].kind != "pool":
                continue
            try:
                return await self._call(self._actors[holder].get_embedding.remote(key.to_wire()), holder)
            except HolderLostError:
                continue
        raise HolderLostError(f"{key!r}: no live holder")

    async def offload_async(self, key: ContentKey) -> bool:
        """Move a group from its pools to their nodes' stores (outlives the pool actors)."""
        self._check_key(key, "kv")
        loc = (await self._lookup([key]))[0]
        if loc is None:
            return False
        moved = False
        for holder, _ in loc.holders:
            info = self._info.get(holder)
            if info is None or info.kind != "pool" or not self.stores(info.node):
                continue
            store = self.stores(info.node)[0]
            await self._copy(key, loc, holder, store)
            dropped = await self._call(self._actors[holder].drop.remote([key.to_wire()]), holder)
            self._forget_evicted(holder, dropped)
            moved = moved or bool(dropped)
        return moved
