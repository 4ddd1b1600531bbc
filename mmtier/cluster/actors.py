"""The Ray edge: each actor wraps one plain class, and the names it goes by.

``PagePoolActor`` wraps ``pool.PoolService`` (a device's cache, its arena resolved on its node),
``NodeStoreActor`` wraps ``store.NodeStoreService`` (a node's host and disk tiers),
``ContentRegistryActor`` wraps ``registry.ContentRegistry`` (and adds the liveness sweep, the
rebuild after a restart and the waits for a claimed group). Holders are named
``mmtier-pool:<node id>:<kind><i>`` and ``mmtier-store:<node id>`` in the namespace (their disk
folders follow the node's stable label when it has one: ``node_labels``); a holder
tells the registry it (re)started with its inventory and, with ``report_lost``, what it found
corrupt. ``launch`` creates these actors and removes them; nothing else calls ``ray.remote`` on
them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import ray

from ..config import CacheConfig
from ..pages.gpu_memory import free_bytes
from .metrics import ActorMetrics
from .node_labels import node_folder
from .pool import PoolService
from .registry import ContentRegistry, HolderInfo
from .registry_shards import RegistryShards, item_address, shard_of
from .settings import ClusterSettings
from .store import NodeStoreService
from .transfer import export_to_object_store

log = logging.getLogger(__name__)

POOL_PREFIX = "mmtier-pool:"
STORE_PREFIX = "mmtier-store:"


def pool_name(node_id: str, kind: str, index: int) -> str:
    return f"{POOL_PREFIX}{node_id}:{kind}{index}"


def store_name(node_id: str) -> str:
    return f"{STORE_PREFIX}{node_id}"


def pool_config(base: CacheConfig, name: str, device: str, settings: ClusterSettings,
                label: str | None = None) -> CacheConfig:
    """The config of one device's pool (an actor's or an engine's embedded one): no host tier
    (the node store has one); its own disk tier when the config has one, so device pressure
    demotes groups to disk instead of dropping them; the arena on ``device``."""
    disk = None if base.disk_dir is None else pool_dir(base.disk_dir, name, label)
    update: dict[str, Any] = {"host_bytes": 0, "disk_dir": disk}
    if device == "cuda":
        update.update(device="cuda:0", device_bytes=base.device_bytes or _nvml_free_bytes(base))
    else:
        update.update(device="cpu", device_bytes=base.device_bytes if base.device == "cpu"
                      else settings.cpu_pool_bytes)
    return CacheConfig(**{**base.model_dump(), **update})


def pool_dir(disk_dir: Path, name: str, label: str | None = None) -> Path:
    """A pool's disk folder: ``node-<label>/pool-<kind><i>`` on a labelled node (found again when
    the node comes back with a new id), else ``pool-<pool name, sanitized>`` (by node id)."""
    if label:
        return node_folder(disk_dir, label) / f"pool-{_sanitize(name.rsplit(':', 1)[-1])}"
    return Path(disk_dir) / f"pool-{_sanitize(name)}"


class PagePoolActor(PoolService):
    """A pool on its node's device: resolves the arena there (NVML sees the physical GPU)."""

    def __init__(self, cfg_json: dict, name: str, node: str, device: str, settings_json: dict,
                 label: str | None = None):
        settings = ClusterSettings(**settings_json)
        self.settings = settings
        super().__init__(pool_config(CacheConfig(**cfg_json), name, device, settings, label),
                         name=name, node=node)
        self.metrics = ActorMetrics(name)
        self.on_lost = lambda digests: report_lost(settings, name, digests)
        _announce(settings, super().ping(), self.inventory())   # empty, or adopted from disk

    def ping(self) -> dict[str, str]:
        if self.metrics.due():                       # the registry's sweep drives publishing
            self.metrics.publish(self.stats())
        return super().ping()

    def pid(self) -> int:
        """This actor's OS process (what an operator, or a crash test, signals)."""
        return os.getpid()

    def export(self, wire: dict[str, str]) -> tuple[dict, np.ndarray]:
        return export_to_object_store(self, wire)


