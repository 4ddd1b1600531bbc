"""The Ray Serve application of mmtier (``configs/serve.yaml``; ``mmtier serve``).

- ``app.build_app(args)``: the application (``import_path: mmtier.serve.app:build_app``);
- ``app.ChatIngress``: the HTTP entry (auth, parsing, routing) of the OpenAI chat completions API;
- ``config.ServeAppConfig``: its ``args`` (API keys -> tenants, limits, affinity, workers);
- ``protocol``: the OpenAI chat request (stateless: messages carry the conversation) and its
  OpenAI-shaped errors; ``completions``: the answers, JSON or SSE, with ``usage``;
- ``routing``: the cache-affinity rule (which node's worker takes a request);
- ``worker.TurnWorker``: the per-node worker, an actor that runs the model and holds its node's
  pool (``mmtier.cluster.PoolHost``), on the node's GPU when it has one; ``turns.TurnRunner``
  its requests (a plain class);
- ``model_api``: the model a worker runs behind one interface (``chat_model``: the transformers
  chat model), and the part of it the ingress needs; ``engine_loader`` loads them and builds
  the cluster's cache config for the model;
- ``media``: the media bytes the app accepts (PNG, JPEG, PCM16 WAV), checked before routing;

Names load lazily so that ``import mmtier.serve`` does not import Ray.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_app": "app", "ChatIngress": "app", "ServeAppConfig": "config", "TurnWorker": "worker",
    "Router": "routing", "pin_targets": "routing",
    "HTTPError": "protocol", "parse_chat": "protocol",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mmtier.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
