"""Replays a ``ChainTrace`` through an eviction policy object the way ``TieredKVCache`` drives it.

``cachereplay.replay`` runs the whole cache (keys, checks, payload writes: about 250 us a block
reference, almost none of it the policy's); this replay makes the same calls on the same policy
class, in the same order, with the cache's device-only bookkeeping and nothing else, so a grid
of policies x traces x capacities runs in minutes:

- a lookup that finds the group counts a hit (``group.hits += 1``, as ``contains`` does);
- a missing group is stored: its pages come from the pool's free count, room is made as
  ``Room.make_room`` does (``policy.victims(DEVICE, bytes, modality)``, whole groups, a child in
  another pool counts no pages, then every chosen group dropped: ``on_remove``; all or nothing:
  when not enough can go, nothing is dropped and the group is not stored, as a ``put`` that
  raises ``CapacityError``, nor is the rest of the chain), and the new group's parent is the
  nearest stored ancestor (``Lineage.parent_of``, at most four hops);
- ``attach`` is ``refs += 1`` and ``on_access``; ``release`` drops one reference per segment and
  calls ``on_release`` at zero; outputs are stored after the release.

Keys are the cache's own (``content_key`` of a ``TieredKVCache`` over the same config), so
hash-dependent policies decide alike (``page_lru`` runs LRU, which reads no key: its one-page
groups get stand-in digests). ``ops`` counts the policy calls (hooks and ``victims``), for the
cost per operation. ``tests/benchmarks/test_eviction_replay.py`` checks that this replay and
``cachereplay.replay`` give the same hits, puts and evictions for every policy.
"""

from __future__ import annotations

import time

from mmtier.cache import TieredKVCache
from mmtier.config import CacheConfig
from mmtier.content import ContentKey
from mmtier.core.groups import ModalityGroup, Tier
from mmtier.eviction import POLICIES, EvictionPolicy, make_policy

from .belady import BeladyPolicy
from .cachereplay import (
    TENANT,
    ReplayResult,
    _NextUse,
    _score,
    _topological,
    bench_config,
    split_pages,
)
from .chains import ChainTrace

MAX_HOPS = 4                          # as mmtier.core.lineage


def trace_keys(trace: ChainTrace, cfg: CacheConfig) -> dict[int, ContentKey]:
    """Every group's key as the cache derives it (chained to its parent's key)."""
    keys: dict[int, ContentKey] = {}
    with TieredKVCache(cfg) as cache:
        for uid in _topological(trace):
            it = trace.items[uid]
            parent = keys[it.parent] if it.parent is not None else None
            keys[uid] = cache.content_key(it.modality, uid.to_bytes(8, "little"), tenant=TENANT,
                                          parent=parent)
    return keys


class _Capacity(Exception):
    pass


class PolicyReplay:
    """The device tier of a ``TieredKVCache`` over one policy: pools as free-page counts."""

    def __init__(self, trace: ChainTrace, cfg: CacheConfig, policy: EvictionPolicy,
                 keys: dict[int, ContentKey], pages: dict[str, int]):
        self.trace, self.cfg, self.policy, self.keys = trace, cfg, policy, keys
        self.free = dict(pages)
        self.groups: dict[int, ModalityGroup] = {}
        self.uid_of: dict[int, int] = {}        # gid -> uid
        self._gid = 0
        self.puts = self.evictions = self.ops = self.uncached = 0
        self.last_error = ""

    def store(self, uid: int) -> ModalityGroup | None:
        """The new group, or ``None`` when no room can be made (nothing changed then)."""
        it = self.trace.items[uid]
        spec = self.cfg.modalities[it.modality]
        need = spec.pages_for(it.tokens)
        while need > self.free[it.modality]:
            try:
                self._make_room(it.modality, need - self.free[it.modality])
            except _Capacity as exc:
                self.uncached += 1
                self.last_error = str(exc)
                return None
        self.free[it.modality] -= need
        self._gid += 1
        g = ModalityGroup(self._gid, self.keys[uid], spec, it.tokens, pages=[], parent=self._parent(uid),
                          last_access=0.0)
        self.groups[uid] = g
        self.uid_of[g.gid] = uid
        self.policy.on_insert(g)
        self.puts += 1
        self.ops += 1
        return g

    def _parent(self, uid: int) -> ModalityGroup | None:
        up = self.trace.items[uid].parent
        for _ in range(MAX_HOPS):
            if up is None:
                return None
            g = self.groups.get(up)
            if g is not None:
                return g
            up = self.trace.items[up].parent
        return None

    def _make_room(self, mod: str, pages_needed: int) -> None:
        spec = self.cfg.modalities[mod]
        chosen, got = [], 0
        self.ops += 1
        for g in self.policy.victims(Tier.DEVICE, pages_needed * spec.page_bytes, mod):
            if got >= pages_needed:
                break
            chosen.append(g)
            got += g.num_pages if g.modality == mod else 0
        if got < pages_needed:
            raise _Capacity(f"{mod} pool: {pages_needed} more pages needed, {got} can go")
        for g in chosen:
            del self.groups[self.uid_of.pop(g.gid)]
            self.free[g.modality] += g.num_pages
            self.evictions += 1
            self.ops += 1
            self.policy.on_remove(g)