class NodeStoreActor(NodeStoreService):
    def __init__(self, cfg_json: dict, name: str, node: str, settings_json: dict,
                 label: str | None = None):
        settings = ClusterSettings(**settings_json)
        cfg = CacheConfig(**cfg_json)
        super().__init__(cfg, name=name, node=node,
                         capacity_bytes=cfg.host_bytes or settings.store_bytes, label=label)
        self.settings = settings
        self.metrics = ActorMetrics(name)
        self.on_lost = lambda digests: report_lost(settings, name, digests)
        _announce(settings, super().ping(), self.inventory())   # empty, or adopted from disk

    def ping(self) -> dict[str, str]:
        if self.metrics.due():
            self.metrics.publish(self.tier_stats())
        return super().ping()

    def pid(self) -> int:
        """This actor's OS process (what an operator, or a crash test, signals)."""
        return os.getpid()


class ContentRegistryActor:
    """Async actor around ``ContentRegistry``: liveness sweep, rebuild after restart, waits."""

    def __init__(self, cfg_json: dict, settings_json: dict, shard: int = 0):
        self.cfg_json = cfg_json
        self.settings = ClusterSettings(**settings_json)
        self.shard = shard                       # this actor's part of the index (``shard_of``)
        self.reg = ContentRegistry(sweep_misses=self.settings.sweep_misses)
        self._ready: asyncio.Future | None = None
        self._sweeper: asyncio.Task | None = None
        self._waiters: dict[str, asyncio.Event] = {}
        self._handles: dict[str, Any] = {}

    async def _started(self) -> None:
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._rebuild())
            self._sweeper = asyncio.ensure_future(self._sweep_forever())
        await asyncio.wait_for(asyncio.shield(self._ready), self.settings.call_timeout_s)

    async def _rebuild(self) -> None:
        """Ask every live holder actor for its inventory (after a start or a restart)."""
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == self.settings.namespace
                 and a["name"].startswith((POOL_PREFIX, STORE_PREFIX))]

        async def one(name: str) -> None:
            h = self._handle(name)
            if h is None:
                return
            try:
                info = await asyncio.wait_for(h.ping.remote(), self.settings.ping_timeout_s * 5)
                inv = await asyncio.wait_for(h.inventory.remote(), self.settings.call_timeout_s)
            except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
                log.warning("registry rebuild: %s did not answer (%s)", name, type(exc).__name__)
                return
            n, place = self.settings.registry_shards, self.settings.registry_placement
            inv = [it for it in inv if shard_of(item_address(it), n, place) == self.shard]
            self.reg.sync_holder(HolderInfo(**info), inv)
            self._wake(item["key"]["digest"] for item in inv)

        await asyncio.gather(*(one(n) for n in names))

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)      # a timer, not a poll
            self.reg.expire_claims()
            await asyncio.gather(*(self._ping(i.name) for i in self.reg.holders()))

    async def _ping(self, name: str) -> None:
        h = self._handle(name)
        if h is None:                                # no such actor any more
            self.reg.drop_holder(name)
            return
        try:
            await asyncio.wait_for(h.ping.remote(), self.settings.ping_timeout_s)
        except asyncio.TimeoutError:
            if self.reg.note_miss(name):
                self._handles.pop(name, None)
                log.warning("registry: %s missed %d pings; its holdings are dropped", name,
                            self.settings.sweep_misses)
        except ray.exceptions.RayError:
            if self._handles.get(name) is not h:
                return                  # a new incarnation announced itself meanwhile: keep it
            self.reg.drop_holder(name)
            self._handles.pop(name, None)
        else:
            self.reg.note_alive(name)

    def _handle(self, name: str):
        h = self._handles.get(name)
        if h is None:
            try:
                h = self._handles[name] = ray.get_actor(name, namespace=self.settings.namespace)
            except ValueError:
                return None
        return h

    def _wake(self, digests) -> None:
        for d in digests:
            ev = self._waiters.pop(d, None)
            if ev is not None:
                ev.set()

    # ---- the registry's remote interface ----
    async def config(self) -> dict:
        return self.cfg_json

    async def sync_holder(self, info: dict, inventory: list[dict]) -> None:
        await self._started()
        self._handles.pop(info["name"], None)        # a (re)started holder: look it up afresh
        self.reg.sync_holder(HolderInfo(**info), inventory)
        self._wake(item["key"]["digest"] for item in inventory)

    async def add(self, holder: str, items: list[dict], info: dict | None = None) -> None:
        await self._started()
        self.reg.add(holder, items, HolderInfo(**info) if info else None)
        self._wake(item["key"]["digest"] for item in items)

    async def publish(self, holder: str, items: list[dict], removed: list[str], info: dict) -> None:
        """An embedded pool's turn, in one call: groups it now holds, groups it no longer holds."""
        await self._started()
        self.reg.add(holder, items, HolderInfo(**info))
        self.reg.remove(holder, removed)
        self._wake(item["key"]["digest"] for item in items)

    async def remove(self, holder: str, digests: list[str]) -> int:
        await self._started()
        return self.reg.remove(holder, digests)

    async def drop_holder(self, name: str) -> list[str]:
        await self._started()
        self._handles.pop(name, None)
        return self.reg.drop_holder(name)

    async def lookup(self, digests: list[str]):
        await self._started()
        return self.reg.lookup(digests)

    async def ref(self, digests: list[str], delta: int) -> None:
        await self._started()
        self.reg.ref(digests, delta)

    async def claim(self, digest: str, claimant: str, wire: dict | None = None) -> str:
        await self._started()
        return self.reg.claim(digest, claimant, self.settings.lease_ttl_s, wire)

    async def unclaim(self, digest: str, claimant: str) -> None:
        await self._started()
        self.reg.unclaim(digest, claimant)
        self._wake([digest])

    async def wait_held(self, digest: str, timeout_s: float):
        """The group's ``Location`` once someone holds it, or ``None`` after ``timeout_s``."""
        await self._started()
        loc = self.reg.lookup([digest])[0]
        if loc is not None:
            return loc
        ev = self._waiters.setdefault(digest, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass                                  # a timed-out wait answers "not held"
        return self.reg.lookup([digest])[0]

    async def holders(self) -> list[HolderInfo]:
        await self._started()
        return self.reg.holders()

    async def stats(self) -> dict[str, int]:
        await self._started()
        return self.reg.stats()

    async def ping(self) -> str:
        return "ok"


def _registry(settings: ClusterSettings) -> RegistryShards | None:
    """The registry's shards, or ``None`` when one is not up (the callers' messages are hints;
    a shard that starts later rebuilds itself from the inventories)."""
    try:
        return RegistryShards(settings)
    except ValueError:
        return None


def _announce(settings: ClusterSettings, info: dict, inventory: list[dict]) -> None:
    """Tell the registry this holder (re)started with this inventory; fire and forget."""
    reg = _registry(settings)
    if reg is not None:
        reg.sync_holder(info, inventory)


def report_lost(settings: ClusterSettings, holder: str, digests: list[str]) -> None:
    """Tell the registry ``holder`` lost these groups (a corrupt disk copy); fire and forget."""
    reg = _registry(settings)
    if reg is not None:
        reg.remove(holder, digests)


def _sanitize(name: str) -> str:
    """An actor name as a directory name (``mmtier-pool:<node>:dev0`` -> ``mmtier-pool_<node>_dev0``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _nvml_free_bytes(cfg: CacheConfig) -> int:
    """``cfg.device_fraction`` of the free memory of this actor's GPU (``cuda:0`` under the
    ``CUDA_VISIBLE_DEVICES`` Ray set for it, mapped to the physical GPU)."""
    return int(free_bytes("cuda:0") * cfg.device_fraction)
