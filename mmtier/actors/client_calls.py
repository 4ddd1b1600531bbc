"""How ``ClusterCache`` reaches the actors: their handles (``refresh``, ``pools``, ``stores``),
one call with a timeout whose typed errors come back as themselves, a holder found dead
(forgotten here and in the registry), registry lookups and removals. A part of ``ClusterCache``
(this class is one of its bases), kept in its own file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import ray

from ..content import ContentKey
from ..errors import HolderLostError, MMTierError
from .launch import POOL_PREFIX, STORE_PREFIX
from .registry import HolderInfo, Location


class ActorCalls:
    """Actor handles and calls over ``ClusterCache``'s own state (its settings, registry handle,
    event loop and the holders it knows)."""

    def refresh(self) -> list[str]:
        """Look the pool and store actors up again (after ``start()`` added nodes)."""
        s = self.settings
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == s.namespace and a["name"].startswith((POOL_PREFIX, STORE_PREFIX))]
        with self._state_lock:
            for name in names:
                if name in self._actors:
                    continue
                try:
                    self._actors[name] = ray.get_actor(name, namespace=s.namespace)
                except ValueError:
                    continue
                node = name.split(":")[1]
                self._info[name] = HolderInfo(name, node, "pool" if name.startswith(POOL_PREFIX) else "store")
            return sorted(self._actors)

    def pools(self, node: str | None = None) -> list[str]:
        return sorted(n for n, i in self._info.items() if i.kind == "pool" and (node is None or i.node == node))

    def stores(self, node: str | None = None) -> list[str]:
        return sorted(n for n, i in self._info.items() if i.kind == "store" and (node is None or i.node == node))

    def _run(self, coro):
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout=self.settings.call_timeout_s * 4)

    async def _call(self, ref, holder: str | None = None, timeout: float | None = None):
        """Await one actor call with a timeout; typed errors come back as themselves."""
        try:
            return await asyncio.wait_for(ref, timeout or self.settings.call_timeout_s)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, MMTierError):
                raise cause from None
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.ObjectLostError) as exc:
            if holder is None:
                raise
            await self._lost(holder)
            raise HolderLostError(f"{holder} is gone ({type(exc).__name__})") from None
        except asyncio.TimeoutError:
            if holder is None:
                raise
            raise HolderLostError(f"{holder} did not answer within the timeout") from None

    async def _lost(self, holder: str) -> None:
        """A holder died: forget it here and in the registry (its holdings leave at once) —
        unless ``start()`` already recreated an actor under that name: then this client takes
        the new handle and leaves the registry alone (the new actor announced its own holdings;
        what the dead one held in memory is gone either way, and the failed call said so)."""
        with self._state_lock:
            old = self._actors.pop(holder, None)
            info = self._info.pop(holder, None)
        try:
            new = await asyncio.to_thread(ray.get_actor, holder, self.settings.namespace)
        except ValueError:
            new = None
        if new is not None and old is not None and new._actor_id != old._actor_id:
            with self._state_lock:
                self._actors[holder] = new
                self._info[holder] = info or HolderInfo(
                    holder, holder.split(":")[1], "pool" if holder.startswith(POOL_PREFIX) else "store")
            return
        await asyncio.wait_for(self._registry.drop_holder.remote(holder), self.settings.call_timeout_s)

    def _actor(self, name: str):
        a = self._actors.get(name)
        if a is None:
            raise HolderLostError(f"{name} is gone")
        return a

    async def _lookup(self, keys: Sequence[ContentKey]) -> list[Location | None]:
        return await self._call(self._registry.lookup.remote([k.hex for k in keys]))

    def _forget_evicted(self, holder: str, digests: list[str]) -> None:
        if digests:
            self._registry.remove.remote(holder, digests)     # ordered after our earlier calls


def _info_dict(info: HolderInfo) -> dict[str, str]:
    return {"name": info.name, "node": info.node, "kind": info.kind}
