"""The disk tier's verified reads (``DiskTier`` inherits them; ``arrow_files.py`` holds the
index, the writes, quarantine and warm restart).

- ``get``: a group into a new tensor or the caller's destination (a tensor or contiguous runs,
  e.g. ``HostEntry.runs()``). A group this process wrote is read lean, every byte checked
  against digests the writer kept in memory: with ``O_DIRECT`` (``direct_reads``:
  ``read_whole_direct``, the file in aligned 8 MiB windows into reused staging buffers, the
  next windows read meanwhile, each layer's bytes copied from there into its slices of the
  pages), else or where refused buffered (``read_whole``: one sequential ``preadv`` pass per
  file, each layer's extent scattered into its slice of the pages); a group
  found at a warm restart is read once in full (``read_file``: footer, metadata against the
  index, the checksum column), which teaches the index its layout.
- ``get_many``: several groups of one spec back to back into one buffer, the streaming read of
  attention over disk: the same lean read per file with one destination view and one look at
  the index for the batch; anything else falls back to ``get``.
- ``get_layer``: one layer of every page (``read_layer_extent``: one contiguous extent per
  file in the layer-major format, read with ``O_DIRECT`` straight into the destination where
  it and the extent are aligned (``direct_reads``), else buffered with the next
  ``read_ahead_layers`` layers' extents handed to the kernel to read meanwhile), for per-layer
  attention calls.

Any failure is a miss: counted, the group's files quarantined, ``None``; never wrong data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
import torch

from ..config import ModalitySpec
from ..content import ContentKey
from ..errors import ClosedError, CorruptDataError, ShapeError
from .arrow_format import layout_matches, layout_of, read_file
from .dest_pages import DestPages
from .direct_reads import AHEAD_WINDOWS, read_whole_direct
from .layer_extent import LayerExtent, read_layer_extent, read_whole

if TYPE_CHECKING:
    from .arrow_files import DiskEntry


class DiskReads:
    """The read paths of ``DiskTier`` (uses its index, lock, counters and quarantine)."""

    def get(self, key: ContentKey, spec: ModalitySpec, expected_model: str,
            out: torch.Tensor | Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        """The group's pages ``[n, *page_shape]``, verified, or ``None`` (miss or corrupt).

        With ``out`` (a tensor or contiguous runs, e.g. ``HostEntry.runs()``) the pages land
        there and ``out`` is returned; after a ``None`` its contents are undefined."""
        e = self._entry(key, spec, expected_model)
        if e is None:
            return None
        result = out if out is not None else torch.empty(e.num_pages, *spec.page_shape,
                                                         dtype=spec.torch_dtype)
        dest = DestPages(spec, result, e.num_pages)  # a bad ``out`` raises: it is not corruption
        read = self._read_known if e.extents is not None else self._read_full
        return result if self._verified_read(key, e, lambda: read(e, dest)) else None

    def get_many(self, keys: Sequence[ContentKey], spec: ModalitySpec, expected_model: str,
                 out: torch.Tensor, sizes: Sequence[int]) -> list[bool]:
        """Several groups of one spec into ``out`` back to back (group ``i`` at the pages after
        ``sum(sizes[:i])``; ``sizes[i]`` must be its page count): the streaming read. Each file
        is the same verified lean read as ``get``, with one destination view and one look at
        the index for the whole batch, so a group costs little more than its syscalls. A group
        that cannot be read lean (layout not known yet, or any failure) takes ``get``, which
        reads it in full or counts and quarantines it. ``ok[i]`` as ``get``'s result."""
        if self._closed:
            raise ClosedError("disk tier is closed")
        dest = DestPages(spec, out, int(sum(sizes)))
        with self._lock:
            found = [self._index.get(k.digest) for k in keys]
        firsts = [int(f) for f in itertools.accumulate([0, *sizes[:-1]])] if len(sizes) else []

        def one(i: int) -> tuple[bool, int]:
            """(read, bytes) of group ``i``: lean, else ``get`` (a full read, or a counted miss)."""
            key, e, n, first = keys[i], found[i], sizes[i], firsts[i]
            if (e is not None and e.key == key and e.extents is not None and e.num_pages == n
                    and e.model == expected_model and layout_matches(e.layout, spec)):
                try:
                    part = dest.sub(first, n)
                    at = 0
                    for extent in e.extents:  # type: ignore[union-attr]
                        at += self._read_whole(extent, part)
                    if at == n:
                        return True, sum(extent.size for extent in e.extents)  # type: ignore[union-attr]
                except (OSError, CorruptDataError, ValueError):
                    pass
            if n == 0:                        # not on disk when the batch was formed: a miss
                self._count("misses")
                return False, 0
            return self.get(key, spec, expected_model, out=out[first:first + n]) is not None, -1

        # Reads run side by side (``read_threads``): preadv and the checksums release the GIL
        # for most of their time, and the disk serves several requests at once.
        if len(keys) > 1 and self.read_threads > 1:
            results = list(self._reader_pool().map(one, range(len(keys))))
        else:
            results = [one(i) for i in range(len(keys))]
        hits = sum(1 for done, nbytes in results if done and nbytes >= 0)
        with self._lock:
            self._counts["hits"] += hits
            self._counts["read_bytes"] += sum(nbytes for done, nbytes in results if done and nbytes > 0)
        return [done for done, _ in results]

    def _reader_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._readers is None:
                self._readers = concurrent.futures.ThreadPoolExecutor(self.read_threads,
                                                                      thread_name_prefix="mmtier-disk-read")
            return self._readers

    def get_layer(self, key: ContentKey, spec: ModalitySpec, expected_model: str, layer: int,
                  out: torch.Tensor | Sequence[torch.Tensor] | None = None
                  ) -> torch.Tensor | Sequence[torch.Tensor] | None:
        """Layer ``layer`` of the group's pages, ``[n, *spec.layer_shape]`` (``[n, 1, 2, P, H,
        D]`` for kv), verified against that layer's digests, or ``None`` exactly as ``get``
        (``out``: a tensor or contiguous runs of that shape, returned when given).

        Only that layer's bytes are read (``read_layer_extent``). A group whose layout is not known
        yet (found at a warm restart) is read once in full into a temporary, which teaches the
        index its layout, and the layer copied out."""
        if not 0 <= layer < spec.page_layers:
            raise ShapeError(f"layer {layer} out of range for {spec.name!r} ({spec.page_layers} layers)")
        e = self._entry(key, spec, expected_model)
        if e is None:
            return None
        result = out if out is not None else torch.empty(e.num_pages, *spec.layer_shape,
                                                         dtype=spec.torch_dtype)
        dest = DestPages(spec, result, e.num_pages, one_layer=True)
        if e.extents is None:
            full = self.get(key, spec, expected_model)
            if full is None:
                return None
            src, at = (full if spec.kind == "embedding" else full[:, layer:layer + 1]), 0
            for run in [result] if isinstance(result, torch.Tensor) else result:
                run.copy_(src[at:at + run.shape[0]])
                at += run.shape[0]
            return result
        return result if self._verified_read(key, e, lambda: self._read_layer(e, dest, layer)) else None

    def _entry(self, key: ContentKey, spec: ModalitySpec, expected_model: str) -> DiskEntry | None:
        """The index entry to read, or ``None`` (counted: a miss, or corrupt and quarantined)."""
        if self._closed:
            raise ClosedError("disk tier is closed")
        e = self.info(key)
        if e is None:
            self._count("misses")
            return None
        if e.model != expected_model or not layout_matches(e.layout, spec):
            self._corrupt(e, f"model/layout {e.model} {e.layout} != {expected_model} {layout_of(spec)}")
            return None
        return e

    def _verified_read(self, key: ContentKey, e: DiskEntry, read) -> bool:
        """Run ``read`` (returns the bytes it read); any failure is a miss: counted, and a
        corrupt group quarantined."""
        try:
            nbytes = read()
        except FileNotFoundError:
            if self.info(key) is None:  # removed while we read: an ordinary miss
                self._count("misses")
                return False
            if e.borrowed:              # its writer (another process) evicted it: a miss
                self.remove(key)
                self._count("misses")
                return False
            self._corrupt(e, "file vanished")
            return False
        except (OSError, pa.ArrowException, CorruptDataError, ValueError, KeyError, TypeError) as exc:
            self._corrupt(e, repr(exc))
            return False
        with self._lock:
            self._counts["hits"] += 1
            self._counts["read_bytes"] += nbytes
        return True

    def _read_known(self, e: DiskEntry, dest: DestPages) -> int:
        at = 0
        for extent in e.extents:  # type: ignore[union-attr]
            at += self._read_whole(extent, dest)
        if at != e.num_pages:
            raise CorruptDataError(f"{at} pages on disk, the group has {e.num_pages}")
        return sum(extent.size for extent in e.extents)  # type: ignore[union-attr]

    def _read_whole(self, extent: LayerExtent, dest: DestPages) -> int:
        """One file of a group whose layout is known into whole pages: with ``O_DIRECT``
        (``read_whole_direct``) where ``direct_reads`` and the file system allow it, else
        buffered (``read_whole``)."""
        path = os.path.join(self._dir_str, extent.name)
        if self.direct_reads:
            got = read_whole_direct(path, extent, dest, self._read_windows, self._window_pool())
            if got is not None:
                with self._lock:
                    self._counts["direct_read_files"] += 1
                return got
        return read_whole(path, extent, dest)

    def _window_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that read a direct read's next window while it checks this one (leaf
        tasks only, so the reader threads that wait on them cannot deadlock)."""
        with self._lock:
            if self._window_readers is None:
                self._window_readers = concurrent.futures.ThreadPoolExecutor(
                    max(1, self.read_threads) * (1 + AHEAD_WINDOWS), thread_name_prefix="mmtier-disk-window")
            return self._window_readers

    def _read_layer(self, e: DiskEntry, dest: DestPages, layer: int) -> int:
        at = 0
        for extent in e.extents:  # type: ignore[union-attr]
            at += read_layer_extent(os.path.join(self._dir_str, extent.name), extent, layer, dest,
                                    self.read_ahead_layers, self.direct_reads)
        if at != e.num_pages:
            raise CorruptDataError(f"{at} pages on disk, the group has {e.num_pages}")
        return at * dest.page_bytes

    def _read_full(self, e: DiskEntry, dest: DestPages) -> int:
        """Parse and verify every file (footer, metadata against the index, checksum column),
        then remember where the pages lie so the next read can be lean."""
        at, extents = 0, []
        for name in e.files:
            extent = read_file(self.dir / name, self._expected_group(e), at, dest)
            extents.append(extent)
            at += extent.num_pages
        if at != e.num_pages:
            raise CorruptDataError(f"{at} pages on disk, the group has {e.num_pages}")
        learned = dataclasses.replace(e, extents=tuple(extents))
        with self._lock:
            if self._index.get(e.key.digest) is e:
                self._index[e.key.digest] = learned
        return sum(extent.size for extent in extents)

    async def get_async(self, key: ContentKey, spec: ModalitySpec, expected_model: str,
                        out: torch.Tensor | Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.get, key, spec, expected_model, out)
