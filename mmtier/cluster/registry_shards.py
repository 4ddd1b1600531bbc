"""``RegistryShards``: the content index split over ``registry_shards`` registry actors.

Each shard is a ``ContentRegistryActor`` holding the keys ``shard_of`` maps to it; shard 0 goes
by ``registry_name``, shard ``i`` by ``<registry_name>:shard<i>``. Callers name a key by its
address (``ContentKey.address``: ``digest@placement``, the placement being its chain root's,
beside the key and not part of it; a bare digest is read as a root of its own). By default
(``registry_placement="chain"``) a key goes to its placement's shard, so every key of a
prompt's chain is on one shard and a request's lookup is one call (a shared media group, a root
of its own, a second one at most); ``"key"``: by the digest itself. The shards see digests only;
an item a holder reports carries its placement in its key's wire form (``"place"``), so a shard
rebuilt from the holders' inventories takes back the same keys. A wrong placement sends a key
to a shard that does not have it: a miss, never a wrong hit.
Routing is client side: a lookup of many addresses is one call per shard, all sent at once and
awaited together; what concerns a holder as a whole (sync, drop) goes to every shard, a
holder's items to the shards of their keys. Every call returns a ``Pending``: ``get(timeout)``
from a thread, ``await`` on a loop; fire-and-forget callers drop it.

A lookup is lenient: a shard that is dead, restarting or silent answers "nobody holds it" for
its keys (a miss costs a recompute; an exception on the engine's path would cost the turn).
Found locations may be kept for ``registry_cache_s`` seconds: a cached location can be stale,
which costs a miss only, since the holder exports a group only under its full key
(``UnknownKeyError`` otherwise) and the caller then ``forget``s it here.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from ..content import placement as placement_of
from ..content import split_address
from .registry import HolderInfo, Location
from .settings import ClusterSettings

_SHARD_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                 ray.exceptions.GetTimeoutError, ray.exceptions.ObjectLostError, asyncio.TimeoutError)
_RESOLVE_EVERY_S = 1.0          # how often a dead shard's name is looked up again


def shard_of(address: str, shards: int, placement: str = "chain") -> int:
    """The shard of an address (``digest@placement`` or a bare digest): stable across processes
    and runs (not Python's salted ``hash``). ``"chain"``: by its placement (a bare digest's is
    its own, as a root's); ``"key"``: by the digest."""
    if shards == 1:
        return 0
    digest, place = split_address(address)
    if placement == "chain":
        if place is None:
            try:
                place = placement_of(bytes.fromhex(digest)).hex()
            except ValueError:
                place = digest
        digest = place
    try:            # a digest or a placement is SHA-256 hex: its leading 60 bits are already uniform
        return int(digest[:15], 16) % shards
    except ValueError:                  # any other name: hashed (blake2b is 4x slower)
        return int.from_bytes(hashlib.blake2b(digest.encode(), digest_size=8).digest(), "little") % shards


def item_address(item: dict) -> str:
    """The address of a holder's item (its key's wire form, placement included when known)."""
    wire = item["key"]
    place = wire.get("place")
    return wire["digest"] if place is None else f"{wire['digest']}@{place}"


def digest_of(address: str) -> str:
    """The digest of an address: what the shards keep and are asked for."""
    return address.partition("@")[0]


def shard_name(settings: ClusterSettings, index: int) -> str:
    return settings.registry_name if index == 0 else f"{settings.registry_name}:shard{index}"


def split(addresses: Sequence[str], shards: int, placement: str = "chain") -> list[list[int]]:
    """Positions of ``addresses`` per shard."""
    parts: list[list[int]] = [[] for _ in range(shards)]
    if shards == 1:
        parts[0] = list(range(len(addresses)))
        return parts
    for i, a in enumerate(addresses):
        parts[shard_of(a, shards, placement)].append(i)
    return parts


class Pending:
    """Calls in flight to some shards and how to combine their answers. ``lenient``: a shard
    that fails answers ``fallback(i)`` instead of raising."""

    def __init__(self, refs: list, combine: Callable[[list], Any], lenient: bool = False,
                 fallback: Callable[[int], Any] | None = None, on_fail: Callable[[int], None] | None = None,
                 shards: list[int] | None = None, timeout: float | None = None):
        self.refs, self._combine, self._lenient = refs, combine, lenient
        self._timeout = timeout              # awaited: a lenient shard's bound, inside the caller's
        self._fallback, self._on_fail = fallback, on_fail
        self._shards = shards if shards is not None else list(range(len(refs)))
        self.failed = 0                              # shards that did not answer

    def get(self, timeout: float) -> Any:
        end = time.monotonic() + timeout
        answers = []
        for j, ref in enumerate(self.refs):
            try:
                answers.append(ray.get(_up(ref), timeout=max(0.0, end - time.monotonic())))
            except _SHARD_ERRORS:
                if not self._lenient:
                    raise
                answers.append(self._failed(j))
        return self._combine(answers)

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self) -> Any:
        got = await asyncio.gather(*(_awaitable(r, self._timeout) for r in self.refs),
                                   return_exceptions=self._lenient)
        if self._lenient:
            got = [self._failed(j) if isinstance(a, _SHARD_ERRORS) else _raise_if(a)
                   for j, a in enumerate(got)]
        return self._combine(got)

    def _failed(self, j: int) -> Any:
        self.failed += 1
        if self._on_fail is not None:
            self._on_fail(self._shards[j])
        return self._fallback(j) if self._fallback else None


