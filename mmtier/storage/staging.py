"""Reusable host buffers for streamed disk reads.

A decode step streams its disk-resident pages into host buffers, computes over them, and lets
them go; the next step does it again. Fresh buffers cost a page fault and a zeroed page for
every 4 KiB the read lands in, which on the development machine halved the speed of copying
file pages out of the page cache (1 -> 2 GB/s for the reads of a 600K-token decode). The pool
keeps released buffers, up to ``capacity_bytes`` in all, and hands them out again. It never
blocks: when nothing pooled is large enough, ``take`` allocates a new buffer. Every buffer
taken must be given back (``give``), even one that is not kept: the pool holds it until then.
Buffers start at a multiple of ``ALIGN`` (4 KiB), so disk reads may land in them with
``O_DIRECT`` (``layer_extent.read_direct``).
"""

from __future__ import annotations

import bisect
import threading

import torch

MIN_BYTES = 1 << 20
ALIGN = 4096


class StagingPool:
    """Byte buffers kept between uses, at most ``capacity_bytes`` of them. Thread-safe."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._free: list[tuple[int, int, torch.Tensor]] = []   # (nbytes, id, buffer), by size
        self._held = 0
        self._out: dict[int, torch.Tensor] = {}          # data_ptr -> buffer taken, until given back
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    @property
    def pooled_bytes(self) -> int:
        return self._held

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of at least ``nbytes`` starting at a multiple of ``ALIGN`` (the
        smallest pooled one that fits, or new)."""
        with self._lock:
            i = bisect.bisect_left(self._free, (nbytes, -1))
            if i < len(self._free):
                size, _, buf = self._free.pop(i)
                self._held -= size
                self.reused += 1
            else:
                buf = None
                self.allocated += 1
        if buf is None:
            size = max(nbytes, MIN_BYTES)
            raw = torch.empty(size + ALIGN, dtype=torch.uint8)
            skip = (-raw.data_ptr()) % ALIGN
            buf = raw[skip:skip + size]          # a view: it keeps ``raw`` alive
        with self._lock:
            self._out[buf.data_ptr()] = buf
        return buf

    def give(self, view: torch.Tensor) -> None:
        """Return the buffer ``view`` starts at (a buffer from ``take``, or a view of its start);
        kept if the pool has room, else dropped. Anything else is ignored."""
        with self._lock:
            buf = self._out.pop(view.data_ptr(), None)
            if buf is None:
                return
            size = buf.numel()
            if self._held + size <= self.capacity_bytes:
                bisect.insort(self._free, (size, id(buf), buf))
                self._held += size

    def pages(self, buf: torch.Tensor, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``n`` pages of ``shape`` and ``dtype`` at the start of ``buf``."""
        nbytes = n * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return buf[:nbytes].view(dtype).view(n, *shape)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._held = 0
