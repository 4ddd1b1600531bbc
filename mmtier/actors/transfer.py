"""Whole groups between holders through the object store, with no copy on the sender but the
object store's own (the Ray edge of ``PoolService.export`` / ``import_group``).

``export_to_object_store`` leases the group (it cannot be evicted or moved while read), puts
its pages into this node's object store straight from the arena (a view, no safety copy), gives
the lease back, and returns ``(meta, [ref])``: the reference travels boxed in a list, so Ray
hands it to the importer as a reference and the bytes move once, node to node. A holder on the
same node reads them zero-copy. ``unbox`` is the importer's side (a plain buffer passes as is).
"""

from __future__ import annotations

import numpy as np
import ray

from ..content import ContentKey
from .pool_actor import PoolService

LEASE_S = 60.0          # bound of one export's read of the arena (a put into the object store)


def export_to_object_store(service: PoolService, wire: dict[str, str]) -> tuple[dict, list]:
    """``(meta, [ObjectRef of the page buffer])`` of a group held by ``service`` ."""
    cache = service.cache
    lease = cache.lease(ContentKey.from_wire(wire), LEASE_S)     # UnknownKeyError when not held
    try:
        meta, buf = PoolService.export(service, wire, copy=False)   # the plain logic's view
        return meta, [ray.put(buf)]
    finally:
        cache.release_lease(lease)


def unbox(buf, timeout_s: float) -> np.ndarray:
    """The page buffer of an export: as passed, or fetched from its boxed reference."""
    if isinstance(buf, list) and len(buf) == 1 and isinstance(buf[0], ray.ObjectRef):
        return ray.get(buf[0], timeout=timeout_s)
    return buf
