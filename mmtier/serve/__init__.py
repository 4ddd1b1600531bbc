"""The Ray Serve application of mmtier (``configs/serve.yaml``; ``mmtier serve``).

- ``app.build_app(args)``: the application (``import_path: mmtier.serve.app:build_app``);
- ``config.ServeAppConfig``: its ``args`` (API keys -> tenants, limits, affinity, workers);
- ``protocol``: the HTTP JSON API and its status codes;
- ``routing``: the cache-affinity rule (which node's worker takes a turn);
- ``worker.TurnWorker``: the per-node worker running the reference model through the cache;
- ``node_cache.NodeCache``: a ``ClusterCache`` as the model sees it from one node.

Names load lazily so that ``import mmtier.serve`` does not import Ray.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_app": "app", "TurnIngress": "app", "ServeAppConfig": "config", "TurnWorker": "worker",
    "NodeCache": "node_cache", "Router": "routing", "pin_targets": "routing",
    "HTTPError": "protocol", "parse_turn": "protocol",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mmtier.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
