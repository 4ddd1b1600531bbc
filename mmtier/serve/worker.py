"""``TurnWorker``: the per-node worker of the Serve app (a Ray actor; ``app.py`` creates it).

One worker runs on each node (pinned by a per-node resource), as a named actor that holds its
device's pool (``mmtier.cluster.PoolHost``, name ``host_name(node)``): the model and its cache
live in one process, on the node's GPU when it has one (``app.py`` asks ``num_gpus=1`` for it,
``workers.device: auto``; ``mmtier start`` leaves that GPU free, see ``launch.device_pools``),
else on the CPU, so a request's attention reads local pages with no Ray call. The model is a
chat engine (``model_api.py``: the transformers chat model, loaded by ``engine_loader.py``); a
request's history and media groups held elsewhere are found by one registry lookup and pulled
whole into the pool (the ``traffic`` in the answer counts those calls); new groups are
published after the request.

The requests themselves (the serial engine's one at a time, the answer a failed one gets) are
a plain class, ``turns.TurnRunner``, over the pool's ``HostedCache``; the pool's own actor
methods always run alongside.
"""

from __future__ import annotations

import logging

from ..cluster.engine_pool import PoolHost
from .config import ServeAppConfig
from .engine_loader import load_engine
from .turns import TurnRunner

log = logging.getLogger(__name__)


class TurnWorker(PoolHost):
    """Answers requests on this node, over the pool it holds. A threaded actor: the pool's own
    methods (exports to other holders, pings) run alongside requests. ``device``: ``"cuda"``
    (the GPU Ray gave it) or ``"cpu"``: the model's and the pool's."""

    def __init__(self, cfg_json: dict, index: int, expected_node: str | None = None, device: str = "cpu"):
        import ray
        import torch

        self.app_cfg = ServeAppConfig.parse(cfg_json)
        torch.set_num_threads(self.app_cfg.workers.torch_threads)
        super().__init__(self.app_cfg.settings(), device=device)
        self.device = device
        self.index = index
        if expected_node is not None and expected_node != self.node:
            log.warning("worker %d expected on node %s runs on %s", index, expected_node,
                        ray.get_runtime_context().get_node_id())
        self.engine = load_engine(self.app_cfg.model, device)
        self.engine.check_cache(self.local)
        self.turns = TurnRunner(self.engine, self.local, self.app_cfg.workers, index=index, node=self.node,
                                calls=self.transport.calls)

    # ------------------------------------------------------------------ remote interface
    def answer(self, tenant: str, history: list, items: list[tuple[str, object]],
               max_new_tokens: int) -> tuple[int, dict]:
        """``(status, body)``; ``items``: ``("text", str)`` or ``(request media type, bytes)``;
        ``history``: earlier turns as ``(items, answer text)``."""
        return self.turns.answer(tenant, history, items, max_new_tokens)

    def info(self) -> dict:
        return {"index": self.index, "node": self.node, "answered": self.turns.answered,
                "pool": self.name, "device": self.device}