def _up(ref):
    if ref is None:                     # a shard with no actor under its name (``RegistryShards.call``)
        raise ray.exceptions.ActorUnavailableError("a registry shard is not up", None)
    return ref


async def _awaitable(ref, timeout: float | None):
    return await asyncio.wait_for(_up(ref), timeout)


def _raise_if(answer: Any) -> Any:
    if isinstance(answer, BaseException):
        raise answer
    return answer


class RegistryShards:
    """The registry as its callers see it, whatever the number of shards."""

    def __init__(self, settings: ClusterSettings, handles: list | None = None):
        self.settings = settings
        self.n = settings.registry_shards
        self.placement = settings.registry_placement
        self._stale: dict[int, float] = {}              # shard -> when it was found dead
        self._handles = list(handles) if handles is not None else [self._resolve(i) for i in range(self.n)]
        if not any(h is not None for h in self._handles):
            raise ValueError(f"no registry shard {settings.registry_name!r} in namespace {settings.namespace!r}")
        self._cache: dict[str, tuple[Location, float]] = {}
        self._bound = 0.9 * settings.call_timeout_s      # awaited: a silent shard fails inside the caller's wait
        self._lock = threading.Lock()
        self.cache_hits = 0

    # ------------------------------------------------------------------ handles
    def _resolve(self, i: int):
        try:
            h = ray.get_actor(shard_name(self.settings, i), namespace=self.settings.namespace)
        except ValueError:                # killed and not recreated yet: its keys miss meanwhile
            self._stale[i] = time.monotonic()
            return None
        self._stale.pop(i, None)
        return h

    def handle(self, i: int):
        """Shard ``i``'s actor (``None``: not up); one found dead is looked up again by name
        (``start()`` recreates it) at most every second."""
        since = self._stale.get(i)
        if since is not None and time.monotonic() - since >= _RESOLVE_EVERY_S:
            self._handles[i] = self._resolve(i) or self._handles[i]
        return self._handles[i]

    def call(self, i: int, method: str, *args):
        """One call to shard ``i`` (its ref), or ``None`` when it has no actor."""
        h = self.handle(i)
        return None if h is None else getattr(h, method).remote(*args)

    def _shard_failed(self, i: int) -> None:
        self._stale.setdefault(i, time.monotonic())

    def _every(self, method: str, *args) -> list:
        return [self.call(i, method, *args) for i in range(self.n)]

    # ------------------------------------------------------------------ lookups
    def lookup(self, addresses: Sequence[str]) -> Pending:
        """Where each address's group lives (``None``: nowhere, or not on its placement's shard,
        or that shard is down), in order."""
        addresses = list(addresses)
        digests = [digest_of(a) for a in addresses]
        now = time.monotonic()
        out: list[Location | None] = [None] * len(digests)
        ask = list(range(len(digests)))
        if self.settings.registry_cache_s > 0:
            ask = []
            with self._lock:
                for i, d in enumerate(digests):
                    hit = self._cache.get(d)
                    if hit is not None and now - hit[1] <= self.settings.registry_cache_s:
                        out[i] = hit[0]
                        self.cache_hits += 1
                    else:
                        ask.append(i)
        parts = [[ask[j] for j in part] for part in split([addresses[i] for i in ask], self.n, self.placement)]
        shards = [s for s in range(self.n) if parts[s]]
        refs = [self.call(s, "lookup", [digests[i] for i in parts[s]]) for s in shards]

        def combine(answers: list) -> list[Location | None]:
            fresh = []
            for s, locs in zip(shards, answers):
                for i, loc in zip(parts[s], locs):
                    out[i] = loc
                    if loc is not None:
                        fresh.append((digests[i], loc))
            if self.settings.registry_cache_s > 0 and fresh:
                with self._lock:
                    for d, loc in fresh:
                        self._cache[d] = (loc, now)
            return out

        return Pending(refs, combine, lenient=True, shards=shards, on_fail=self._shard_failed,
                       fallback=lambda j: [None] * len(parts[shards[j]]),
                       timeout=self._bound)

    def forget(self, addresses: Sequence[str]) -> None:
        """Drop cached locations a holder contradicted (it did not hold the group)."""
        with self._lock:
            for a in addresses:
                self._cache.pop(digest_of(a), None)

    def _shard(self, address: str) -> int:
        return shard_of(address, self.n, self.placement)

    def _split(self, addresses: Sequence[str]) -> list[list[str]]:
        """The digests of ``addresses`` per shard."""
        return [[digest_of(addresses[j]) for j in part] for part in split(addresses, self.n, self.placement)]

    def wait_held(self, address: str, timeout_s: float) -> Pending:
        ref = self.call(self._shard(address), "wait_held", digest_of(address), timeout_s)
        return Pending([ref], lambda a: a[0])

    # ------------------------------------------------------------------ holders
    def sync_holder(self, info: dict, inventory: list[dict]) -> Pending:
        """A (re)started holder: each shard gets its part (possibly none) and forgets the rest."""
        parts = self._items_by_shard(inventory)
        return Pending([self.call(i, "sync_holder", info, parts[i]) for i in range(self.n)],
                       lambda a: None, lenient=True, on_fail=self._shard_failed,
                       timeout=self._bound)                   # a shard down rebuilds its part later

    def drop_holder(self, name: str) -> Pending:
        self.forget_holder(name)
        # lenient: a shard down now rebuilds from the live holders' inventories, without this one
        return Pending(self._every("drop_holder", name), lambda a: sorted(d for part in a for d in part or []),
                       lenient=True, on_fail=self._shard_failed, timeout=self._bound)

    def forget_holder(self, name: str) -> None:
        with self._lock:
            for d in [d for d, (loc, _t) in self._cache.items() if any(h == name for h, _ in loc.holders)]:
                del self._cache[d]

    def add(self, holder: str, items: list[dict], info: dict | None = None) -> Pending:
        parts = self._items_by_shard(items)
        shards = [i for i in range(self.n) if parts[i]]
        return Pending([self.call(i, "add", holder, parts[i], info) for i in shards], lambda a: None)

    def publish(self, holder: str, items: list[dict], removed: list[str], info: dict) -> Pending:
        """Groups ``holder`` now holds and those it gave up (addresses): one call per shard concerned."""
        parts = self._items_by_shard(items)
        gone = self._split(removed)
        self.forget(removed)
        shards = [i for i in range(self.n) if parts[i] or gone[i]] or [0]
        return Pending([self.call(i, "publish", holder, parts[i], gone[i], info) for i in shards],
                       lambda a: None)

    def remove(self, holder: str, addresses: list[str]) -> Pending:
        self.forget(addresses)
        gone = self._split(addresses)
        shards = [i for i in range(self.n) if gone[i]]
        return Pending([self.call(i, "remove", holder, gone[i]) for i in shards], sum)

    def holders(self) -> Pending:
        """Every holder any shard knows (a holder registers wherever it has items; sync: all)."""
        def union(answers: list) -> list[HolderInfo]:
            seen: dict[str, HolderInfo] = {}
            for part in answers:
                for h in part or []:
                    seen.setdefault(h.name, h)
            return list(seen.values())
        return Pending(self._every("holders"), union, lenient=True, on_fail=self._shard_failed, timeout=self._bound)

    # ------------------------------------------------------------------ references and claims
    def ref(self, addresses: list[str], delta: int) -> Pending:
        parts = self._split(addresses)
        shards = [i for i in range(self.n) if parts[i]]
        return Pending([self.call(i, "ref", parts[i], delta) for i in shards], lambda a: None)

    def claim(self, address: str, claimant: str, wire: dict | None = None) -> Pending:
        ref = self.call(self._shard(address), "claim", digest_of(address), claimant, wire)
        return Pending([ref], lambda a: a[0])

    def unclaim(self, address: str, claimant: str) -> Pending:
        return Pending([self.call(self._shard(address), "unclaim", digest_of(address), claimant)],
                       lambda a: None)

    # ------------------------------------------------------------------ the rest
    def config(self) -> Pending:
        up = next((i for i in range(self.n) if self.handle(i) is not None), 0)   # every shard has it
        return Pending([self.call(up, "config")], lambda a: a[0])

    def stats(self) -> Pending:
        """Summed over the shards that answer; ``holders``: those any of them knows."""
        refs = self._every("stats") + self._every("holders")

        def total(answers: list) -> dict[str, int]:
            out: dict[str, int] = {}
            for part in answers[:self.n]:
                for k, v in (part or {}).items():
                    out[k] = out.get(k, 0) + v
            out["holders"] = len({h.name for part in answers[self.n:] for h in part or []})
            return out
        return Pending(refs, total, lenient=True, on_fail=self._shard_failed,
                       shards=list(range(self.n)) * 2, timeout=self._bound)

    def _items_by_shard(self, items: list[dict]) -> list[list[dict]]:
        parts: list[list[dict]] = [[] for _ in range(self.n)]
        for it in items:
            parts[self._shard(item_address(it))].append(it)
        return parts
