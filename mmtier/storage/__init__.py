"""Storage mechanism below the device pools: host slabs, Arrow files on disk, and the mover.

- ``HostTier`` (``host.py``): page-major host slabs per spec under one byte budget; an entry
  (``HostEntry``, ``host_slabs.py`` with the slabs) gives ``(slab_view, slot_ids)`` for CPU
  attention in place, ``gather()``, ``runs()`` and verified reads;
- ``DiskTier`` (``arrow_files.py``): one Arrow IPC file per group (or 64 MiB chunk); a
  facade over its index (``disk_index.py``: entries, budget, counters, quarantine), warm
  restart (``disk_restart.py``), writes (``disk_writes.py``: typed errors for a full disk or
  the free-space floor; files written with ``O_DIRECT`` from reused aligned images,
  ``file_writes.py``) and verified reads (``disk_reads.py``: corruption is a miss, counted and
  quarantined; files and layers read with ``O_DIRECT`` into aligned buffers,
  ``direct_reads.py``, ``layer_extent.py``); the format in ``arrow_format.py``, the pages a
  read lands in ``dest_pages.py``;
- ``Mover`` (``mover.py``): asynchronous spill / restore / prefetch with priorities and a
  bound on bytes in flight; source pages held until their copy is done.

Wiring in ``TieredKVCache`` (the cache owns policy; these own mechanism)::

    host = HostTier(cfg.host_bytes)                                   # host_bytes > 0
    disk = DiskTier(cfg.disk_dir, model=cfg.model, capacity_bytes=cfg.disk_bytes,
                    free_floor_bytes=cfg.disk_free_floor_bytes)       # disk_dir set
    mover = Mover(host, disk, model=cfg.model, max_inflight_bytes=cfg.max_inflight_bytes)
    for e in disk.inventory():          # warm restart: adopt what is on disk
        keys.verify(e.key)              # (ForeignKeyError: leave it out)
        ...register group e.key (e.num_tokens, tier "disk")...
    # demote device -> host:   host.put(key, spec, n_tok, pool.view, page_ids=ids); free ids
    #                          after entry.wait() (or at once on CPU)
    # demote host -> disk:     mover.spill(key, spec, n_tok, remove_from_host=True)
    # attention over host:     view, ids = host.get(key).view(); build_paged_kv(view, layer, ...)
    # attention over disk:     mover.fetch(key, spec) -> pages tensor; or mover.restore(key, spec)
    # promote host -> device:  host.get(key).copy_to(pool.view, new_ids)
    # close order:             mover.close(); disk.close(); host.close()

A ``CapacityError`` from ``host.put`` / ``host.reserve`` / a restore asks the owner to evict
and retry; ``StorageFullError`` / ``CapacityError`` from a spill means the group stays where
it was; ``StorageIOError`` likewise (and is counted).
"""

from .arrow_files import DiskTier
from .disk_index import DiskEntry
from .disk_writes import StorageIOError
from .host import HostEntry, HostTier
from .mover import Mover, Priority

__all__ = ["DiskEntry", "DiskTier", "HostEntry", "HostTier", "Mover", "Priority", "StorageIOError"]
