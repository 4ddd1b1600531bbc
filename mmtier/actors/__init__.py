"""The Ray layer: ContentRegistry, ``PoolHost`` (an engine actor that holds its device's pool),
PagePoolActor (memory with no model in front), NodeStoreActor and the ``ClusterCache`` client.

``start(cfg)`` creates the actors on a running cluster (idempotent), ``connect()`` returns the
client, ``shutdown()`` removes them. Names load lazily: ``mmtier.actors.registry`` (the plain
registry logic) imports without Ray; ``start`` / ``connect`` import it on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ClusterCache": "client", "HolderLostError": "client", "connect": "client",
    "StartReport": "launch", "start": "launch", "shutdown": "launch",
    "ContentRegistry": "registry", "HolderInfo": "registry", "Location": "registry",
    "ClusterSettings": "settings",
    "PoolHost": "pool_host", "RayTransport": "pool_host", "host_name": "pool_host", "HostedCache": "hosted",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mmtier.actors' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
