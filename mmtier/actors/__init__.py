"""Old path, kept for configs and code written against it (``mmtier.actors.PoolHost``,
``mmtier.actors.ClusterSettings``, ``mmtier.actors.start`` ...); the code lives in
``mmtier.cluster``, whose names this package hands out (lazily, as there)."""

from mmtier.cluster import __all__, __getattr__  # noqa: F401
