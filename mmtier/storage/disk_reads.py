"""The disk tier's verified reads: ``DiskReads``, given the tier's ``DiskIndex`` (``DiskTier``
delegates its reads to it; the index, the writes and the warm restart live in ``disk_index.py``,
``disk_writes.py`` and ``disk_restart.py``). It owns what reading takes: the reader threads, the
threads that read a direct read's next windows, the pool of aligned windows, and the read options
(``direct``, ``threads``, ``ahead_layers``).

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
  ``ahead_layers`` layers' extents handed to the kernel to read meanwhile), for per-layer
  attention calls.

Any failure is a miss: counted, the group's files quarantined, ``None``; never wrong data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import os
import threading
from collections.abc import Sequence

import pyarrow as pa
import torch

from ..config import ModalitySpec
from ..content import ContentKey
from ..errors import ClosedError, CorruptDataError, ShapeError
from .arrow_format import group_meta, layout_matches, layout_of, read_file
from .dest_pages import DestPages, DestTokens
from .direct_reads import AHEAD_WINDOWS, WINDOW_BYTES, read_whole_direct
from .disk_index import DiskEntry, DiskIndex
from .layer_extent import LayerExtent, read_layer_extent, read_whole
from .staging import StagingPool


class DiskReads:
    """The verified reads of the groups in ``index``. Thread-safe.

    ``direct``: whole files and aligned layer extents read with ``O_DIRECT`` (where the file
    system takes it); ``threads``: the files of a batch read side by side; ``ahead_layers``: a
    buffered layer read asks the kernel for the next ones meanwhile."""

    def __init__(self, index: DiskIndex, *, direct: bool, threads: int, ahead_layers: int):
        self._index = index
        self._dir = str(index.dir)
        self.direct = direct
        self.threads = threads
        self.ahead_layers = ahead_layers
        self._lock = threading.Lock()       # the thread pools, made on first use
        self._readers: concurrent.futures.ThreadPoolExecutor | None = None
        # whole-file reads with O_DIRECT through reused aligned windows, the next window read
        # (and the one after) while this one is checked and copied (``direct_reads``)
        self.windows = StagingPool((1 + AHEAD_WINDOWS) * threads * WINDOW_BYTES)
        self._window_readers: concurrent.futures.ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stop the thread pools (reads in flight finish first)."""
        with self._lock:
            pools, self._readers, self._window_readers = (self._readers, self._window_readers), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)

    def get(self, key: ContentKey, spec: ModalitySpec, expected_model: str,
            out: torch.Tensor | Sequence[torch.Tensor] | DestTokens | None = None
            ) -> torch.Tensor | Sequence[torch.Tensor] | DestTokens | None:
        """The group's pages ``[n, *page_shape]``, verified, or ``None`` (miss or corrupt).

        With ``out`` (a tensor or contiguous runs, e.g. ``HostEntry.runs()``) the pages land
        there and ``out`` is returned; with a ``DestTokens`` the group's tokens land in its K
        and V, one copy from the file's bytes. After a ``None`` its contents are undefined."""
        e = self._entry(key, spec, expected_model)
        if e is None:
            return None
        if isinstance(out, DestTokens):
            if out.total != e.num_pages:
                raise ShapeError(f"destination holds {out.total} pages, the group has {e.num_pages}")
            if e.extents is None:     # layout not known yet: read in full once, which learns it
                pages = self.get(key, spec, expected_model)
                if pages is None:
                    return None
                out.put_pages(pages)  # type: ignore[arg-type]
                return out
            return out if self._verified_read(key, e, lambda: self._read_known(e, out)) else None
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
        if self._index.closed:
            raise ClosedError("disk tier is closed")
        dest = DestPages(spec, out, int(sum(sizes)))
        found = self._index.by_digest(list(keys))
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
                self._index.count(misses=1)
                return False, 0
            return self.get(key, spec, expected_model, out=out[first:first + n]) is not None, -1

        # Reads run side by side (``threads``): preadv and the checksums release the GIL
        # for most of their time, and the disk serves several requests at once.
        if len(keys) > 1 and self.threads > 1:
            results = list(self._reader_pool().map(one, range(len(keys))))
        else:
            results = [one(i) for i in range(len(keys))]
        self._index.count(hits=sum(1 for done, nbytes in results if done and nbytes >= 0),
                          read_bytes=sum(nbytes for done, nbytes in results if done and nbytes > 0))
        return [done for done, _ in results]

    def _reader_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._readers is None:
                self._readers = concurrent.futures.ThreadPoolExecutor(self.threads,
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
        if self._index.closed:
            raise ClosedError("disk tier is closed")
        e = self._index.info(key)
        if e is None:
            self._index.count(misses=1)
            return None
        if e.model != expected_model or not layout_matches(e.layout, spec):
            self._index.corrupt(e, f"model/layout {e.model} {e.layout} != {expected_model} {layout_of(spec)}")
            return None
        return e

    def _verified_read(self, key: ContentKey, e: DiskEntry, read) -> bool:
        """Run ``read`` (returns the bytes it read); any failure is a miss: counted, and a
        corrupt group quarantined."""
        try:
            nbytes = read()
        except FileNotFoundError:
            if self._index.info(key) is None:  # removed while we read: an ordinary miss
                self._index.count(misses=1)
                return False
            if e.borrowed:              # its writer (another process) evicted it: a miss
                self._index.remove(key)
                self._index.count(misses=1)
                return False
            self._index.corrupt(e, "file vanished")
            return False
        except (OSError, pa.ArrowException, CorruptDataError, ValueError, KeyError, TypeError) as exc:
            self._index.corrupt(e, repr(exc))
            return False
        self._index.count(hits=1, read_bytes=nbytes)
        return True

    def _read_known(self, e: DiskEntry, dest: DestPages | DestTokens) -> int:
        at = 0
        for extent in e.extents:  # type: ignore[union-attr]
            at += self._read_whole(extent, dest)
        if at != e.num_pages:
            raise CorruptDataError(f"{at} pages on disk, the group has {e.num_pages}")
        return sum(extent.size for extent in e.extents)  # type: ignore[union-attr]

    def _read_whole(self, extent: LayerExtent, dest: DestPages | DestTokens) -> int:
        """One file of a group whose layout is known into whole pages (or the group's tokens): with ``O_DIRECT``
        (``read_whole_direct``) where ``direct_reads`` and the file system allow it, else
        buffered (``read_whole``)."""
        path = os.path.join(self._dir, extent.name)
        if self.direct:
            got = read_whole_direct(path, extent, dest, self.windows, self._window_pool())
            if got is not None:
                self._index.count(direct_read_files=1)
                return got
        return read_whole(path, extent, dest)

    def _window_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that read a direct read's next window while it checks this one (leaf
        tasks only, so the reader threads that wait on them cannot deadlock)."""
        with self._lock:
            if self._window_readers is None:
                self._window_readers = concurrent.futures.ThreadPoolExecutor(
                    max(1, self.threads) * (1 + AHEAD_WINDOWS), thread_name_prefix="mmtier-disk-window")
            return self._window_readers

    def _read_layer(self, e: DiskEntry, dest: DestPages, layer: int) -> int:
        at = 0
        for extent in e.extents:  # type: ignore[union-attr]
            at += read_layer_extent(os.path.join(self._dir, extent.name), extent, layer, dest,
                                    self.ahead_layers, self.direct)
        if at != e.num_pages:
            raise CorruptDataError(f"{at} pages on disk, the group has {e.num_pages}")
        return at * dest.page_bytes

    def _read_full(self, e: DiskEntry, dest: DestPages) -> int:
        """Parse and verify every file (footer, metadata against the index, checksum column),
        then remember where the pages lie so the next read can be lean."""
        at, extents = 0, []
        expected = group_meta(e.key.to_wire(), e.model, e.layout, e.num_tokens, e.num_pages, len(e.files))
        for name in e.files:
            extent = read_file(self._index.dir / name, expected, at, dest)
            extents.append(extent)
            at += extent.num_pages
        if at != e.num_pages:
            raise CorruptDataError(f"{at} pages on disk, the group has {e.num_pages}")
        self._index.learn(e, dataclasses.replace(e, extents=tuple(extents)))
        return sum(extent.size for extent in extents)

    async def get_async(self, key: ContentKey, spec: ModalitySpec, expected_model: str,
                        out: torch.Tensor | Sequence[torch.Tensor] | DestTokens | None = None
                        ) -> torch.Tensor | Sequence[torch.Tensor] | DestTokens | None:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.get, key, spec, expected_model, out)
