"""Old path, kept for configs written against it; the code lives in ``mmtier.engines.vllm.connector``."""

from mmtier.engines.vllm.connector import MMTierConnector  # noqa: F401
