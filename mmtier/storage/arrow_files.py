"""The disk tier, ``DiskTier``: groups as Arrow IPC files in one directory, a facade over the
parts that own them.

- ``DiskIndex`` (``disk_index.py``): the groups on disk (``DiskEntry``), the byte budget,
  the writes in flight, the counters, removal and quarantine;
- ``adopt_directory`` (``disk_restart.py``): the warm restart, which fills the index from
  what the directory holds (reading only each file's footer and schema; ``.tmp`` leftovers
  removed, bad files and partial groups quarantined: ``quarantined_at_start``,
  ``partial_groups_at_start``); ``inventory()`` lists the groups so the cache can adopt them
  (it should ``KeyMaker.verify`` each key: a file is not trusted to have been issued by this
  cache's secret);
- ``DiskWrites`` (``disk_writes.py``): ``put_async`` and ``put_many_async`` (``put`` and
  ``put_many`` run them on the tier's own event loop), one file per modality group or per
  ``chunk_bytes`` (64 MiB) chunk, durable when they return; ``StorageFullError`` for a full disk or the free-space
  floor, ``CapacityError`` beyond the budget, ``StorageIOError`` otherwise;
- ``DiskReads`` (``disk_reads.py``): ``get``, ``get_many``, ``get_layer``, verified against
  digests the writer kept (any mismatch is a miss: ``corrupt_reads``, the group's files moved
  to ``quarantine/``), never wrong data; nothing is unpickled.

The file format is ``arrow_format.py`` (format 2, layer-major); the lean reads of files whose
layout is known, ``layer_extent.py`` and ``direct_reads.py``; a file's write, ``file_writes.py``.
``DiskTier`` holds the parts, runs blocking writes on its event loop, and closes them.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import ModalitySpec
from ..content import ContentKey
from ..errors import ClosedError
from .dest_pages import DestTokens
from .disk_index import DiskEntry, DiskIndex
from .disk_reads import DiskReads
from .disk_restart import adopt_directory
from .disk_writes import DiskWrites
from .layer_extent import direct_align
from .tier import StorageTier


class DiskTier(StorageTier):
    """Arrow IPC files of groups in one directory, under a byte budget. Thread-safe."""

    def __init__(self, directory: str | os.PathLike, *, model: str, capacity_bytes: int,
                 free_floor_bytes: int = 0, chunk_bytes: int = 64 << 20, io_timeout_s: float = 300.0,
                 scan_threads: int = 16, write_concurrency: int = 4, read_threads: int = 4,
                 read_ahead_layers: int = 1, direct_reads: bool = True, direct_writes: bool = True):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model = model
        self._index = DiskIndex(self.dir, capacity_bytes)
        # layer reads with O_DIRECT where aligned (``layer_extent.read_direct``); the writer
        # pads each layer's extent to the device's logical block for them
        io_align = direct_align(os.stat(self.dir).st_dev) if direct_reads else 1
        self._writes = DiskWrites(self._index, model=model, chunk_bytes=chunk_bytes,
                                  io_timeout_s=io_timeout_s, write_concurrency=write_concurrency,
                                  free_floor_bytes=free_floor_bytes, io_align=io_align,
                                  direct_writes=direct_writes)
        self._reads = DiskReads(self._index, direct=direct_reads, threads=read_threads,
                                ahead_layers=read_ahead_layers)
        self._sync_lock = threading.Lock()   # blocking writes, one at a time, on ``_loop``
        self._loop: asyncio.AbstractEventLoop | None = None
        t0 = time.perf_counter()
        adopt_directory(self._index, model, scan_threads)
        self.scan_s = time.perf_counter() - t0

    # ---- options, owned by the parts ----
    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    @property
    def io_align(self) -> int:
        """What each layer's extent is padded to (the device's logical block; 1: no pad)."""
        return self._writes.io_align

    @property
    def direct_reads(self) -> bool:
        return self._reads.direct

    @direct_reads.setter
    def direct_reads(self, on: bool) -> None:
        self._reads.direct = on

    @property
    def free_floor_bytes(self) -> int:
        return self._writes.free_floor_bytes

    @free_floor_bytes.setter
    def free_floor_bytes(self, n: int) -> None:
        self._writes.free_floor_bytes = n

    # ---- accounting ----
    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def stats(self) -> dict[str, object]:
        return self._index.stats(scan_s=self.scan_s)

    def inventory(self) -> list[DiskEntry]:
        return self._index.inventory()

    def info(self, key: ContentKey) -> DiskEntry | None:
        return self._index.info(key)

    # ---- the tier interface ----
    def contains(self, key: ContentKey) -> bool:
        return self._index.info(key) is not None

    def put(self, key: ContentKey, spec: ModalitySpec, num_tokens: int,
            pages: torch.Tensor | Sequence[torch.Tensor]) -> DiskEntry:
        """Write a group (blocking; from async code await ``put_async``). ``pages``:
        ``[n, *page_shape]`` or contiguous runs of it. Idempotent per key."""
        return self._run(self._writes.put_async(key, spec, num_tokens, pages))

    def put_many(self, items: Sequence[tuple[ContentKey, ModalitySpec, int, torch.Tensor | Sequence[torch.Tensor]]]
                 ) -> list[DiskEntry]:
        """Several groups ``(key, spec, num_tokens, pages)`` at once (blocking): their writes run
        side by side (``write_concurrency`` at a time, on aiofiles' threads), each file fsynced
        as ``put`` does, and the directory fsynced once for all of them at the end, so every
        group is durable when this returns. A group that fails does not stop the others: the
        first error is raised once all have finished, the groups written are kept."""
        return self._run(self._writes.put_many_async(items))

    async def put_async(self, key: ContentKey, spec: ModalitySpec, num_tokens: int,
                        pages: torch.Tensor | Sequence[torch.Tensor], *, sync_dir: bool = True,
                        expected_sums: Sequence[int] | None = None) -> DiskEntry:
        """``put`` on the caller's event loop (``DiskWrites.put_async``)."""
        return await self._writes.put_async(key, spec, num_tokens, pages, sync_dir=sync_dir,
                                             expected_sums=expected_sums)

    def get(self, key: ContentKey, spec: ModalitySpec, expected_model: str,
            out: torch.Tensor | Sequence[torch.Tensor] | DestTokens | None = None
            ) -> torch.Tensor | Sequence[torch.Tensor] | DestTokens | None:
        """The group's pages ``[n, *page_shape]`` (or ``out``), verified, or ``None``
        (``DiskReads.get``)."""
        return self._reads.get(key, spec, expected_model, out)

    async def get_async(self, key: ContentKey, spec: ModalitySpec, expected_model: str,
                        out: torch.Tensor | Sequence[torch.Tensor] | DestTokens | None = None
                        ) -> torch.Tensor | Sequence[torch.Tensor] | DestTokens | None:
        return await self._reads.get_async(key, spec, expected_model, out)

    def get_many(self, keys: Sequence[ContentKey], spec: ModalitySpec, expected_model: str,
                 out: torch.Tensor, sizes: Sequence[int]) -> list[bool]:
        """Several groups of one spec into ``out`` back to back (``DiskReads.get_many``)."""
        return self._reads.get_many(keys, spec, expected_model, out, sizes)

    def get_layer(self, key: ContentKey, spec: ModalitySpec, expected_model: str, layer: int,
                  out: torch.Tensor | Sequence[torch.Tensor] | None = None
                  ) -> torch.Tensor | Sequence[torch.Tensor] | None:
        """Layer ``layer`` of the group's pages, verified, or ``None`` (``DiskReads.get_layer``)."""
        return self._reads.get_layer(key, spec, expected_model, layer, out)

    def remove(self, key: ContentKey) -> bool:
        return self._index.remove(key)

    def close(self) -> None:
        with self._sync_lock:
            self._index.close()
            self._reads.close()
            if self._loop is not None:
                self._loop.run_until_complete(self._loop.shutdown_default_executor())
                self._loop.close()
                self._loop = None

    def _run(self, coro):
        """Run a write's coroutine to its end on the tier's own event loop (blocking)."""
        with self._sync_lock:
            if self._index.closed:
                coro.close()
                raise ClosedError("disk tier is closed")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(coro)
