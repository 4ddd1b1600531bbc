"""The host tier: page-major slabs in host memory, one per modality spec, bounded in bytes.

Each spec gets one slab, a view ``[num_slots, *spec.page_shape]`` over an anonymous memory
mapping sized to the whole budget (``capacity_bytes // page_bytes`` slots). The mapping only
reserves address space: memory becomes resident as slots are first written, and slots are
handed out lowest-first from a free stack (O(1) per slot), so each slab stays compact. The
budget is shared by all specs and enforced in bytes: ``used_bytes <= capacity_bytes`` always.
``trim()`` gives the memory of free slots back to the OS (unpinned slabs).

Where CUDA exists (``pin_memory=None`` means "when CUDA is available"), the touched part of
each slab is page-locked with ``cudaHostRegister`` in 64 MiB steps, so copies from the GPU
run asynchronously on a side stream; the entry then carries a CUDA event (``entry.ready``),
and ``entry.wait()`` blocks until the copy landed.

Interface (mechanism only; the cache decides what lives here)::

    host = HostTier(capacity_bytes=256 << 20)
    entry = host.put(key, spec, num_tokens, pages)          # pages: [n, *page_shape], n =
                                                            # spec.pages_for(num_tokens)
    entry = host.put(key, spec, num_tokens, pool.view, page_ids=ids)   # rows of a page-major
                                                            # view, copied run by run (no gather)
    host.contains(key); entry = host.get(key)               # None on a miss
    slab_view, slot_ids = entry.view()                      # in-place CPU attention: a PagedKV
                                                            # over slab_view with these page ids
    entry.gather()                                          # [n, *page_shape] copy
    host.remove(key); host.close()

Verified reads: every entry keeps the xxh3 of each of its pages (``entry.sums``), taken from
the slab by the copy into it (``page_digests``: from the copy's own registers where the native
helper is built, else each chunk hashed right after it landed, while cache-hot; the disk files
keep the same digests). Reads that copy a
group *out* (``gather``, ``copy_to``, the cache's ``read_group``) check every page against them,
first (``verify``) or, with the native helper, as the copy moves it (``copy_to_verified``,
``copy_out_verified``: the bad page's destination poisoned): a mismatch is ``CorruptDataError`` (the owner treats it as a miss) and
counted (``corrupt_reads``), never wrong KV. In-place CPU attention over ``view()`` reads the
slab as it is (one check per attention call would cost more than the attention).

A put that lacks room raises ``CapacityError`` and changes nothing. Readers that copy *out of*
an entry while the owner may remove it take a hold (``hold(key)`` / ``release(entry)``): a held
entry leaves the index on ``remove`` but its slots return to the free stack only when the last
hold is released, so a slot is never reused while a copy from it is in flight. The mover uses
``reserve`` / ``commit`` / ``abort`` to restore from disk straight into slab slots.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch

from ..config import ModalitySpec
from ..content import ContentKey
from ..errors import (
    CapacityError,
    ClosedError,
    DTypeError,
    MMTierError,
    ShapeError,
    UnknownModalityError,
)
from ..native import rows as native_rows
from ..pages.copies import kv_into_pages
from .host_slabs import CHECK_BYTES, HostEntry, Slab, paired_runs
from .page_digests import copy_and_digest, copy_in_digested, kv_in_digested, page_rows_of
from .tier import StorageTier

__all__ = ["CHECK_BYTES", "HostEntry", "HostTier", "paired_runs", "write_host_slots"]


class HostTier(StorageTier):
    """Page-major host slabs, one per spec, under one byte budget. Thread-safe."""

    def __init__(self, capacity_bytes: int, *, pin_memory: bool | None = None):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._lock = threading.Lock()
        self._slabs: dict[str, Slab] = {}
        self._index: dict[bytes, HostEntry] = {}
        self._pending: dict[bytes, HostEntry] = {}
        self._holds: dict[HostEntry, int] = {}     # entries held by readers: their holds
        self._dropped: set[HostEntry] = set()      # held entries removed: freed at the last release
        self._used = 0
        self._closed = False
        self._streams: dict[int, object] = {}
        self._counts = {"puts": 0, "hits": 0, "misses": 0, "capacity_rejects": 0, "removes": 0}

    # ---- accounting ----
    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self._used

    def stats(self) -> dict[str, object]:
        with self._lock:
            pages: dict[str, int] = {}
            groups: dict[str, int] = {}
            for e in self._index.values():
                pages[e.spec.name or "?"] = pages.get(e.spec.name or "?", 0) + e.num_pages
                groups[e.spec.name or "?"] = groups.get(e.spec.name or "?", 0) + 1
            return {"capacity_bytes": self.capacity_bytes, "used_bytes": self._used,
                    "corrupt_reads": sum(slab.corrupt_reads for slab in self._slabs.values()),
                    "free_bytes": self.capacity_bytes - self._used, "groups": len(self._index),
                    "pages_by_modality": pages, "groups_by_modality": groups,
                    "pinned": self.pin_memory, **self._counts}

    # ---- the tier interface ----
    def contains(self, key: ContentKey) -> bool:
        with self._lock:
            e = self._index.get(key.digest)
            return e is not None and e.key == key

    def get(self, key: ContentKey) -> HostEntry | None:
        with self._lock:
            e = self._index.get(key.digest)
            if e is None or e.key != key:
                self._counts["misses"] += 1
                return None
            self._counts["hits"] += 1
            return e

    def put(self, key: ContentKey, spec: ModalitySpec, num_tokens: int, pages: torch.Tensor,
            page_ids: Sequence[int] | None = None) -> HostEntry:
        """Copy a group in. ``pages``: ``[n, *page_shape]``, or a page-major view whose rows
        ``page_ids`` are the group's pages. Idempotent: a key already here returns its entry."""
        n = spec.pages_for(num_tokens)
        _check_pages(spec, n, pages, page_ids)
        with self._lock:
            existing = self._index.get(key.digest)
        if existing is not None and existing.key == key:
            return existing
        entry = self.reserve(key, spec, num_tokens)
        try:
            self._copy_in(entry, pages, page_ids)
        except BaseException:
            self.abort(entry)
            raise
        return self.commit(entry)

    def remove(self, key: ContentKey) -> bool:
        """Drop a group; ``False`` when absent. Held slots are freed at the last release."""
        with self._lock:
            e = self._index.get(key.digest)
            if e is None or e.key != key:
                return False
            del self._index[key.digest]
            self._counts["removes"] += 1
            if e in self._holds:
                self._dropped.add(e)
            else:
                self._free(e)
            return True

    def close(self) -> None:
        """Drop every group and the slabs. Later calls raise ``ClosedError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for e in list(self._index.values()) + list(self._pending.values()):
                e.wait()
            self._index.clear()
            self._pending.clear()
            for slab in self._slabs.values():
                slab.unpin()
            self._slabs.clear()
            self._used = 0

    # ---- batched forms (contains_many / remove_many: StorageTier) ----
    def get_many(self, keys: Iterable[ContentKey]) -> list[HostEntry | None]:
        return [self.get(k) for k in keys]

    # ---- holds: no slot is reused while a copy from it is in flight ----
    def hold(self, key: ContentKey) -> HostEntry | None:
        with self._lock:
            e = self._index.get(key.digest)
            if e is None or e.key != key:
                return None
            self._holds[e] = self._holds.get(e, 0) + 1
            return e

    def release(self, entry: HostEntry) -> None:
        with self._lock:
            holds = self._holds.get(entry, 0)
            if holds <= 0:
                raise MMTierError(f"release of an unheld host entry {entry.key!r}")
            if holds > 1:
                self._holds[entry] = holds - 1
                return
            del self._holds[entry]
            if entry in self._dropped:
                self._dropped.discard(entry)
                if not self._closed:
                    self._free(entry)

    # ---- two-phase put (restore from disk straight into slots) ----
    def reserve(self, key: ContentKey, spec: ModalitySpec, num_tokens: int) -> HostEntry:
        """Slots for a group, invisible until ``commit``; ``CapacityError`` changes nothing."""
        if spec.name != key.modality:
            raise UnknownModalityError(f"key of modality {key.modality!r} with spec {spec.name!r}")
        n = spec.pages_for(num_tokens)
        need = n * spec.page_bytes
        with self._lock:
            if self._closed:
                raise ClosedError("host tier is closed")
            if key.digest in self._index or key.digest in self._pending:
                raise MMTierError(f"host tier already holds or is filling {key!r}")
            slab = self._slab(spec)
            if need > self.capacity_bytes - self._used or n > len(slab.free):
                self._counts["capacity_rejects"] += 1
                raise CapacityError(f"host tier: {need} bytes wanted, "
                                    f"{self.capacity_bytes - self._used} of {self.capacity_bytes} free")
            entry = HostEntry(key, spec, num_tokens, tuple(slab.take(n)), slab)
            self._used += need
            self._pending[key.digest] = entry
            return entry

    def commit(self, entry: HostEntry) -> HostEntry:
        if entry.ready is None and entry.sums is None:     # filled synchronously: digests now
            entry.sums = tuple(entry.page_sums())
        with self._lock:
            if self._closed:
                raise ClosedError("host tier is closed")
            if self._pending.pop(entry.key.digest, None) is not entry:
                raise MMTierError(f"commit of an entry that is not pending: {entry.key!r}")
            self._index[entry.key.digest] = entry
            self._counts["puts"] += 1
            return entry

    def abort(self, entry: HostEntry) -> None:
        with self._lock:
            if self._pending.get(entry.key.digest) is entry:
                del self._pending[entry.key.digest]
                if not self._closed:
                    self._free(entry)

    def trim(self) -> int:
        """Return the memory of free slots to the OS (unpinned slabs); bytes released."""
        with self._lock:
            return sum(slab.trim() for slab in self._slabs.values())

    def slab_view(self, spec: ModalitySpec) -> torch.Tensor:
        """The whole slab of a spec, ``[num_slots, *page_shape]`` (created on first use)."""
        with self._lock:
            return self._slab(spec).view

    # ---- internals (lock held where noted) ----
    def _slab(self, spec: ModalitySpec) -> Slab:  # lock held
        name = spec.name or ""
        slab = self._slabs.get(name)
        if slab is None:
            slab = Slab(spec, self.capacity_bytes // spec.page_bytes, self.pin_memory)
            self._slabs[name] = slab
        elif slab.spec is not spec and slab.spec != spec:     # identity first: pydantic's == costs µs
            raise ShapeError(f"host slab {name!r} has layout {slab.spec.layout_fields()}, "
                             f"got {spec.layout_fields()}")
        return slab

    def _free(self, e: HostEntry) -> None:  # lock held
        self._slabs[e.spec.name or ""].give(e.slots)
        self._used -= e.nbytes

    def _copy_in(self, entry: HostEntry, pages: torch.Tensor, page_ids: Sequence[int] | None) -> None:
        view = entry.slab_view
        src_ids = list(page_ids) if page_ids is not None else list(range(entry.num_pages))
        runs = paired_runs(list(entry.slots), src_ids)
        if not pages.is_cuda:
            digested = copy_in_digested(view, entry.slots, pages, src_ids)   # one pass, in C
            if digested is not None:
                entry.sums = tuple(digested)
                return
            sums: list[int] | None = []
            for d, s, n in runs:
                src = pages[s:s + n]
                if src.is_contiguous() and sums is not None:
                    sums.extend(copy_and_digest(page_rows_of(view[d:d + n]), page_rows_of(src)))
                else:
                    view[d:d + n].copy_(src)
                    sums = None                # taken at commit, from the slab
            entry.sums = tuple(sums) if sums else None
            return
        stream = self._side_stream(pages.device)
        stream.wait_stream(torch.cuda.current_stream(pages.device))
        with torch.cuda.stream(stream):
            for d, s, n in runs:
                view[d:d + n].copy_(pages[s:s + n], non_blocking=entry.pinned)
            pages.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        entry.ready = event

    def _side_stream(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = torch.cuda.Stream(device=index)
                self._streams[index] = stream
            return stream


def write_host_slots(host: HostTier, entry: HostEntry, k, v, tally: native_rows.Tally | None = None) -> None:
    """A put's K/V into the slots of a reserved ``entry`` (``HostTier.reserve``), in one copy: the
    tokens of ``[L, n, H, D]`` CPU tensors by the native copy that also takes each page's xxh3
    and (``tally``) tests each element for NaN / Inf (``page_digests.kv_in_digested``); any other
    form (block-split, an engine's blocks, another device) by the page copies (``kv_into_pages``),
    the digests then taken from the slab at ``commit``."""
    view = host.slab_view(entry.spec)
    sums = kv_in_digested(view, entry.slots, k, v, tally)
    if sums is not None:
        entry.sums = tuple(sums)
        return
    kv_into_pages(view, entry.slots, k, v, tally)


def _check_pages(spec: ModalitySpec, n: int, pages: torch.Tensor, page_ids: Sequence[int] | None) -> None:
    if not isinstance(pages, torch.Tensor):
        raise DTypeError(f"pages must be a torch.Tensor, got {type(pages).__name__}")
    if pages.dtype != spec.torch_dtype:
        raise DTypeError(f"{spec.name}: pages are {pages.dtype}, spec wants {spec.torch_dtype}")
    if tuple(pages.shape[1:]) != tuple(spec.page_shape):
        raise ShapeError(f"{spec.name}: page shape {tuple(pages.shape[1:])} != {spec.page_shape}")
    if page_ids is None:
        if pages.shape[0] != n:
            raise ShapeError(f"{spec.name}: {pages.shape[0]} pages for {n} needed")
    else:
        if len(page_ids) != n:
            raise ShapeError(f"{spec.name}: {len(page_ids)} page ids for {n} pages needed")
        if any(not 0 <= int(i) < pages.shape[0] for i in page_ids):
            raise ShapeError(f"{spec.name}: page id out of range [0, {pages.shape[0]})")
