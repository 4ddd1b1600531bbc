"""Start and stop mmtier on a running Ray cluster: the one place where actors are created.

``start(cfg)`` is idempotent. It creates what is missing, by deterministic name in namespace
``mmtier``:

- ``mmtier-registry``: the ContentRegistry (detached, ``max_restarts=-1``, calls retried across
  restarts; rebuilds its state from the holders' inventories after a restart);
- per alive node, ``mmtier-store:<node id>``: the NodeStoreActor (pinned to the node);
- per unit of ``settings.device_resource`` on a node, ``mmtier-pool:<node id>:gpu<i>`` (or
  ``dev<i>`` for a custom resource standing in for GPUs): a PagePoolActor pinned to the node;
  a node with no such resource gets one CPU pool ``mmtier-pool:<node id>:cpu0``.

Nodes that join later: run ``start()`` again; it adds actors for the new nodes and leaves the
existing ones untouched (``StartReport.created`` / ``existing`` say which). Actors of a node
that died are gone with it (pool and store actors are pinned, ``soft=False``); ``start()`` never
recreates them elsewhere. ``shutdown()`` kills every mmtier actor.

Tiers on the cluster (when ``cfg.disk_dir`` is set; without it pools drop under pressure and
stores keep host memory only, as before): each pool's ``TieredKVCache`` gets a disk tier of its
own, ``disk_dir / "pool-<pool name, sanitized>"`` (no host tier: ``host_bytes=0``), so device
pressure moves unreferenced groups to disk whole instead of dropping them; each node store puts
``disk_dir / "store-<node id>"`` behind its host tier. A pool or store recreated on the same
node (``start()`` after a kill) adopts the groups in its directory and announces them to the
registry with its inventory; a holder that finds a corrupt copy tells the registry with
``report_lost`` (the pool and store actors here, and ``PoolHost``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..config import CacheConfig
from ..errors import ConfigError
from ..pages.gpu_memory import free_bytes
from .metrics import ActorMetrics
from .node_store import NodeStoreService
from .pool_actor import PoolService
from .registry import ContentRegistry, HolderInfo
from .settings import ClusterSettings
from .transfer import export_to_object_store

log = logging.getLogger(__name__)

POOL_PREFIX = "mmtier-pool:"
STORE_PREFIX = "mmtier-store:"


def pool_name(node_id: str, kind: str, index: int) -> str:
    return f"{POOL_PREFIX}{node_id}:{kind}{index}"


def store_name(node_id: str) -> str:
    return f"{STORE_PREFIX}{node_id}"


@dataclass
class StartReport:
    """What ``start`` found and made: actor names, and the nodes it covered."""

    registry: str
    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------- actor classes (the edge)
def pool_config(base: CacheConfig, name: str, device: str, settings: ClusterSettings) -> CacheConfig:
    """The config of one device's pool (an actor's or an engine's embedded one): no host tier
    (the node store has one); its own disk tier when the config has one, so device pressure
    demotes groups to disk instead of dropping them; the arena on ``device``."""
    disk = None if base.disk_dir is None else base.disk_dir / f"pool-{_sanitize(name)}"
    update: dict[str, Any] = {"host_bytes": 0, "disk_dir": disk}
    if device == "cuda":
        update.update(device="cuda:0", device_bytes=base.device_bytes or _nvml_free_bytes(base))
    else:
        update.update(device="cpu", device_bytes=base.device_bytes if base.device == "cpu"
                      else settings.cpu_pool_bytes)
    return CacheConfig(**{**base.model_dump(), **update})


class PagePoolActor(PoolService):
    """A pool on its node's device: resolves the arena there (NVML sees the physical GPU)."""

    def __init__(self, cfg_json: dict, name: str, node: str, device: str, settings_json: dict):
        settings = ClusterSettings(**settings_json)
        self.settings = settings
        super().__init__(pool_config(CacheConfig(**cfg_json), name, device, settings), name=name, node=node)
        self.metrics = ActorMetrics(name)
        self.on_lost = lambda digests: report_lost(settings, name, digests)
        _announce(settings, super().ping(), self.inventory())   # empty, or adopted from disk

    def ping(self) -> dict[str, str]:
        if self.metrics.due():                       # the registry's sweep drives publishing
            self.metrics.publish(self.stats())
        return super().ping()

    def export(self, wire: dict[str, str]) -> tuple[dict, np.ndarray]:
        return export_to_object_store(self, wire)


class NodeStoreActor(NodeStoreService):
    def __init__(self, cfg_json: dict, name: str, node: str, settings_json: dict):
        settings = ClusterSettings(**settings_json)
        cfg = CacheConfig(**cfg_json)
        super().__init__(cfg, name=name, node=node,
                         capacity_bytes=cfg.host_bytes or settings.store_bytes)
        self.settings = settings
        self.metrics = ActorMetrics(name)
        self.on_lost = lambda digests: report_lost(settings, name, digests)
        _announce(settings, super().ping(), self.inventory())   # empty, or adopted from disk

    def ping(self) -> dict[str, str]:
        if self.metrics.due():
            self.metrics.publish(self.tier_stats())
        return super().ping()


class ContentRegistryActor:
    """Async actor around ``ContentRegistry``: liveness sweep, rebuild after restart, waits."""

    def __init__(self, cfg_json: dict, settings_json: dict):
        self.cfg_json = cfg_json
        self.settings = ClusterSettings(**settings_json)
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


