"""Whole groups between holders through the object store, with no copy on the sender but the
object store's own (the Ray edge of ``PoolService.export`` / ``import_group``).

``export_to_object_store`` leases the group (it cannot be evicted or moved while read) and
returns ``(meta, buffer)``, the buffer a *view* of the arena where the group's pages are one run
on the CPU. The lease lives exactly as long as the view: it is given back when the last
reference to the buffer goes, that is once Ray has written the actor method's return value into
this node's object store (one copy), or once a local caller's ``.remote(...)`` has put it there.
Nothing reads the pages after the lease is gone, because every reader holds the buffer; a
reader that never lets go is bounded by the lease's TTL.

So a fetch is one call and one round trip: the importer's ``ray.get`` of the export's second
return (or Ray, resolving it as an argument) pulls the bytes node to node once; on the same node
it reads them zero-copy, and ``import_pages`` copies them into the pool's pages: the only copy on
the receiving side.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..content import ContentKey
from .pool import PoolService

LEASE_S = 60.0          # bound of one export's read of the arena (a put into the object store)


def export_to_object_store(service: PoolService, wire: dict[str, str]) -> tuple[dict, np.ndarray]:
    """``(meta, page buffer)`` of a group held by ``service``, leased while the buffer lives."""
    cache = service.cache
    lease = cache.lease(ContentKey.from_wire(wire), LEASE_S)     # UnknownKeyError when not held
    try:
        meta, buf = PoolService.export(service, wire, copy=False)   # the plain logic's view
    except BaseException:
        cache.release_lease(lease)
        raise
    weakref.finalize(buf, cache.release_lease, lease)
    return meta, buf
