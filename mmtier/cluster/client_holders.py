"""``Holders``: how a ``ClusterCache`` reaches the actors that hold content.

It owns the actor handles and what is known of each (``HolderInfo``: node, pool or store), the
registry handle and the client's event loop: ``refresh`` / ``pools`` / ``stores``, one call with
a timeout whose typed errors come back as themselves (``call``), a holder found dead (forgotten
here and in the registry, unless ``start()`` already replaced it), registry lookups and the
removal of what a holder evicted.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import ray

from ..content import ContentKey
from ..errors import HolderLostError, MMTierError
from .actors import POOL_PREFIX, STORE_PREFIX
from .registry import HolderInfo, Location
from .settings import ClusterSettings


class Holders:
    """The pool and store actors a client knows, and one way to call them."""

    def __init__(self, settings: ClusterSettings, registry: Any, loop: asyncio.AbstractEventLoop):
        self.settings = settings
        self.registry = registry
        self.loop = loop
        self.actors: dict[str, Any] = {}
        self.info: dict[str, HolderInfo] = {}
        self._lock = threading.Lock()

    def refresh(self) -> list[str]:
        """Look the pool and store actors up again (after ``start()`` added nodes)."""
        s = self.settings
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == s.namespace and a["name"].startswith((POOL_PREFIX, STORE_PREFIX))]
        with self._lock:
            for name in names:
                if name in self.actors:
                    continue
                try:
                    self.actors[name] = ray.get_actor(name, namespace=s.namespace)
                except ValueError:
                    continue
                self.info[name] = _holder_info(name)
            return sorted(self.actors)

    def pools(self, node: str | None = None) -> list[str]:
        return sorted(n for n, i in self.info.items() if i.kind == "pool" and (node is None or i.node == node))

    def stores(self, node: str | None = None) -> list[str]:
        return sorted(n for n, i in self.info.items() if i.kind == "store" and (node is None or i.node == node))

    def kind(self, name: str) -> str:
        """``pool`` or ``store`` (a holder no longer known counts as a pool)."""
        info = self.info.get(name)
        return info.kind if info is not None else "pool"

    def run(self, coro):
        """Run a coroutine on the client's loop and wait for it (the blocking twins)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout=self.settings.call_timeout_s * 4)

    async def call(self, ref, holder: str | None = None, timeout: float | None = None):
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
            await self.lost(holder)
            raise HolderLostError(f"{holder} is gone ({type(exc).__name__})") from None
        except asyncio.TimeoutError:
            if holder is None:
                raise
            raise HolderLostError(f"{holder} did not answer within the timeout") from None

    async def lost(self, holder: str) -> None:
        """A holder died: forget it here and in the registry (its holdings leave at once) —
        unless ``start()`` already recreated an actor under that name: then this client takes
        the new handle and leaves the registry alone (the new actor announced its own holdings;
        what the dead one held in memory is gone either way, and the failed call said so)."""
        with self._lock:
            old = self.actors.pop(holder, None)
            info = self.info.pop(holder, None)
        try:
            new = await asyncio.to_thread(ray.get_actor, holder, self.settings.namespace)
        except ValueError:
            new = None
        if new is not None and old is not None and new._actor_id != old._actor_id:
            with self._lock:
                self.actors[holder] = new
                self.info[holder] = info or _holder_info(holder)
            return
        await asyncio.wait_for(self.registry.drop_holder(holder), self.settings.call_timeout_s)

    def actor(self, name: str):
        a = self.actors.get(name)
        if a is None:
            raise HolderLostError(f"{name} is gone")
        return a

    def alive(self, names) -> list[str]:
        """Those of ``names`` this client can still call, in order."""
        return [n for n in names if n in self.actors]

    async def lookup(self, keys: Sequence[ContentKey]) -> list[Location | None]:
        return await self.call(self.registry.lookup([k.address for k in keys]))

    async def announce(self, holder: str, items: list) -> None:
        """Record in the registry that ``holder`` now holds ``items``."""
        await self.call(self.registry.add(holder, items, info_dict(self.info[holder])))

    def forget_evicted(self, holder: str, addresses: list[str]) -> None:
        if addresses:                         # also drops them from the client's lookup cache
            self.registry.remove(holder, addresses)     # ordered after our earlier calls


def _holder_info(name: str) -> HolderInfo:
    return HolderInfo(name, name.split(":")[1], "pool" if name.startswith(POOL_PREFIX) else "store")


def info_dict(info: HolderInfo) -> dict[str, str]:
    return {"name": info.name, "node": info.node, "kind": info.kind}