def stand_in_keys(trace: ChainTrace) -> dict[int, ContentKey]:
    """Distinct keys that no policy hashes (for LRU over one-page groups)."""
    return {uid: ContentKey(uid.to_bytes(32, "little"), it.modality, "prefix", bytes(16), bytes(32))
            for uid, it in trace.items.items()}


def replay_policy(trace: ChainTrace, policy: str, pages: dict[str, int], costs: dict[str, float],
                  page_size: int, keys: dict[int, ContentKey] | None = None) -> ReplayResult:
    """One replay of ``trace`` (a name in ``mmtier.eviction.POLICIES``, ``belady`` or
    ``page_lru``); the same result ``cachereplay.replay`` gives, without the cache's key checks
    and payload writes. ``res.ops`` counts the policy calls."""
    t0 = time.perf_counter()
    res = ReplayResult(policy)
    cfg = bench_config(trace, pages, page_size, policy if policy in POLICIES else "lru", costs)
    source, groups_of = trace, None
    if policy == "page_lru":
        trace, groups_of = split_pages(trace, page_size)
        keys = stand_in_keys(trace)
    keys = keys if keys is not None else trace_keys(trace, cfg)
    oracle = _NextUse(trace) if policy == "belady" else None
    if oracle is not None:
        oracle.uid_of = {k.digest: uid for uid, k in keys.items()}
        pol: EvictionPolicy = BeladyPolicy(cfg, oracle)
    else:
        pol = make_policy(cfg)
    with TieredKVCache(cfg) as cache:                 # the pools as the cache carves them
        pool_pages = {m: pool.num_pages for m, pool in cache.pools.items()}
    run = PolicyReplay(trace, cfg, pol, keys, pool_pages)
    for i, r in enumerate(trace.requests):
        if oracle is not None:
            oracle.now = i
        present: dict[int, bool] = {}
        held: list[ModalityGroup] = []
        before = run.uncached
        for uid in r.chain:
            g = run.groups.get(uid)
            present[uid] = g is not None
            if g is None:
                g = run.store(uid)
                if g is None:
                    break                       # the rest of the chain hangs off it: uncached
            else:
                g.hits += 1
            g.refs += 1
            held.append(g)
            pol.on_access(g)
            run.ops += 1
        for g in held:
            g.refs -= 1
            if g.refs == 0 and run.groups.get(run.uid_of.get(g.gid, -1)) is g:
                pol.on_release(g)
                run.ops += 1
        for uid in r.outputs:
            if uid not in run.groups:
                run.store(uid)
        res.overflow += run.uncached > before
        _score(source, source.requests[i], present, groups_of, trace, costs, res)
    res.puts, res.evictions, res.ops = run.puts, run.evictions, run.ops
    res.uncached, res.last_error = run.uncached, run.last_error
    res.wall_s = time.perf_counter() - t0
    return res
