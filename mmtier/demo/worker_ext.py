"""A vLLM worker extension (``--worker-extension-cls mmtier.demo.worker_ext.DemoWorker``) the demo
and ``benchmarks/serving_load.py`` call from outside the engine's processes through the API
server's ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``; the servers bind 127.0.0.1 only):

- ``mmtier_encoded``: the images the model's vision tower encoded since the last call (a forward
  hook installed on the first call; each call resets the count);
- ``mmtier_close``: closes the worker's mmtier caches now (``connector_cache.close_shared``), so
  what its device and host tiers hold is written to the disk tier while the process is whole,
  before the server is stopped (at ``atexit`` the interpreter refuses new thread-pool work, and
  the disk tier's writer runs on one);
- ``mmtier_threads``: the worker's OpenMP threads and the CPUs it may run on (what vLLM's CPU
  build bound it to: ``mmtier.integrations.vllm_threads``)."""

from __future__ import annotations


class DemoWorker:
    def mmtier_encoded(self) -> int:
        if not hasattr(self, "_mmtier_encoded"):
            self._mmtier_encoded = 0

            def count(module, args, output) -> None:
                self._mmtier_encoded += int(args[0].shape[0])

            self.model_runner.model.vision_tower.register_forward_hook(count)
        n, self._mmtier_encoded = self._mmtier_encoded, 0
        return n

    def mmtier_close(self) -> int:
        from mmtier.integrations import connector_cache

        n = len(connector_cache._CACHES)
        connector_cache.close_shared()
        return n

    def mmtier_threads(self) -> dict:
        import os

        import torch

        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        return {"threads": torch.get_num_threads(), "cpus": cpus}
