"""Old path, kept for configs written against it; the code lives in ``mmtier.engines.transformers``."""

from mmtier.engines.transformers import *  # noqa: F403
