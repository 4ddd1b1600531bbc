"""ContentRegistry logic: content key -> holders, references and put claims (leases).

A plain class, no Ray: the actor in ``actors.py`` wraps it (and adds the liveness sweep and the
rebuild from inventories). Keys travel as their 64-hex SHA-256 digest plus, when a holder first
reports a group, the key's wire form (``ContentKey.to_wire()``), so the registry never needs a
secret and never unpickles anything of its own.

State per key: its holders (actor name -> tier), token count and bytes, references (sequences
attached across the cluster) and at most one put claim (a lease with a TTL: one client stores a
missing group while others wait for it, and a claim whose putter died simply expires).
Per holder: its node and kind, and consecutive missed pings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

Clock = Callable[[], float]


class Location(NamedTuple):
    """Where a group lives: its size and its holders as ``(holder, tier)`` pairs. A named
    tuple: answers of batched lookups cross the wire three times cheaper than a dataclass."""

    modality: str
    num_tokens: int
    nbytes: int
    holders: tuple[tuple[str, str], ...]
    refs: int


@dataclass(frozen=True, slots=True)
class HolderInfo:
    name: str
    node: str
    kind: str               # "pool" or "store"


@dataclass(slots=True)
class _Entry:
    wire: dict[str, str]
    num_tokens: int
    nbytes: int
    holders: dict[str, str] = field(default_factory=dict)   # holder -> tier
    refs: int = 0
    claim: tuple[str, float] | None = None                   # (claimant, expiry)
    loc: Location | None = None                              # cached answer; None when stale


@dataclass(slots=True)
class _Holder:
    info: HolderInfo
    keys: set[str] = field(default_factory=set)
    misses: int = 0


class ContentRegistry:
    """The cluster's index of modality groups. All methods are batched where it matters."""

    def __init__(self, *, clock: Clock = time.monotonic, sweep_misses: int = 2):
        self._clock = clock
        self._sweep_misses = sweep_misses
        self._entries: dict[str, _Entry] = {}
        self._holders: dict[str, _Holder] = {}

    # ------------------------------------------------------------------ holders
    def register_holder(self, info: HolderInfo) -> None:
        h = self._holders.get(info.name)
        if h is None:
            self._holders[info.name] = _Holder(info)
        else:
            h.info = info
            h.misses = 0

    def sync_holder(self, info: HolderInfo, inventory: Sequence[dict]) -> None:
        """Replace everything known about ``info.name`` by its inventory (start, restart, rebuild)."""
        self.drop_holder(info.name)
        self.register_holder(info)
        self.add(info.name, inventory)

    def drop_holder(self, name: str) -> list[str]:
        """Forget a holder (dead or gone); returns the digests that lost their last holder."""
        h = self._holders.pop(name, None)
        if h is None:
            return []
        orphaned = []
        for digest in h.keys:
            e = self._entries.get(digest)
            if e is None:
                continue
            e.holders.pop(name, None)
            e.loc = None
            if not e.holders:
                orphaned.append(digest)
                if e.claim is None:
                    del self._entries[digest]
        return orphaned

    def holders(self) -> list[HolderInfo]:
        return [h.info for h in self._holders.values()]

    def note_alive(self, name: str) -> None:
        h = self._holders.get(name)
        if h is not None:
            h.misses = 0

    def note_miss(self, name: str) -> bool:
        """One missed ping; ``True`` (and the holder dropped) after ``sweep_misses`` in a row."""
        h = self._holders.get(name)
        if h is None:
            return False
        h.misses += 1
        if h.misses >= self._sweep_misses:
            self.drop_holder(name)
            return True
        return False

    # ------------------------------------------------------------------ groups
    def add(self, holder: str, items: Iterable[dict], info: HolderInfo | None = None) -> None:
        """Record groups at ``holder``: items ``{"key": wire, "tier", "num_tokens", "nbytes"}``;
        ``info`` registers a holder not yet known."""
        h = self._holders.get(holder)
        if h is None and info is not None:
            self.register_holder(info)
            h = self._holders[holder]
        if h is None:
            raise KeyError(f"unknown holder {holder!r}; register it first")
        for it in items:
            wire = it["key"]
            digest = wire["digest"]
            e = self._entries.get(digest)
            if e is None:
                e = self._entries[digest] = _Entry(dict(wire), int(it["num_tokens"]), int(it["nbytes"]))
            elif not e.holders:         # a claim's placeholder: the first holder fills it in
                e.wire, e.num_tokens, e.nbytes = dict(wire), int(it["num_tokens"]), int(it["nbytes"])
            e.holders[holder] = str(it["tier"])
            e.loc = None
            e.claim = None
            e.refs = max(e.refs, int(it.get("refs", 0)))
            h.keys.add(digest)

    def remove(self, holder: str, digests: Iterable[str]) -> int:
        """``holder`` no longer holds these groups (evicted, dropped); returns how many it had."""
        h = self._holders.get(holder)
        n = 0
        for digest in digests:
            e = self._entries.get(digest)
            if e is None or e.holders.pop(holder, None) is None:
                continue
            e.loc = None
            n += 1
            if h is not None:
                h.keys.discard(digest)
            if not e.holders and e.claim is None:
                del self._entries[digest]
        return n

    def lookup(self, digests: Sequence[str]) -> list[Location | None]:
        """One answer per digest, in order: its ``Location``, or ``None`` when nobody holds it."""
        out: list[Location | None] = []
        get = self._entries.get
        for digest in digests:
            e = get(digest)
            if e is None or not e.holders:
                out.append(None)
                continue
            loc = e.loc
            if loc is None:
                loc = e.loc = Location(e.wire["modality"], e.num_tokens, e.nbytes,
                                       tuple(e.holders.items()), e.refs)
            out.append(loc)
        return out

    def ref(self, digests: Iterable[str], delta: int) -> None:
        """Add ``delta`` references (attaches of sequences anywhere) to each known digest."""
        for digest in digests:
            e = self._entries.get(digest)
            if e is not None:
                e.refs = max(0, e.refs + delta)
                e.loc = None

    # ------------------------------------------------------------------ put claims (leases)
    def claim(self, digest: str, claimant: str, ttl_s: float, wire: dict[str, str] | None = None) -> str:
        """Before a put: ``"held"`` (someone holds it: do not put), ``"granted"`` (you put it;
        ``add`` ends the claim) or ``"pending"`` (another live claim: wait for it)."""
        now = self._clock()
        e = self._entries.get(digest)
        if e is not None and e.holders:
            return "held"
        if e is not None and e.claim is not None and e.claim[0] != claimant and e.claim[1] > now:
            return "pending"
        if e is None:
            e = self._entries[digest] = _Entry(dict(wire or {"digest": digest, "modality": ""}), 0, 0)
        e.claim = (claimant, now + ttl_s)
        return "granted"

    def unclaim(self, digest: str, claimant: str) -> None:
        """Give a claim up (the put failed); the group stays unknown."""
        e = self._entries.get(digest)
        if e is not None and e.claim is not None and e.claim[0] == claimant:
            e.claim = None
            if not e.holders:
                del self._entries[digest]

    def expire_claims(self) -> int:
        """Drop claims past their TTL (a putter that died); returns how many."""
        now = self._clock()
        dead = [d for d, e in self._entries.items() if e.claim is not None and e.claim[1] <= now]
        for d in dead:
            e = self._entries[d]
            e.claim = None
            if not e.holders:
                del self._entries[d]
        return len(dead)

    # ------------------------------------------------------------------ introspection
    def inventory_of(self, holder: str) -> list[str]:
        h = self._holders.get(holder)
        return sorted(h.keys) if h is not None else []

    def stats(self) -> dict[str, int]:
        held = [e for e in self._entries.values() if e.holders]
        return {"keys": len(held), "holders": len(self._holders),
                "copies": sum(len(e.holders) for e in held),
                "bytes": sum(e.nbytes * len(e.holders) for e in held),
                "refs": sum(e.refs for e in held),
                "claims": sum(1 for e in self._entries.values() if e.claim is not None)}