def _registry(settings: ClusterSettings):
    """The registry actor, or ``None`` when it is not up (the callers' messages are hints)."""
    try:
        return ray.get_actor(settings.registry_name, namespace=settings.namespace)
    except ValueError:
        return None


def _announce(settings: ClusterSettings, info: dict, inventory: list[dict]) -> None:
    """Tell the registry this holder (re)started with this inventory; fire and forget."""
    reg = _registry(settings)
    if reg is not None:
        reg.sync_holder.remote(info, inventory)


def report_lost(settings: ClusterSettings, holder: str, digests: list[str]) -> None:
    """Tell the registry ``holder`` lost these groups (a corrupt disk copy); fire and forget."""
    reg = _registry(settings)
    if reg is not None:
        reg.remove.remote(holder, digests)


def _sanitize(name: str) -> str:
    """An actor name as a directory name (``mmtier-pool:<node>:dev0`` -> ``mmtier-pool_<node>_dev0``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _nvml_free_bytes(cfg: CacheConfig) -> int:
    """``cfg.device_fraction`` of the free memory of this actor's GPU (``cuda:0`` under the
    ``CUDA_VISIBLE_DEVICES`` Ray set for it, mapped to the physical GPU)."""
    return int(free_bytes("cuda:0") * cfg.device_fraction)


# ---------------------------------------------------------------------- start / shutdown
def device_pools(node: dict, settings: ClusterSettings) -> list[tuple[str, str, dict]]:
    """The model-less pool actors ``start`` puts on ``node`` (a ``ray.nodes()`` entry): ``(name,
    device, Ray resource options)`` each. ``settings.gpu_pools``: ``"engines"`` (the serving
    layout, the default) leaves every GPU to the engine that will run there and hold its pool
    (a ``PoolHost``: the Serve app's worker, ``ChatEngine``), so a GPU node gets none;
    ``"actors"`` gives each GPU a ``PagePoolActor`` (memory with no model in front: a
    cache-only cluster). A node without devices gets one CPU pool; a non-GPU
    ``device_resource`` (tests) one CPU pool per unit, claiming it."""
    node_id = node["NodeID"]
    units = int(node.get("Resources", {}).get(settings.device_resource, 0))
    if settings.device_resource == "GPU":
        if units and settings.gpu_pools == "engines":
            return []
        pools = [(pool_name(node_id, "gpu", i), "cuda", {"num_gpus": 1}) for i in range(units)]
    else:
        pools = [(pool_name(node_id, "dev", i), "cpu", {"resources": {settings.device_resource: 1}})
                 for i in range(units)]
    return pools or [(pool_name(node_id, "cpu", 0), "cpu", {})]


def start(cfg: CacheConfig, settings: ClusterSettings | None = None) -> StartReport:
    """Create the registry, a store per node and its pools (``device_pools``) where missing
    (idempotent)."""
    settings = settings or ClusterSettings()
    if not ray.is_initialized():
        ray.init(namespace=settings.namespace)
    ns = settings.namespace
    cfg_json = cfg.model_dump(mode="json")
    s_json = settings.model_dump(mode="json")
    have = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == ns}
    report = StartReport(registry=settings.registry_name)
    made: list[Any] = []

    common = {"namespace": ns, "lifetime": "detached", "num_cpus": settings.actor_num_cpus}
    if settings.registry_name in have:
        report.existing.append(settings.registry_name)
        reg = ray.get_actor(settings.registry_name, namespace=ns)
        running = ray.get(reg.config.remote(), timeout=settings.call_timeout_s)
        if CacheConfig(**running) != CacheConfig(**cfg_json):
            raise ConfigError("mmtier is already running with another CacheConfig; shut it down first")
    else:
        reg = ray.remote(ContentRegistryActor).options(
            name=settings.registry_name, get_if_exists=True, max_restarts=-1, max_task_retries=-1,
            max_concurrency=1000, **common).remote(cfg_json, s_json)
        report.created.append(settings.registry_name)
        made.append(reg)

    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        report.nodes.append(node_id)
        pin = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
               "max_restarts": settings.pool_max_restarts, "max_concurrency": settings.pool_concurrency,
               "get_if_exists": True, **common}
        name = store_name(node_id)
        if name in have:
            report.existing.append(name)
        else:
            made.append(ray.remote(NodeStoreActor).options(name=name, **pin).remote(
                cfg_json, name, node_id, s_json))
            report.created.append(name)
        for name, device, res in device_pools(node, settings):
            if name in have:
                report.existing.append(name)
                continue
            made.append(ray.remote(PagePoolActor).options(name=name, **pin, **res).remote(
                cfg_json, name, node_id, device, s_json))
            report.created.append(name)
    ray.get([a.ping.remote() for a in made], timeout=settings.start_timeout_s)
    return report


def shutdown(settings: ClusterSettings | None = None) -> list[str]:
    """Kill every mmtier actor (registry, pools, stores); returns their names."""
    settings = settings or ClusterSettings()
    if not ray.is_initialized():
        return []
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == settings.namespace and a["name"].startswith("mmtier-")]
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=settings.namespace), no_restart=True)
        except ValueError:
            continue                 # already gone
    return names
