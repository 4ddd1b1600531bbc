"""Old path, kept for code written against it; the code lives in ``mmtier.cluster.settings``."""

from mmtier.cluster.settings import ClusterSettings  # noqa: F401
