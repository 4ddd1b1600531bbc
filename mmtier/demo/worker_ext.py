"""A vLLM worker extension (``--worker-extension-cls mmtier.demo.worker_ext.DemoWorker``) the demo
and ``benchmarks/engines/serving_load.py`` call from outside the engine's processes through the API
server's ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``; the servers bind 127.0.0.1 only):

- ``mmtier_encoded``: the items the model's encoder towers encoded since the last call (forward
  hooks installed on the first call; each call resets the count): images of LLaVA's
  ``vision_tower``, images and videos of Qwen2-VL's ``visual`` (one a row of its ``grid_thw``),
  clips of Qwen2-Audio's ``audio_tower`` (one a row of its batched features);
- ``mmtier_close``: closes the worker's mmtier caches now (``connector_cache.close_shared``), so
  what its device and host tiers hold is written to the disk tier while the process is whole,
  before the server is stopped (at ``atexit`` the interpreter refuses new thread-pool work, and
  the disk tier's writer runs on one);
- ``mmtier_counters``: the counters of the worker's open mmtier caches (one dict per cache: the
  write-behind's durable writes, bytes, drops and lag quantiles among them);
- ``mmtier_threads``: the worker's OpenMP threads and the CPUs it may run on (what vLLM's CPU
  build bound it to: ``mmtier.engines.vllm.threads``)."""

from __future__ import annotations

TOWERS = ("vision_tower", "visual", "audio_tower")


def items_encoded(args: tuple, kwargs: dict) -> int:
    """The items one call of an encoder tower encodes: the rows of Qwen2-VL's ``grid_thw`` (one
    an image or video) where the call has one, else the batch of its first argument."""
    grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
    if grid is not None:
        return len(grid)
    return int(args[0].shape[0])


class DemoWorker:
    def mmtier_encoded(self) -> int:
        if not hasattr(self, "_mmtier_encoded"):
            self._mmtier_encoded = 0

            def count(module, args, kwargs, output) -> None:
                self._mmtier_encoded += items_encoded(args, kwargs)

            model = self.model_runner.model
            towers = [getattr(model, name) for name in TOWERS if getattr(model, name, None) is not None]
            if not towers:
                raise RuntimeError(f"{type(model).__name__} has none of the encoder towers {TOWERS}")
            for tower in towers:
                tower.register_forward_hook(count, with_kwargs=True)
        n, self._mmtier_encoded = self._mmtier_encoded, 0
        return n

    def mmtier_close(self) -> int:
        from mmtier.engines import connector_cache

        n = connector_cache.open_count()
        connector_cache.close_shared()
        return n

    def mmtier_counters(self) -> list[dict]:
        from mmtier.engines import connector_cache

        return connector_cache.open_counters()

    def mmtier_threads(self) -> dict:
        import os

        import torch

        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        return {"threads": torch.get_num_threads(), "cpus": cpus}
