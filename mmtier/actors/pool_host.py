"""Old path, kept for code written against it (``mmtier.actors.pool_host.host_name``); the code
lives in ``mmtier.cluster.engine_pool``."""

from mmtier.cluster.engine_pool import PoolHost, RayTransport, host_name  # noqa: F401
