"""Attention over disk-resident groups, streamed in batches and computed as each one lands.

A decode step over a long context reads most of its bytes from disk, and the floor it is held
to is those bytes over the disk's bandwidth. ``DiskStream`` gets there by keeping the disk busy
and the cores busy at once:

- the disk-resident groups of one attention call are cut, per modality, into batches of about
  ``BATCH_BYTES`` (a long read: about ``MAX_BATCHES`` in all, each at most ``MAX_BATCH_BYTES``)
  and each batch is queued at once as one mover job (``Mover.fetch_many``: each group of the
  batch read with its verified lean read into one host buffer, taken from the cache's
  ``StagingPool`` and given back once the batch is computed, so a decode step does not pay
  fresh page faults for the buffers of the last one);
- an attention call is for one layer, so where a modality's pages hold several layers only
  that layer is read (``DiskTier.get_layer``: ``1/L`` of the group's bytes, one contiguous
  extent per file in the layer-major format, read with ``O_DIRECT`` into the page-aligned
  staging buffer where it can be, verified against that extent's digest) into a one-layer
  buffer, compiled with layer index 0;
- meanwhile the caller computes the device part, then the batches that have landed
  (``states(wait=False)``), then the host part;
- ``states`` then takes the remaining batches in the order they complete and runs the CPU path
  over each as soon as it has landed, so only the last batch's compute follows the last read;
- the stream changes no process-wide setting (torch's thread count is the owner's, set once
  if at all): several attention calls stream at once from different threads.

Each batch yields one partial ``(out, lse)``; the caller merges all partials exactly by
log-sum-exp. A group that is missing or fails verification is a miss: the rest of the stream
is drained, the failed groups are listed in ``failed`` (the cache drops them and counts
``corrupt_reads`` under its lock) and ``CorruptDataError`` is raised (the caller recomputes);
a partial answer is never returned. The stream knows nothing of the cache: it gets the mover,
the staging pool, the groups and their storage keys.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import torch

from ..content import ContentKey
from ..core.groups import ModalityGroup
from ..core.segments import Segment
from ..errors import CorruptDataError, MMTierError
from ..storage.mover import Mover
from ..storage.staging import StagingPool
from .compile import compile_segments
from .kernels import paged_attention

BATCH_BYTES = 8 << 20
# A call that reads more than BATCH_BYTES x MAX_BATCHES takes larger batches, up to
# MAX_BATCH_BYTES: each batch costs the caller's thread ~1.5 ms of Python beside the kernel
# (compile, page tables, the call), which at a 2M-token step was 7,168 batches and ~11 s; 64 a
# call (one layer) keep the read before the first batch's compute and the compute after the
# last read (the call's bubble) ~3 % of it.
MAX_BATCHES = 64
MAX_BATCH_BYTES = 64 << 20
# Batches read at once. With buffered reads more than 2 only fought over the GIL and the cores
# (each reader copied out of the page cache); with O_DIRECT layer reads a reader sleeps in the
# device, and 4 kept the disk busier: a read-only stream of 5.4 GB (Qwen2.5-VL shape, 131K
# tokens) ran at 1.17-1.37 GB/s against 0.87-1.07 with 2, and decode steps 5-30 % faster.
READERS = 4


class DiskStream:
    """The queued reads of one attention call's (one layer's) disk-resident groups."""

    def __init__(self, mover: Mover, staging: StagingPool, groups: Iterable[ModalityGroup],
                 keys: Sequence[ContentKey], layer: int, batch_bytes: int | None = None,
                 readers: int | None = None):
        self.mover = mover
        self.staging = staging
        groups = list(groups)
        self._keys = {g.gid: k for g, k in zip(groups, keys)}
        self.layer = layer
        batch_bytes_arg = batch_bytes
        batch_bytes = BATCH_BYTES if batch_bytes is None else batch_bytes
        self.batches: list[tuple[list[ModalityGroup], Future]] = []
        self._taken: set[Future] = set()
        self.failed: list[ModalityGroup] = []
        self._lock = threading.Lock()
        self._next = 0
        self._closed = False
        by_modality: dict[str, list[ModalityGroup]] = {}
        for g in {g.gid: g for g in groups}.values():
            by_modality.setdefault(g.modality, []).append(g)
        limit = batch_bytes
        if batch_bytes_arg is None:                 # a long read: fewer, larger batches
            total = sum(_read_bytes(g, _read_per_layer(g.spec)) for ms in by_modality.values() for g in ms)
            limit = min(max(batch_bytes, total // MAX_BATCHES), MAX_BATCH_BYTES)
        for members in by_modality.values():
            batch, size = [], 0
            per_layer = _read_per_layer(members[0].spec)
            for g in members:                       # batches sized by the bytes they read
                batch.append(g)
                size += _read_bytes(g, per_layer)
                if size >= limit:
                    self.batches.append((batch, Future()))
                    batch, size = [], 0
            if batch:
                self.batches.append((batch, Future()))
        for _ in range(READERS if readers is None else readers):
            self._start_next()

    def _start_next(self) -> None:
        """Hand the next batch to the mover; its completion starts the one after."""
        with self._lock:
            if self._next >= len(self.batches):
                return
            groups, result = self.batches[self._next]
            self._next += 1
        spec = groups[0].spec
        layer = self.layer if _read_per_layer(spec) else None   # just this layer's bytes of each page
        try:
            fut = self.mover.fetch_many([self._keys[g.gid] for g in groups], spec,
                                        layer=layer, staging=self.staging)
        except BaseException as exc:        # e.g. the mover closed: this batch fails, the next tries
            result.set_exception(exc)
            self._start_next()
            return

        def on_landed(f: Future) -> None:
            exc = f.exception()
            with self._lock:
                if exc is not None:
                    result.set_exception(exc)
                elif self._closed:          # nobody will compute it: the buffer goes back now
                    self.staging.give(f.result()[0])
                    result.cancel()
                else:
                    result.set_result(f.result())
            self._start_next()

        fut.add_done_callback(on_landed)

    def close(self) -> None:
        """The call is over (answered or failed): stop starting batches and give back the
        buffers of those that landed but were never computed."""
        with self._lock:
            self._closed = True
            self._next = len(self.batches)
        for _, fut in self.batches:
            if fut not in self._taken and fut.done() and not fut.cancelled() and fut.exception() is None:
                self._taken.add(fut)
                self.staging.give(fut.result()[0])

    @property
    def landed(self) -> bool:
        return all(fut.done() for _, fut in self.batches)

    def states(self, segments: list[Segment], q: torch.Tensor, q_indptr: torch.Tensor,
               q_pos: torch.Tensor, causal: bool, scale: float | None, timeout: float, *,
               wait: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Partial states of ``segments`` (all disk-resident, all in this stream), one per batch,
        computed in the order the batches complete. ``wait=False`` takes only the batches that
        have already landed (the caller has other work meanwhile) and raises nothing; the last
        call (``wait=True``) takes the rest and raises if any group failed (listed in
        ``failed``)."""
        by_gid: dict[int, list[Segment]] = {}
        for s in segments:
            by_gid.setdefault(s.group.gid, []).append(s)
        pending = {fut: groups for groups, fut in self.batches if fut not in self._taken}
        if wait:
            landed = concurrent.futures.as_completed(pending, timeout=timeout)
        else:
            landed = [fut for fut in pending if fut.done()]
        states = []
        for fut in landed:
            groups = pending[fut]
            self._taken.add(fut)
            try:
                pages, ok = fut.result()
            except (MMTierError, OSError):
                self.failed.extend(groups)
                continue
            try:
                self.failed.extend(g for g, good in zip(groups, ok) if not good)
                if self.failed:
                    continue                        # the answer is a miss: just drain
                at = 0 if _read_per_layer(groups[0].spec) else self.layer  # the layer within ``pages``
                states.append(_batch_state(groups, pages, by_gid, at, self.layer - at, q, q_indptr, q_pos,
                                           causal, scale))
            finally:
                self.staging.give(pages)          # computed (or dropped): the buffer is free
        if wait and self.failed:
            raise CorruptDataError(f"{len(self.failed)} disk group(s) missing or failed verification, "
                                   f"e.g. {self.failed[0]!r} (a miss)")
        return states


def _read_bytes(g: ModalityGroup, per_layer: bool) -> int:
    """The bytes a batch reads of ``g``: one layer of each page, or all of them."""
    return g.nbytes // g.spec.page_layers if per_layer else g.nbytes


def _read_per_layer(spec) -> bool:
    """Whether batches of ``spec`` read one layer of each page (its pages hold several)."""
    return spec.page_layers > 1


def _batch_state(groups, pages, by_gid, layer, scale_offset, q, q_indptr, q_pos, causal, scale):
    first, at = {}, 0
    for g in groups:
        first[g.gid] = at
        at += g.num_pages

    def view_of(g: ModalityGroup):
        return "disk", pages, list(range(first[g.gid], first[g.gid] + g.num_pages))

    segs = [s for g in groups for s in by_gid.get(g.gid, ())]
    ops = compile_segments(segs, layer, view_of, scale_offset)
    return paged_attention(q, q_indptr, q_pos, ops, causal=causal, scale=scale,
                           backend="torch", out_dtype=torch.float32)
