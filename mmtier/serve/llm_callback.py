"""A Ray Serve LLM callback that tells a replica's engine processes which node they run on.

    LLMConfig(..., callback_config={"callback_class": "mmtier.serve.llm_callback:NodeCallback"})

vLLM's engine core runs in a process the replica spawns; with ``mmtier_cluster`` it joins Ray
itself, and a process that joins Ray attaches to the head's raylet wherever several raylets
share a host (``ray.cluster_utils``, a test cluster), so its mmtier link would write through to
the wrong node's store. Before the engine starts, this sets ``MMTIER_NODE_ID`` in the
replica's environment to the replica's own node; the engine's processes inherit it
(``engine_link.NODE_ENV``). One raylet per host (production) gives the same node either way.
"""

from __future__ import annotations

import os

import ray
from ray.llm._internal.common.callbacks.base import CallbackBase

from ..cluster.link import NODE_ENV


class NodeCallback(CallbackBase):
    async def on_before_node_init(self) -> None:
        os.environ[NODE_ENV] = ray.get_runtime_context().get_node_id()
