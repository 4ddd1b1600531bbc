"""PagePoolActor logic: one device's ``TieredKVCache`` served to the cluster (plain class, no Ray).

What the cluster asks of a pool, all in wire terms (``ContentKey.to_wire()`` dicts, tensors):

- groups: ``put`` / ``put_embedding`` / ``get_embedding`` / ``holds`` / ``inventory``;
- sequences homed here: ``create`` / ``append`` / ``attach`` / ``release`` (local handles);
- remote use of groups held here by sequences homed elsewhere: a *proxy sequence* per (remote
  sequence, this pool) attaches the groups (so this cache pins them while referenced);
- partial attention: ``attend(parts, ...)`` over local handles, each part with the offset
  between its local positions and the cluster sequence's absolute positions, merged here by
  log-sum-exp: only ``q`` and ``(out, lse)`` travel;
- copies: ``export`` gives a group's pages as one raw page-major buffer (numpy ``uint8``) and
  ``import_group`` takes one, so a group moves between nodes as plain bytes through the object
  store and lands in pages of the same layout.

Every mutating call returns the digests this cache evicted meanwhile (``take_evicted``), so the
caller can tell the registry at once. With a disk tier (``cfg.disk_dir``) groups the device must
give up move to disk whole and stay held here (tier ``"disk"``; attention and export read them
from there); only groups dropped at the bottom, or whose disk copy failed verification (a miss),
leave. A read that finds a corrupt copy raises ``CorruptDataError`` and reports the group
through ``on_lost`` (the actor tells the registry). A pool recreated over the same directory
adopts its groups. Page export / import uses ``TieredKVCache``'s parts (``cache.index``: its
groups and ``insert``, ``cache.residency``: ``allocate``, ``read_pages``) in the two helpers at
the bottom: the seam to replace by public ``export_pages`` / ``import_pages`` methods of the
cache.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..cache import TieredKVCache
from ..config import CacheConfig
from ..content import ContentKey
from ..core.groups import Tier
from ..core.segments import SequenceHandle
from ..errors import CorruptDataError, ShapeError, UnknownKeyError
from ..storage.arrow_format import page_sums
from .transfer_sums import check_pages, expected_sums, with_sums

_TIER_NAMES = {Tier.DEVICE: "device", Tier.HOST: "host", Tier.DISK: "disk"}


@dataclass(frozen=True)
class Part:
    """A slice of a cluster sequence's attention: local handle, position offset, group filter."""

    seq: SequenceHandle
    offset: int                                  # absolute position = local position + offset
    keys: tuple[dict[str, str], ...] | None      # None: every segment of the handle
    start: int | None = None                     # only the segment at this local position


def group_item(key: ContentKey, num_tokens: int, nbytes: int, tier: str, refs: int = 0) -> dict:
    """The registry's record of one held group."""
    return {"key": key.to_wire(), "tier": tier, "num_tokens": num_tokens, "nbytes": nbytes, "refs": refs}


