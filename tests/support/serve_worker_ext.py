"""A vLLM worker extension (``worker_extension_cls``) for the Ray Serve LLM tests: counts the
images the model's vision tower encodes, read through Ray Serve LLM's ``/collective_rpc``
(``build_dev_openai_app``) on every replica, with the node the replica runs on
(``MMTIER_NODE_ID``, set by ``mmtier.serve.llm_callback``). The first call installs the hook
(a forward hook on the tower, counting images); each call returns and resets the count, and
reports the groups the worker's mmtier link has pulled from other nodes so far."""

from __future__ import annotations

import os


class EncoderCounter:
    def mmtier_encoded(self) -> dict:
        if not hasattr(self, "_mmtier_encoded"):
            self._mmtier_encoded = 0

            def count(module, args, output) -> None:
                self._mmtier_encoded += int(args[0].shape[0])

            self.model_runner.model.vision_tower.register_forward_hook(count)
        from mmtier.engines import connector_cache

        n, self._mmtier_encoded = self._mmtier_encoded, 0
        pulled = sum(link.counters["pulled"] for link in list(connector_cache._LINKS.values()))
        return {"node": os.environ.get("MMTIER_NODE_ID"), "encoded": n, "pulled": pulled}
