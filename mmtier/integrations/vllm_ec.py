"""Old path, kept for configs written against it; the code lives in ``mmtier.engines.vllm.ec``."""

from mmtier.engines.vllm.ec import MMTierECConnector  # noqa: F401
