"""Reusable host buffers for streamed disk reads.

A decode step streams its disk-resident pages into host buffers, computes over them, and lets
them go; the next step does it again. Fresh buffers cost a page fault and a zeroed page for
every 4 KiB the read lands in, which on the development machine halved the speed of copying
file pages out of the page cache (1 -> 2 GB/s for the reads of a 600K-token decode). The pool
keeps released buffers, up to ``capacity_bytes`` in all, and hands them out again. It never
blocks: when nothing pooled is large enough, ``take`` allocates a new buffer. Every buffer
taken must be given back (``give``), even one that is not kept: the pool holds it until then.
Buffers start at a multiple of ``ALIGN`` (4 KiB), so disk reads may land in them with
``O_DIRECT`` (``layer_extent.read_direct``). Buffers of ``HUGE`` (2 MiB) or more start on a
2 MiB boundary and are marked for transparent huge pages (``MADV_HUGEPAGE``, best effort): a
direct read or write is cut into requests of at most ``max_segments`` contiguous pieces of
memory, so on 4 KiB pages a request carries about 1 MiB, on huge pages the device's largest
(4 MiB here). On the development VM that doubled direct reads (16 x 32 MiB files, 4 at a time:
0.9 -> 1.8 GB/s; page-cache reads 1.2-1.3).

``empty`` lends pooled memory to a caller that keeps what it gets (the tensors ``read_group``
returns without ``out=``): a tensor of exactly the size asked for over a pooled buffer, which
comes back to the pool when the last tensor over it is gone (a finalizer on the array the
tensor's storage holds; it only queues the buffer, ``take`` files it), so a caller reading
group after group writes into memory already faulted in, as with ``out=``.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import math
import sys
import threading
import weakref

import torch

MIN_BYTES = 1 << 20
LEND_MIN_BYTES = 1 << 20     # ``empty`` of less: a plain new tensor (its faults cost next to nothing)
LEND_SLACK = 2               # ``empty`` takes a pooled buffer of at most this many times its size
ALIGN = 4096
HUGE = 2 << 20
_MADV_HUGEPAGE = 14


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
        self._returned: collections.deque[torch.Tensor] = collections.deque()   # lent, now free

    @property
    def pooled_bytes(self) -> int:
        return self._held

    def take(self, nbytes: int, *, most: int | None = None) -> torch.Tensor:
        """A uint8 tensor of at least ``nbytes`` starting at a multiple of ``ALIGN`` (the
        smallest pooled one that fits and holds at most ``most`` bytes, or new)."""
        while self._returned:                       # lent buffers whose tensors are gone
            self.give(self._returned.popleft())
        with self._lock:
            i = bisect.bisect_left(self._free, (nbytes, -1))
            if i < len(self._free) and (most is None or self._free[i][0] <= most):
                size, _, buf = self._free.pop(i)
                self._held -= size
                self.reused += 1
            else:
                buf = None
                self.allocated += 1
        if buf is None:
            buf = aligned_buffer(max(nbytes, MIN_BYTES))
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

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new contiguous tensor for a caller to keep, over pooled memory from
        ``LEND_MIN_BYTES`` on (see the module's docstring); its storage is exactly its bytes."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes < LEND_MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        buf = self.take(nbytes, most=LEND_SLACK * nbytes)
        arr = buf.numpy()[:nbytes]                  # the storage below holds this array
        fin = weakref.finalize(arr, self._returned.append, buf)
        fin.atexit = False
        return torch.from_numpy(arr).view(dtype).view(shape)

    def pages(self, buf: torch.Tensor, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``n`` pages of ``shape`` and ``dtype`` at the start of ``buf``."""
        nbytes = n * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return buf[:nbytes].view(dtype).view(n, *shape)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._held = 0


def aligned_buffer(size: int) -> torch.Tensor:
    """A new uint8 tensor of ``size`` bytes starting at a multiple of ``ALIGN``; from ``HUGE``
    bytes on, at a multiple of ``HUGE`` and advised to be backed by huge pages."""
    align = HUGE if size >= HUGE else ALIGN
    raw = torch.empty(size + align, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % align
    buf = raw[skip:skip + size]                  # a view: it keeps ``raw`` alive
    if align == HUGE:
        _advise_huge(buf.data_ptr(), size - size % HUGE)
    return buf


def _advise_huge(addr: int, length: int) -> None:
    libc = _libc()
    if libc is not None and length:
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_HUGEPAGE)  # failure: 4 KiB pages


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):      # MADV_HUGEPAGE is Linux's
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None
