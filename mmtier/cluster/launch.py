"""Start and stop mmtier on a running Ray cluster: the one place where actors are created (the
actor classes, each wrapping one plain class, and their names are ``actors``).

``start(cfg)`` is idempotent. It creates what is missing, by deterministic name in namespace
``mmtier``:

- ``mmtier-registry`` (and ``mmtier-registry:shard<i>`` for ``registry_shards`` > 1): the
  ContentRegistry's shards (detached, on the node that calls ``start`` while it lives,
  ``max_restarts=-1``, calls retried across restarts; each
  rebuilds its part from the holders' inventories after a restart, or after ``start()``
  recreated one that was killed);
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
``disk_dir / "store-<node id>"`` behind its host tier. A node started with the Ray label
``mmtier.io/node=<name>`` keeps both under ``disk_dir / "node-<name>"`` instead (``store``,
``pool-<kind><i>``), so a node removed and added again under the same name (a new node id)
finds its folders; two live nodes with one label are refused (``NodeLabelError``), nothing
created. A pool or store recreated on the same node (``start()`` after a kill, or on the
re-added node) adopts the groups in its directory and announces them to the registry with its
inventory; a holder that finds a corrupt copy tells the registry with
``actors.report_lost`` (the pool and store actors, and ``PoolHost``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..config import CacheConfig
from ..errors import ConfigError
from .actors import ContentRegistryActor, NodeStoreActor, PagePoolActor, pool_name, store_name
from .node_labels import check_unique
from .registry_shards import shard_name
from .settings import ClusterSettings


@dataclass
class StartReport:
    """What ``start`` found and made: actor names, and the nodes it covered."""

    registry: str
    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)


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
    nodes = ray.nodes()
    labels = check_unique(nodes)        # two live nodes, one label: refused before anything is made
    ns = settings.namespace
    cfg_json = cfg.model_dump(mode="json")
    s_json = settings.model_dump(mode="json")
    have = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == ns}
    report = StartReport(registry=settings.registry_name)
    made: list[Any] = []

    common = {"namespace": ns, "lifetime": "detached", "num_cpus": settings.actor_num_cpus}
    for i in range(settings.registry_shards):
        name = shard_name(settings, i)
        if name in have:
            report.existing.append(name)
            reg = ray.get_actor(name, namespace=ns)
            running = ray.get(reg.config.remote(), timeout=settings.call_timeout_s)
            if CacheConfig(**running) != CacheConfig(**cfg_json):
                raise ConfigError("mmtier is already running with another CacheConfig; shut it down first")
        else:       # a shard lost (killed, its node gone) comes back here and rebuilds its part
            # on the node that starts mmtier (the head, as a rule) while it lives: a worker node
            # leaving would otherwise take shards with it; soft, so a restart goes elsewhere
            home = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
            made.append(ray.remote(ContentRegistryActor).options(
                name=name, get_if_exists=True, max_restarts=-1, max_task_retries=-1,
                max_concurrency=1000, scheduling_strategy=home, **common).remote(cfg_json, s_json, i))
            report.created.append(name)

    for node in nodes:
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
                cfg_json, name, node_id, s_json, labels[node_id]))
            report.created.append(name)
        for name, device, res in device_pools(node, settings):
            if name in have:
                report.existing.append(name)
                continue
            made.append(ray.remote(PagePoolActor).options(name=name, **pin, **res).remote(
                cfg_json, name, node_id, device, s_json, labels[node_id]))
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
