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

Every mutating call returns the addresses (``ContentKey.address``: digest and placement, what the
registry routes by) of the groups this cache evicted meanwhile (``take_evicted``), so the
caller can tell the registry at once. With a disk tier (``cfg.disk_dir``) groups the device must
give up move to disk whole and stay held here (tier ``"disk"``; attention and export read them
from there); only groups dropped at the bottom, or whose disk copy failed verification (a miss),
leave. A read that finds a corrupt copy raises ``CorruptDataError`` and reports the group
through ``on_lost`` (the actor tells the registry). A pool recreated over the same directory
adopts its groups. Only ``TieredKVCache``'s public calls are used, never its parts or its lock:
``export_pages`` / ``import_pages`` (``GroupPages`` in wire form), ``attach_placed``, and the
checks of a serving process (``group_info`` / ``group_infos``, ``indexed``,
``drop_unreferenced``, ``page_usage``, ``groups_lost``), each taking the cache's lock itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..cache import GroupInfo, GroupPages, TieredKVCache
from ..config import CacheConfig
from ..content import ContentKey
from ..core.groups import Tier
from ..core.segments import SequenceHandle
from ..errors import CorruptDataError, ShapeError, UnknownKeyError

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


def info_item(g: GroupInfo) -> dict:
    """``group_item`` of a group of this pool's cache."""
    return group_item(g.key, g.num_tokens, g.nbytes, _TIER_NAMES[g.tier], g.refs)


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
        self._known: set[ContentKey] = {g.key for g in self.cache.group_infos()}   # adopted from disk
        self.on_lost: Callable[[list[str]], None] | None = None  # groups gone outside a mutating call

    # ------------------------------------------------------------------ identity and inventory
    def ping(self) -> dict[str, str]:
        return {"name": self.name, "node": self.node, "kind": self.kind}

    def inventory(self) -> list[dict]:
        """Every content-keyed group this cache holds (the registry rebuilds itself from these)."""
        return [info_item(g) for g in self.cache.group_infos()]

    def holds(self, wires: Sequence[dict[str, str]]) -> list[bool]:
        return self.cache.indexed([ContentKey.from_wire(w) for w in wires])

    # ------------------------------------------------------------------ groups
    def put(self, wire: dict[str, str], k: torch.Tensor, v: torch.Tensor) -> tuple[dict | None, list[str]]:
        """Store a group; ``(item or None when already held, evicted addresses)``."""
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
        (``copy=False``: a view of the arena where it can be one; see
        ``TieredKVCache.export_pages``)."""
        try:
            return self.cache.export_pages(ContentKey.from_wire(wire), copy=copy).to_wire()
        except CorruptDataError:
            self._report_lost()
            raise

    def import_group(self, wire: dict[str, str], meta: dict, buf: np.ndarray) -> tuple[dict | None, list[str]]:
        """Store a group shipped by ``export`` (``None`` when it was already here)."""
        key = ContentKey.from_wire(wire)
        with self._lock:
            stored = self.cache.import_pages(key, GroupPages.from_wire(meta, buf))
            return (self.held_item(key) if stored else None), self.take_evicted()

    def drop(self, wires: Sequence[dict[str, str]]) -> list[str]:
        """Drop unreferenced groups (an explicit move elsewhere); returns the dropped addresses."""
        with self._lock:
            dropped = self.cache.drop_unreferenced([ContentKey.from_wire(w) for w in wires])
            self._known.difference_update(dropped)
            return [k.address for k in dropped]

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
                self.cache.attach_placed(seq, key)   # a part of a sequence whose client checked
                                                     # the key's place in it
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
        usage = self.cache.page_usage()
        return {"sequences": usage.sequences, "handles": len(self._handles), "used_pages": usage.used_pages,
                "cached_pages": usage.cached_pages, "leases": usage.leases}

    def close(self) -> None:
        self.cache.close()

    # ------------------------------------------------------------------ what the registry is told
    def held_item(self, key: ContentKey) -> dict:
        """The registry's item for a group held here (``group_item``); from now on its leaving
        is reported by ``take_evicted``."""
        g = self.cache.group_info(key)
        if g is None:
            raise UnknownKeyError(f"{key!r} is not held here")
        self._known.add(key)
        return info_item(g)

    def take_evicted(self) -> list[str]:
        """Addresses of groups this cache dropped (evicted at the bottom, or a corrupt disk copy
        forgotten) since the last call; cheap when none were. Groups moved to disk stay."""
        n = self.cache.groups_lost()
        if n == self._evictions_seen:
            return []
        self._evictions_seen = n
        known = list(self._known)
        gone = [k for k, held in zip(known, self.cache.indexed(known)) if not held]
        self._known.difference_update(gone)
        return [k.address for k in gone]

    def _report_lost(self) -> None:
        """A read found a corrupt copy (the cache forgot the group): tell ``on_lost``."""
        with self._lock:
            gone = self.take_evicted()
        if gone and self.on_lost is not None:
            self.on_lost(gone)
