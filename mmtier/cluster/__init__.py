"""The cluster layer on Ray, its modules named by role: ``registry`` (content key -> holders),
``registry_shards`` (the registry split over actors by key, routed client side),
``pool`` (a device's cache served to the cluster), ``store`` (a node's host and disk tiers),
``client`` and its ``client_*`` parts (``ClusterCache``), ``transfer`` / ``transfer_copies``
(groups through the object store), ``engine_pool`` / ``engine_cache`` / ``engine_remote`` (an
engine actor that holds its device's pool, ``PoolHost``, and the cache its model sees), ``link``
(an engine process's embedded cache joined to the cluster), ``node_labels`` (a node's stable
name for its disk folders), ``actors`` (the Ray edge: each actor
wraps one plain class) and ``launch`` (start and stop).

``start(cfg)`` creates the actors on a running cluster (idempotent), ``connect()`` returns the
client, ``shutdown()`` removes them. Names load lazily: ``mmtier.cluster.registry`` (the plain
registry logic) imports without Ray; ``start`` / ``connect`` import it on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ClusterCache": "client", "HolderLostError": "client", "connect": "client",
    "StartReport": "launch", "start": "launch", "shutdown": "launch",
    "ContentRegistry": "registry", "HolderInfo": "registry", "Location": "registry",
    "RegistryShards": "registry_shards",
    "ClusterSettings": "settings",
    "PoolHost": "engine_pool", "RayTransport": "engine_pool", "host_name": "engine_pool",
    "HostedCache": "engine_cache",
    "NodeLabelError": "node_labels",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mmtier.cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