class PoolService:
    """The logic of a PagePoolActor (also used, with a CPU config, for CPU-only nodes)."""

    kind = "pool"

    def __init__(self, cfg: CacheConfig, *, name: str, node: str):
        self.cfg = cfg
        self.name = name
        self.node = node
        self.cache = TieredKVCache(cfg)
        self._lock = threading.RLock()
        self._handles: dict[int, SequenceHandle] = {}
        self._evictions_seen = 0
        self._known: set[ContentKey] = set(self.cache.index.groups)   # adopted from disk, if any
        self.on_lost: Callable[[list[str]], None] | None = None  # groups gone outside a mutating call

    # ------------------------------------------------------------------ identity and inventory
    def ping(self) -> dict[str, str]:
        return {"name": self.name, "node": self.node, "kind": self.kind}

    def inventory(self) -> list[dict]:
        """Every content-keyed group this cache holds (the registry rebuilds itself from these)."""
        with self.cache.lock:
            return [group_item(k, g.num_tokens, g.nbytes, _TIER_NAMES[g.tier], g.refs)
                    for k, g in self.cache.index.groups.items()]

    def holds(self, wires: Sequence[dict[str, str]]) -> list[bool]:
        with self.cache.lock:
            groups = self.cache.index.groups
            return [ContentKey.from_wire(w) in groups for w in wires]

    # ------------------------------------------------------------------ groups
    def put(self, wire: dict[str, str], k: torch.Tensor, v: torch.Tensor) -> tuple[dict | None, list[str]]:
        """Store a group; ``(item or None when already held, evicted digests)``."""
        key = ContentKey.from_wire(wire)
        with self._lock:
            stored = self.cache.put(key, k, v)
            return (self.held_item(key) if stored else None), self.take_evicted()

    def put_embedding(self, wire: dict[str, str], x: torch.Tensor) -> tuple[dict | None, list[str]]:
        key = ContentKey.from_wire(wire)
        with self._lock:
            stored = self.cache.put_embedding(key, x)
            return (self.held_item(key) if stored else None), self.take_evicted()

    def get_embedding(self, wire: dict[str, str]) -> torch.Tensor:
        try:
            return self.cache.get_embedding(ContentKey.from_wire(wire))
        except CorruptDataError:
            self._report_lost()
            raise

    def export(self, wire: dict[str, str], *, copy: bool = True) -> tuple[dict, np.ndarray]:
        """A group's pages as one page-major raw buffer, with the token count to rebuild it
        (``copy=False``: a view of the arena where it can be one; see ``export_pages``)."""
        try:
            return export_pages(self.cache, ContentKey.from_wire(wire), copy=copy)
        except CorruptDataError:
            self._report_lost()
            raise

    def import_group(self, wire: dict[str, str], meta: dict, buf: np.ndarray) -> tuple[dict | None, list[str]]:
        """Store a group shipped by ``export`` (``None`` when it was already here)."""
        key = ContentKey.from_wire(wire)
        with self._lock:
            stored = import_pages(self.cache, key, meta, buf)
            return (self.held_item(key) if stored else None), self.take_evicted()

    def drop(self, wires: Sequence[dict[str, str]]) -> list[str]:
        """Drop unreferenced groups (an explicit move elsewhere); returns the dropped digests."""
        with self._lock, self.cache.lock:
            out = []
            for w in wires:
                g = self.cache.index.groups.get(ContentKey.from_wire(w))
                if g is not None and g.evictable:
                    self.cache.residency.free_group(g)
                    out.append(w["digest"])
            self._known.difference_update(ContentKey.from_wire(w) for w in wires if w["digest"] in out)
            return out

    # ------------------------------------------------------------------ sequences
    def create(self, tenant: str) -> SequenceHandle:
        with self._lock:
            h = self.cache.create_sequence(tenant)
            self._handles[h.id] = h
            return h

    def append(self, seq: SequenceHandle | None, tenant: str, modality: str, k: torch.Tensor,
               v: torch.Tensor, tokens: Sequence[int] | None = None) -> tuple[SequenceHandle, list[str]]:
        """Append to ``seq`` (a fresh local run when ``None``); ``(handle, evicted)``."""
        with self._lock:
            created = seq is None
            if created:
                seq = self.create(tenant)
            try:
                self.cache.append(seq, modality, k, v, tokens=tokens)
            except Exception:
                if created:
                    self.release([seq])
                raise
            return seq, self.take_evicted()

    def attach(self, seq: SequenceHandle | None, tenant: str, wire: dict[str, str]
               ) -> tuple[SequenceHandle, int, int, list[str]]:
        """Attach a held group to ``seq`` (created here when ``None``: a proxy or a fresh local
        run); returns ``(handle, local start, tokens, evicted)``."""
        key = ContentKey.from_wire(wire)
        with self._lock:
            created = seq is None
            if created:
                seq = self.create(tenant)
            try:
                start = self.cache.sequence(seq).length
                self.cache.seqs.attach(seq, key, placed=True)   # a part of a sequence whose client
                                                            # checked the key's place in it
            except Exception:
                if created:
                    self.release([seq])
                raise
            n = self.cache.sequence(seq).segments[-1].num_tokens
            return seq, start, n, self.take_evicted()

    def release(self, seqs: Sequence[SequenceHandle]) -> int:
        """Release local handles (unknown ones are skipped: release is idempotent)."""
        n = 0
        with self._lock:
            for s in seqs:
                if self._handles.pop(s.id, None) is not None:
                    self.cache.release(s)
                    n += 1
        return n

    # ------------------------------------------------------------------ attention
    def attend(self, parts: Sequence[Part], layer: int, q: torch.Tensor, q_pos: torch.Tensor,
               causal: bool = True, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention of ``q`` (absolute positions ``q_pos``) over every part, in one
        call (a cluster sequence's runs here and its remote groups on this pool, each at its
        own offset: one kernel pass, not one per part)."""
        if not parts:
            raise ShapeError("attend needs at least one part")
        try:
            return self.cache.attention_state_parts(
                [(p.seq, None if p.keys is None else [ContentKey.from_wire(w) for w in p.keys], p.offset, p.start)
                 for p in parts], layer, q, q_pos, causal=causal, scale=scale)
        except CorruptDataError:
            self._report_lost()
            raise

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        return self.cache.stats().to_dict()

    def leak_report(self) -> dict[str, int]:
        """Pages in use against pages of cached groups: equal when no sequence leaked pages."""
        with self.cache.lock:
            used = sum(p.num_used for p in self.cache.pools.values())
            cached = sum(len(g.pages) for g in self.cache.index.groups.values() if g.tier == Tier.DEVICE)
            return {"sequences": len(self.cache.seqs.tables), "handles": len(self._handles),
                    "used_pages": used, "cached_pages": cached, "leases": len(self.cache.leases)}

    def close(self) -> None:
        self.cache.close()

    # ------------------------------------------------------------------ what the registry is told
    def held_item(self, key: ContentKey) -> dict:
        """The registry's item for a group held here (``group_item``); from now on its leaving
        is reported by ``take_evicted``."""
        with self.cache.lock:
            g = self.cache.index.groups[key]
            self._known.add(key)
            return group_item(key, g.num_tokens, g.nbytes, _TIER_NAMES[g.tier], g.refs)

    def take_evicted(self) -> list[str]:
        """Digests of groups this cache dropped (evicted at the bottom, or a corrupt disk copy
        forgotten) since the last call; cheap when none were. Groups moved to disk stay."""
        total = self.cache.counters.total
        n = total["evictions"] + total["corrupt_reads"]
        if n == self._evictions_seen:
            return []
        self._evictions_seen = n
        with self.cache.lock:
            gone = [k for k in self._known if k not in self.cache.index.groups]
        self._known.difference_update(gone)
        return [k.hex for k in gone]

    def _report_lost(self) -> None:
        """A read found a corrupt copy (the cache forgot the group): tell ``on_lost``."""
        with self._lock:
            gone = self.take_evicted()
        if gone and self.on_lost is not None:
            self.on_lost(gone)


# ---------------------------------------------------------------------- page I/O (cache internals)
def export_pages(cache: TieredKVCache, key: ContentKey, *, copy: bool = True) -> tuple[dict, np.ndarray]:
    """``({"num_tokens", "xxh3"}, pages as uint8 [n_pages * page_bytes])``, page-major, with the
    xxh3 of each page (``import_pages`` checks them: a transfer is a verified read like a disk
    or host one). One copy when the group is on the device; from the host tier its verified
    pages (their digests are the entry's own); from disk one verified read. ``copy=False``
    returns a CPU device group whose pages are one run as a *view* of the arena (no copy): the
    caller holds a lease on the group until it is done reading. Scattered pages, or pages on a
    GPU, are copied run by run straight into one host buffer."""
    spec = cache.keyer.check_key(key)
    if spec.kind == "embedding":             # encoder outputs: padded to pages
        with cache.lock:
            group = cache.index.groups.get(key)
            on_device = group is not None and group.tier == Tier.DEVICE
        if not on_device:
            x = cache.get_embedding(key)
            n = x.shape[0]
            pages = torch.zeros(spec.pages_for(n) * spec.page_size, spec.width, dtype=x.dtype)
            pages[:n] = x
            return with_sums({"num_tokens": n}, pages.view(torch.uint8).reshape(-1).numpy(), spec.page_bytes)
    with cache.lock:
        group = cache.index.groups.get(key)
        if group is None:
            raise UnknownKeyError(f"{key!r} is not held here")
        if group.tier == Tier.DEVICE:
            view = cache.pools[key.modality].view
            runs = page_runs(group.pages)
            if len(runs) == 1 and not copy and view.device.type == "cpu":
                data = view[runs[0].page:runs[0].page + runs[0].count]   # a view, no copy
            else:                                  # one copy per run, straight to host memory
                data = torch.empty((len(group.pages), *view.shape[1:]), dtype=view.dtype)
                for page, at, n in runs:
                    data[at:at + n].copy_(view[page:page + n])
            return with_sums({"num_tokens": group.num_tokens}, data.view(torch.uint8).reshape(-1).numpy(),
                              spec.page_bytes)
        sums = list(group.location.sums) if group.tier == Tier.HOST and group.location.sums else None
        pages = cache.residency.read_pages(group)      # verified (a disk read lets go of the lock)
        num_tokens = group.num_tokens
        group.hits += 1
        cache.policy.on_access(group)
        cache.counters.add("exports", key.modality)
    rest = num_tokens % spec.page_size
    if rest:                 # the last page's unused slots may hold an earlier owner's bytes: zeros
        pages[-1, :, :, rest:] = 0
        if sums is not None:
            sums[-1] = int(page_sums([pages[-1:].reshape(1, -1).view(torch.uint8).numpy()])[0])
    return with_sums({"num_tokens": num_tokens}, pages.view(torch.uint8).reshape(-1).numpy(), spec.page_bytes, sums)


def import_pages(cache: TieredKVCache, key: ContentKey, meta: dict, buf: np.ndarray) -> bool:
    """Store a group from an ``export`` buffer (a read-only object-store buffer, read in
    place): one copy, run by run, into freshly allocated pages. The pages are taken under the
    cache's lock and filled outside it (they belong to no group yet, so nothing else reads or
    reuses them), so attention in other threads goes on during the copy; the group is indexed
    under the lock again, or the pages given back when the copy failed or another thread
    imported the same key meanwhile."""
    spec = cache.keyer.check_key(key)
    n = int(meta["num_tokens"])
    n_pages = spec.pages_for(n)
    if buf.dtype != np.uint8 or buf.size != n_pages * spec.page_bytes or n <= 0:
        raise ShapeError(f"{key.modality}: buffer of {buf.size} bytes for {n} tokens "
                         f"({n_pages} pages of {spec.page_bytes} bytes)")
    sums = expected_sums(meta, n_pages, key.modality)
    with warnings.catch_warnings():        # a read-only object-store buffer: only read from
        warnings.simplefilter("ignore", UserWarning)
        src = torch.from_numpy(buf)        # bytes, copied as bytes (a plain memcpy per run)
    pb = spec.page_bytes
    pool = cache.pools[key.modality]
    with cache.lock:
        if key in cache.index.groups:
            return False
        pages = cache.residency.allocate(pool, n_pages, [])
    stored = False
    on_host = pool.view.device.type == "cpu"
    try:
        for page, at, count in page_runs(pages):   # from the buffer into the pages: the one copy
            dst = pool.view[page:page + count].view(-1).view(torch.uint8)
            part = buf[at * pb:(at + count) * pb]
            if on_host:     # libc's memcpy (non-temporal stores past the cache): ~1.3x torch's copy
                np.copyto(dst.numpy(), part)
                landed = dst.numpy()                 # what the pages hold now is what is checked
            else:
                dst.copy_(src[at * pb:(at + count) * pb])
                landed = part                        # checked in host memory, not on the device
            try:
                check_pages(landed.reshape(count, pb), sums[at:at + count], repr(key))
            except CorruptDataError:
                cache.counters.add("corrupt_reads", key.modality)
                cache.counters.add("transfer_corrupt_reads", key.modality)
                raise
        with cache.lock:
            if key not in cache.index.groups:
                cache.index.insert(key, spec, n, pages)
                stored = True
    finally:
        if not stored:
            with cache.lock:
                pool.free(pages)
    return stored


class Run(NamedTuple):
    """Consecutive page ids: the first, its index in the group's page list, how many."""

    page: int
    at: int
    count: int


def page_runs(pages: Sequence[int]) -> list[Run]:
    """A group's page list as runs of consecutive page ids (one copy each)."""
    runs: list[Run] = []
    for i, p in enumerate(pages):
        if runs and runs[-1].page + runs[-1].count == p:
            runs[-1] = runs[-1]._replace(count=runs[-1].count + 1)
        else:
            runs.append(Run(p, i, 1))
    return runs
