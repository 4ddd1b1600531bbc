"""Old path, kept for configs written against it; the code lives in ``mmtier.engines.vllm.plugin``."""

from mmtier.engines.vllm.plugin import register  # noqa: F401
