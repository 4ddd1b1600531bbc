"""Storage mechanism below the device pools: host slabs, Arrow files on disk, and the mover.

- ``HostTier`` (``host.py``): page-major host slabs per spec under one byte budget;
- ``DiskTier`` (``arrow_files.py``): one Arrow IPC file per group (or 64 MiB chunk), verified
  reads, warm restart, quarantine;
- ``Mover`` (``mover.py``): asynchronous spill / restore / prefetch with priorities and a bound
  on bytes in flight.
"""

from .arrow_files import DiskEntry, DiskTier, StorageIOError
from .host import HostEntry, HostTier
from .mover import Mover, Priority

__all__ = ["DiskEntry", "DiskTier", "HostEntry", "HostTier", "Mover", "Priority", "StorageIOError"]
