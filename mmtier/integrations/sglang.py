"""Old path, kept for configs written against it; the code lives in ``mmtier.engines.sglang``."""

from mmtier.engines.sglang import MMTierHiCacheStorage  # noqa: F401
