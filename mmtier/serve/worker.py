"""``TurnWorker``: the per-node worker of the Serve app (a Ray actor; ``app.py`` creates it).

One worker runs on each node (pinned by a per-node resource), as a named actor that holds its
device's pool (``mmtier.actors.PoolHost``, name ``host_name(node)``): the model and its cache
live in one process, so a turn's attention reads local pages with no Ray call. The model is a
pluggable chat engine (``engines.py``: the transformers chat model by default, or the
reference model); its open conversations run over that embedded cache; media groups held
elsewhere are found by one registry lookup per turn and pulled whole into the pool (the turn's
``traffic`` in the answer counts those calls); new groups are published after the turn.

The turns themselves (conversations, their locks, the serial engine's one turn at a time, the
answer a failed turn gets) are a plain class, ``turns.TurnRunner``, over the pool's
``HostedCache``; the pool's own actor methods always run alongside.
"""

from __future__ import annotations

import logging

from ..actors.pool_host import PoolHost
from .config import ServeAppConfig
from .engines import load_engine
from .turns import TurnRunner

log = logging.getLogger(__name__)


class TurnWorker(PoolHost):
    """Runs turns of conversations on this node, over the pool it holds. A threaded actor:
    turns of different conversations, and the pool's own methods (exports to other holders,
    pings), run concurrently."""

    def __init__(self, cfg_json: dict, index: int, expected_node: str | None = None):
        import ray
        import torch

        self.app_cfg = ServeAppConfig.parse(cfg_json)
        torch.set_num_threads(self.app_cfg.workers.torch_threads)
        super().__init__(self.app_cfg.settings())
        self.index = index
        if expected_node is not None and expected_node != self.node:
            log.warning("worker %d expected on node %s runs on %s", index, expected_node,
                        ray.get_runtime_context().get_node_id())
        self.engine = load_engine(self.app_cfg.model)
        self.engine.check_cache(self.local)
        self.turns = TurnRunner(self.engine, self.local, self.app_cfg.workers, index=index, node=self.node,
                                calls=self.transport.calls)

    # ------------------------------------------------------------------ remote interface
    def turn(self, tenant: str, conversation_id: str | None, items: list[tuple[str, object]],
             max_new_tokens: int) -> tuple[int, dict]:
        """``(status, body)``; ``items``: ``("text", str)`` or ``(request media type, bytes)``."""
        return self.turns.turn(tenant, conversation_id, items, max_new_tokens)

    def close_conversation(self, tenant: str, conversation_id: str) -> tuple[int, dict]:
        return self.turns.close_conversation(tenant, conversation_id)

    def info(self) -> dict:
        return {"index": self.index, "node": self.node, "conversations": self.turns.conversations,
                "pool": self.name}
