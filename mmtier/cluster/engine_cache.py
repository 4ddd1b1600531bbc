"""``HostedCache``: an engine's embedded pool as its model sees it.

``TieredKVCache``'s surface over the ``PoolHost``'s own cache: ``create_sequence``, ``append``,
``attach``, ``attention``, ``attention_state``, ``put``, ``get_embedding``, ``release``... run
in this process, on this device, with no Ray call. What is shared with the cluster moves at turn
boundaries only:

- ``begin_turn(keys)`` (at admission, with the content-only keys of every media item of the
  turn): the keys not held here go to the registry in **one** batched lookup, sent at once and
  read when the turn first lacks a key; each one held elsewhere is planned
  (``client_placement.transfer_plan``) and, planned ``"fetch"``, pulled whole with **one** call to its
  holder, left running in the background while the turn encodes and prefills what it has;
- ``contains(key)`` answers from this pool; a key being fetched lands first (its pages are
  imported into the pool: a hit), so the model sees a fetched group exactly as a local one;
- ``end_turn()`` lands what is still in flight and publishes, in **one** fire-and-forget call,
  the groups this pool now holds (puts and fetches of the turn) and those it gave up (evicted);
- ``release`` is local (the embedded cache drops the references; the registry learns of any
  group that leaves with the next publish).

A group planned ``"remote"`` (larger than this pool's arena for its modality, or very large and
cheaper to attend where it lives than to move for the calls left in the turn) is not fetched:
``contains`` answers ``True``, ``attach`` references it at its holder, and attention over a
sequence holding it runs there (``RemoteParts``: one call per holder per layer and step, merged
exactly with the local part); ``turn_stats()`` counts ``plan_remote``, ``remote_attaches`` and
the ``attend`` calls. Only a pool holds a group for remote attention (a node store's copy of
such a group is a miss here), and only K/V groups (an embedding that does not fit is a miss).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from ..cache import TieredKVCache
from ..content import ContentKey
from ..core.segments import SequenceHandle
from ..errors import HolderLostError, MMTierError
from . import client_placement as placement
from .actors import STORE_PREFIX, store_name
from .engine_remote import RemoteParts
from .pool import PoolService

LINK_BYTES_PER_S = 1e9        # the cost model's node-to-node rate (object store transfer)
CALL_S = 1e-3                 # and its cost of one remote partial-attention call


class Offloaded(NamedTuple):
    groups: int
    nbytes: int


class HostedCache:
    """The model's cache in a ``PoolHost``: local operations, turn-boundary cluster traffic."""

    def __init__(self, host):
        self.host = host
        self.cache: TieredKVCache = host.cache
        self.cfg = self.cache.cfg
        self.transport = host.transport
        self.counters: Counter[str] = Counter()
        self._incoming: dict[ContentKey, tuple[str, object]] = {}
        self._publish: list[dict] = []
        self._removed: list[str] = []
        self._asked: tuple[list[ContentKey], object, int] | None = None   # the turn's lookup, in flight
        self.plan: dict[str, str] = {}        # this turn: digest -> "local" | "fetch" | "remote" | "miss"
        self._elsewhere: dict[ContentKey, str] = {}   # this turn's groups planned "remote": holder
        self._fallback_of: dict[ContentKey, ContentKey] = {}   # this turn: fallback -> the key it stands in for
        self.remote = RemoteParts(self.cache, self.transport)

    # ------------------------------------------------------------------ local, no Ray call
    def content_key(self, *args, **kw) -> ContentKey:
        return self.cache.content_key(*args, **kw)

    def prefix_key(self, seq: SequenceHandle) -> ContentKey:
        tail = self.remote.tail_modality(seq)
        if tail is None:
            return self.cache.prefix_key(seq)
        return self.cache.chain_key(seq, tail)

    def create_sequence(self, tenant: str | None = None) -> SequenceHandle:
        return self.host.create(tenant)

    def sequence(self, seq: SequenceHandle):
        """The local table; a ``ClusterSequence`` (its full length) when groups of it are
        attended where they live."""
        return self.remote.sequence(seq) if self.remote.has(seq) else self.cache.sequence(seq)

    def append(self, seq: SequenceHandle, modality: str, k: torch.Tensor, v: torch.Tensor, *,
               tokens=None) -> None:
        self.cache.append(seq, modality, k, v, tokens=tokens, new_run=self.remote.boundary(seq))

    def attach(self, seq: SequenceHandle, key: ContentKey) -> None:
        holder = self._elsewhere.get(key)
        if holder is not None and not self.host.holds([key.to_wire()])[0]:
            self.remote.attach(seq, key, holder)
            self.counters["remote_attaches"] += 1
            return
        self.cache.attach(seq, key)

    def attention(self, seq: SequenceHandle, layer: int, q: torch.Tensor, **kw) -> torch.Tensor:
        if self.remote.has(seq):
            return self.remote.attention_state(seq, layer, q, **kw)[0]
        return self.cache.attention(seq, layer, q, **kw)

    def attention_state(self, seq: SequenceHandle, layer: int, q: torch.Tensor, **kw):
        if self.remote.has(seq):
            return self.remote.attention_state(seq, layer, q, **kw)
        return self.cache.attention_state(seq, layer, q, **kw)

    def get_embedding(self, key: ContentKey) -> torch.Tensor:
        return self.cache.get_embedding(key)

    # the engine surface (per-layer writes, batched attention): what the transformers adapter
    # calls once per layer; local, no Ray call
    def reserve(self, seq: SequenceHandle, modality: str, n: int, **kw):
        return self.cache.reserve(seq, modality, n, **kw)

    def write_layer(self, res, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.write_layer(res, layer, k, v)

    def attention_batch(self, seqs, layer: int, q: torch.Tensor, q_indptr, **kw) -> torch.Tensor:
        return self.cache.attention_batch(seqs, layer, q, q_indptr, **kw)

    def seal(self, seq: SequenceHandle, key: ContentKey, run=None) -> bool:
        """Seal the sequence's last run (or the reserved ``run``) as group ``key``; published
        with the turn's changes."""
        sealed = self.cache.seal(seq, key, run)
        if sealed:
            self._publish.append(self.host.held_item(key))
        return sealed

    def release(self, seq: SequenceHandle) -> None:
        self.host.release([seq])
        self.remote.release(seq)

    def stats(self):
        return self.cache.stats()

    def contains(self, key: ContentKey) -> bool:
        """Held here, fetched for this turn (then it lands now), or attended where it lives."""
        if self.cache.contains(key):
            return True
        self._resolve()
        if key in self._elsewhere:
            return True
        pending = self._incoming.pop(key, None)
        return pending is not None and self._land(key, pending)

    def fetch(self, key: ContentKey, holder: str) -> bool:
        """Pull ``key`` from ``holder`` into this pool now (one call; ``False``: a miss)."""
        if self.cache.contains(key):
            return True
        pending = self._start_fetch(key, holder)
        return pending is not None and self._land(key, pending)

    def put(self, key: ContentKey, k: torch.Tensor, v: torch.Tensor) -> bool:
        item, evicted = self.host.put(key.to_wire(), k, v)
        self._note(item, evicted)
        return item is not None

    def put_embedding(self, key: ContentKey, x: torch.Tensor) -> bool:
        item, evicted = self.host.put_embedding(key.to_wire(), x)
        self._note(item, evicted)
        return item is not None

    # ------------------------------------------------------------------ turn boundaries
    def begin_turn(self, keys: Iterable[ContentKey], calls_left: int = 0,
                   fallbacks: Mapping[ContentKey, Iterable[ContentKey]] | None = None) -> None:
        """At admission: one lookup, sent now, for the keys not held here. Its answer is read
        when the turn first needs a key it does not hold (or at ``end_turn``), so it overlaps
        the turn's first chunks; each group then planned ``"fetch"`` starts its pull.
        ``fallbacks[key]``: groups the turn needs only if ``key`` is found nowhere (a clip's
        Whisper K/V when its transcript is not cached), looked up in the same call and planned
        only then."""
        self._resolve()                                   # a turn that never ended: finish it
        keys = list(dict.fromkeys(keys))
        primary = set(keys)
        self._fallback_of = {}
        for key, alts in (fallbacks or {}).items():
            for alt in alts:
                if alt not in primary and alt not in self._fallback_of:
                    self._fallback_of[alt] = key
        keys += list(self._fallback_of)
        held = self.host.holds([k.to_wire() for k in keys]) if keys else []
        self.plan = {k.hex: "local" for k, h in zip(keys, held) if h}
        missing = [k for k, h in zip(keys, held) if not h and k not in self._incoming]
        self._elsewhere = {}
        if missing:
            self._asked = (missing, self.transport.lookup_async([k.address for k in missing]), calls_left)

    def end_turn(self) -> None:
        """Land the fetches still in flight; publish this turn's changes in one call."""
        self._resolve()
        for key, pending in list(self._incoming.items()):
            self._incoming.pop(key, None)
            self._land(key, pending)
        self._removed += self.host.take_evicted()
        if self._publish or self._removed:
            self.transport.publish_later(self.host.name, self._publish, self._removed, self._identity())
            self._publish, self._removed = [], []

    def _resolve(self) -> None:
        """Read the turn's lookup (once) and start a fetch per group planned ``"fetch"``."""
        if self._asked is None:
            return
        missing, ref, calls_left = self._asked
        self._asked = None
        for k, loc in zip(missing, self.transport.wait(ref, len(missing))):   # fallbacks come last
            needed_for = self._fallback_of.get(k)
            if needed_for is not None and self.plan.get(needed_for.hex, "miss") != "miss":
                continue                                  # its key is here or on its way
            holders = [] if loc is None else [h for h, _tier in loc.holders if h != self.host.name]
            if not holders:
                self.plan[k.hex] = "miss"
                continue
            room = self.cache.device_bytes(k.modality)
            choice = placement.transfer_plan(loc.nbytes, room, calls_left,
                                             link_bytes_per_s=LINK_BYTES_PER_S, call_s=CALL_S)
            pools = [h for h in holders if not h.startswith(STORE_PREFIX)]
            if choice == "remote" and (not pools or self.cfg.spec(k.modality).kind != "kv"):
                choice = "fetch" if loc.nbytes <= room else "miss"
            self.plan[k.hex] = choice
            self.counters[f"plan_{choice}"] += 1
            if choice == "fetch":
                pending = self._start_fetch(k, placement.nearest_by_name(holders, self.host.node))
                if pending is not None:
                    self._incoming[k] = pending
            elif choice == "remote":
                self._elsewhere[k] = placement.nearest_by_name(pools, self.host.node)

    def drop(self, keys: Iterable[ContentKey]) -> list[str]:
        """Let go of unreferenced groups here (the registry learns it with the next publish);
        returns the addresses dropped (digest@placement)."""
        dropped = self.host.drop([k.to_wire() for k in keys])
        self._removed += dropped
        return dropped

    def offload(self, keys: Iterable[ContentKey]) -> Offloaded:
        """Hand unreferenced groups to this node's store and free them here (turn-boundary
        traffic: one call per group, all sent at once and awaited together, then the registry
        told in one call per holder). A group the store refused stays here
        (``offload_failed``)."""
        store = store_name(self.host.node)
        chosen: list[tuple[ContentKey, int]] = []
        for key in dict.fromkeys(keys):
            info = self.cache.group_info(key)
            size = 0 if info is None or not info.evictable else info.nbytes
            if size:
                chosen.append((key, size))
        # the exports' buffers (leased views of the arena) live only for the call below, so the
        # leases are gone before the drops
        sent = [self.transport.offload_async(store, k.to_wire(), *self.host.export(k.to_wire())) for k, _ in chosen]
        moved = nbytes = 0
        taken: list[dict] = []
        for (key, size), ref in zip(chosen, sent):
            try:
                answer, _evicted = self.transport.result(ref, store)
            except MMTierError:
                self.counters["offload_failed"] += 1
                continue
            if answer is not None:
                taken.append(answer)
            dropped = self.host.drop([key.to_wire()])
            self._removed += dropped
            moved += len(dropped)
            nbytes += size if dropped else 0
        if taken:
            self.transport.publish_later(store, taken, [], {"name": store, "node": self.host.node, "kind": "store"})
        if self._removed:
            self.transport.publish_later(self.host.name, [], self._removed, self._identity())
            self._removed = []
        return Offloaded(moved, nbytes)

    def turn_stats(self) -> dict[str, int]:
        """The plan and traffic so far: ``plan_*``, ``fetched``, ``fetch_failed``, and Ray calls."""
        return {**self.counters, **{f"calls_{k}": n for k, n in self.transport.calls.items()}}

    # ------------------------------------------------------------------ helpers
    def _start_fetch(self, key: ContentKey, holder: str) -> tuple[str, object] | None:
        """Ask ``holder`` for the group (``None``: the holder is gone, a miss)."""
        try:
            return holder, self.transport.fetch(holder, key.to_wire())
        except HolderLostError:
            self.counters["fetch_failed"] += 1
            self.counters["fetch_failed_HolderLostError"] += 1
            return None

    def _land(self, key: ContentKey, pending: tuple[str, object]) -> bool:
        holder, refs = pending
        try:
            meta, buf = self.transport.land(refs, holder)
            item, evicted = self.host.import_group(key.to_wire(), meta, buf)
        except MMTierError as exc:       # gone meanwhile, holder lost, no room, bad data: a miss
            self.transport.forget([key.address])     # a cached location it contradicted: dropped
            self.counters["fetch_failed"] += 1
            self.counters[f"fetch_failed_{type(exc).__name__}"] += 1
            return False
        self.counters["fetched"] += 1
        self._note(item, evicted)
        return True

    def _identity(self) -> dict[str, str]:
        """This holder's name, node and kind (what a publish carries; not the actor's ``ping``,
        which also publishes metrics when due: the registry's sweep does that)."""
        return PoolService.ping(self.host)

    def _note(self, item: dict | None, evicted: list[str]) -> None:
        if item is not None:
            self._publish.append(item)
        self._removed += evicted
