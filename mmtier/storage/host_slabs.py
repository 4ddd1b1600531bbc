"""Host slabs and the entries over them: the slots that hold a group's pages in host memory.

``Slab``: one spec's slots over an anonymous memory mapping (reserved address space, resident as
slots are first written), a free stack of slot ids (lowest first, so a slab stays compact),
page-locked in steps where CUDA exists. ``HostEntry``: one group's slots in a slab, with the xxh3
of each page taken as the copy into them landed; every read that copies a group out checks its
pages against them (``verify``, ``checked_pages``), so a changed byte is ``CorruptDataError``,
never wrong KV. ``HostTier`` (``host.py``) owns the slabs, the index, the readers' holds and the
byte budget.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from ..config import ModalitySpec
from ..content import ContentKey
from ..errors import CorruptDataError, MMTierError, ShapeError
from ..pages.copies import contiguous_runs
from .page_digests import copy_to_verified, page_rows_of

_PIN_STEP = 64 << 20
CHECK_BYTES = 4 << 20    # pages checked, then handed out together: they stay in the CPU's cache


def paired_runs(dst: Sequence[int], src: Sequence[int]) -> list[tuple[int, int, int]]:
    """``[(dst_start, src_start, length)]`` where both id lists advance by one together."""
    out: list[tuple[int, int, int]] = []
    for d, s in zip(dst, src):
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((d, s, 1))
    return out


class Slab:
    """Slots of one spec over an anonymous mapping; free stack of slot ids."""

    def __init__(self, spec: ModalitySpec, num_slots: int, pin: bool):
        self.spec = spec
        self.num_slots = num_slots
        self._map = mmap.mmap(-1, max(num_slots * spec.page_bytes, 1))
        flat = torch.frombuffer(self._map, dtype=torch.uint8)[: num_slots * spec.page_bytes]
        self.view = flat.view(spec.torch_dtype).view(num_slots, *spec.page_shape)
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self.pin = pin
        self.pinned_bytes = 0
        self.corrupt_reads = 0

    def take(self, n: int) -> list[int]:
        ids = self.free[-n:] if n else []
        if n:
            del self.free[-n:]
        ids.reverse()
        if self.pin and ids:
            self._pin_upto((max(ids) + 1) * self.spec.page_bytes)
        return ids

    def give(self, ids: Iterable[int]) -> None:
        self.free.extend(sorted(ids, reverse=True))

    def _pin_upto(self, nbytes: int) -> None:
        if nbytes <= self.pinned_bytes:
            return
        total = self.num_slots * self.spec.page_bytes
        end = min(total, -(-nbytes // _PIN_STEP) * _PIN_STEP)
        base = self.view.data_ptr() + self.pinned_bytes
        err = torch.cuda.cudart().cudaHostRegister(base, end - self.pinned_bytes, 0)
        if int(err) != 0:
            raise MMTierError(f"cudaHostRegister of {end - self.pinned_bytes} bytes failed: {err}")
        self.pinned_bytes = end

    def trim(self) -> int:
        """Give free slots' memory back to the OS; returns bytes advised away."""
        if self.pin:
            return 0
        page, pb, released = mmap.PAGESIZE, self.spec.page_bytes, 0
        for start, length in contiguous_runs(sorted(self.free)):
            lo = -(-(start * pb) // page) * page
            hi = ((start + length) * pb // page) * page
            if hi > lo:
                self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                released += hi - lo
        return released

    def unpin(self) -> None:
        if self.pin and self.pinned_bytes:
            torch.cuda.cudart().cudaHostUnregister(self.view.data_ptr())
            self.pinned_bytes = 0


@dataclass(eq=False)
class HostEntry:
    """One group's pages in a host slab. ``slots[i]`` holds page ``i`` of the group. Its tier
    (``HostTier``) owns the slab's free stack and counts the holds on it; readers reach the
    slab through ``view``, ``runs``, ``slab_view`` and ``pinned``."""

    key: ContentKey
    spec: ModalitySpec
    num_tokens: int
    slots: tuple[int, ...]
    _slab: Slab = field(repr=False)
    ready: object | None = field(default=None, repr=False)  # torch.cuda.Event of an async copy
    sums: tuple[int, ...] | None = field(default=None, repr=False)  # xxh3 of each page, once landed

    @property
    def num_pages(self) -> int:
        return len(self.slots)

    @property
    def nbytes(self) -> int:
        return len(self.slots) * self.spec.page_bytes

    @property
    def slab_view(self) -> torch.Tensor:
        """The whole slab the slots index, ``[num_slots, *page_shape]``, as it is now (no wait
        for a copy in: ``view()`` waits)."""
        return self._slab.view

    @property
    def pinned(self) -> bool:
        """Whether the slab is page-locked (copies to and from CUDA may be asynchronous)."""
        return self._slab.pin

    def corrupt(self, detail: str) -> CorruptDataError:
        """Count a read that found this entry's pages changed (the tier's ``corrupt_reads``)
        and return the error to raise: ``host copy of <key>: <detail>``."""
        self._slab.corrupt_reads += 1
        return CorruptDataError(f"host copy of {self.key!r}: {detail}")

    def slot_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.slots, dtype=torch.int32, device=device)

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slab_view [num_slots, *page_shape], slot_ids int32 [n])`` for in-place attention."""
        self.wait()
        return self._slab.view, self.slot_ids()

    def runs(self) -> list[torch.Tensor]:
        """The group's pages as contiguous slab slices, in page order (views, no copy)."""
        return [self._slab.view[s:s + n] for s, n in contiguous_runs(self.slots)]

    def gather(self) -> torch.Tensor:
        """A verified copy of the group's pages, ``[n, *page_shape]``."""
        self.verify()
        runs = self.runs()
        return runs[0].clone() if len(runs) == 1 else torch.cat(runs)

    def page_sums(self) -> list[int]:
        """The xxh3 of each page as the slab holds it now."""
        return [xxhash.xxh3_64_intdigest(row) for run in self.runs() for row in page_rows_of(run)]

    def verify(self) -> None:
        """Wait for the copy in, then check every page against its digest: ``CorruptDataError``
        (counted by the tier) when any differs."""
        self.wait()
        if self.sums is not None and self.page_sums() != list(self.sums):
            raise self.corrupt("page checksum mismatch")

    def checked_pages(self) -> Iterator[torch.Tensor]:
        """The group's pages in runs of consecutive slots of at most ``CHECK_BYTES`` (``[r,
        *page_shape]`` slab views, in page order), each page of a run checked against its digest
        just before the run is handed out, so a copy that takes it at once reads it from the
        CPU's cache, where the digest pass left it (one pass over memory instead of two; the
        digest's sequential read also runs ahead of a strided copy's). A mismatch raises
        ``CorruptDataError`` (counted) before its run is handed out; the runs before it were
        verified."""
        self.wait()
        per_run = max(1, CHECK_BYTES // self.spec.page_bytes)
        i = 0
        for run in self.runs():
            rows = page_rows_of(run)
            for j in range(0, run.shape[0], per_run):
                r = min(per_run, run.shape[0] - j)
                if self.sums is not None:
                    for q in range(j, j + r):
                        if xxhash.xxh3_64_intdigest(rows[q]) != self.sums[i + q - j]:
                            raise self.corrupt("page checksum mismatch")
                yield run[j:j + r]
                i += r

    def copy_to(self, dst_view: torch.Tensor, dst_ids: Sequence[int], *, check: bool = True) -> None:
        """Copy the verified pages into rows ``dst_ids`` of a page-major view (e.g. a device
        pool); asynchronous (``non_blocking``) from pinned slabs to a CUDA view. ``check=False``:
        the caller has just verified the entry itself."""
        if len(dst_ids) != len(self.slots):
            raise ShapeError(f"{len(dst_ids)} destination pages for a group of {len(self.slots)}")
        if check:
            self.wait()
            if copy_to_verified(self, dst_view, dst_ids):    # checked by the copy itself
                return
            self.verify()
        else:
            self.wait()
        blocking = not (dst_view.is_cuda and self._slab.pin)
        for d, s, n in paired_runs(list(dst_ids), self.slots):
            dst_view[d:d + n].copy_(self._slab.view[s:s + n], non_blocking=not blocking)

    def wait(self) -> None:
        """Block until the copy into the slots (if asynchronous) has landed; the pages'
        digests are taken then (from the slab, once)."""
        if self.ready is not None:
            self.ready.synchronize()  # type: ignore[attr-defined]
        if self.sums is None:
            self.sums = tuple(self.page_sums())

    @property
    def is_ready(self) -> bool:
        return self.ready is None or bool(self.ready.query())  # type: ignore[attr-defined]
