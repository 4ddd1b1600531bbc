"""Replays a ``ChainTrace`` through ``TieredKVCache`` itself: keys, contains, put, attach, release.

Each request opens a sequence and walks its chain: every group's key is derived by the cache
(``content_key``, chained with ``parent=`` to the key of the group before it), looked up
(``contains``), stored when missing (``put``: this is the recompute) and attached; the sequence
is released when the chain is done, and the request's outputs are stored. Room on the device is
made by the cache's own ``_make_room -> policy.victims`` path; there is no lower tier, so a
victim is dropped. Payloads are tiny (1 layer, 1 KV head, head dim 1, float32: 8 bytes a token)
and real: page counts, keys, pools and policies are the cache's own.

A request's hit is the longest cached prefix of its chain, scored three ways: tokens, blocks (the
trace's blocks: a 512-token block of a Mooncake-form trace, a partial last block counting as one;
a media group counts the blocks it merged, a group of a generated trace one) and the recompute
time it avoids (the hit groups' tokens times the measured seconds per token of their modality).

The pools hold exactly the pages they are given. A group that cannot be stored (everything else
is held by the request's own attached chain) is not stored, and neither is the rest of its chain
(keyed under it); the request goes on uncached from there (``uncached`` counts such groups,
``overflow`` the requests that had one), as a cache of that size serves it.

``page_lru``: the per-page baseline. Every group is split into one-page groups chained page to
page (as a per-block prefix cache holds them), replayed with plain LRU; a text page hits on its
own, a media item only when all its pages are cached (an encoder cannot restart mid-item).

``belady``: the offline reference for the hit metric: the policy evicts the group whose next use
(the next request whose chain holds it) is furthest away, leaf-first like every policy.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from mmtier.cache import TieredKVCache
from mmtier.config import CacheConfig, ModalitySpec
from mmtier.core.groups import ModalityGroup
from mmtier.errors import CapacityError

from .belady import BeladyPolicy
from .chains import ChainTrace, Item, Request

TOKEN_BYTES = 8                     # 1 layer x K,V x 1 head x head dim 1 x float32
TENANT = "bench"
PRIORITY = {"text": 1.0, "vision": 2.0, "video": 2.0, "audio": 1.5}   # as the presets set them


@dataclass
class ReplayResult:
    policy: str
    requests: int = 0
    chain_tokens: int = 0
    hit_tokens: int = 0
    chain_blocks: int = 0
    hit_blocks: int = 0
    recompute_s: float = 0.0             # every chain group recomputed
    avoided_s: float = 0.0               # of which the hits avoided
    hit_blocks_by_request: list[int] = field(default_factory=list)
    hit_tokens_by_mod: Counter = field(default_factory=Counter)
    chain_tokens_by_mod: Counter = field(default_factory=Counter)
    puts: int = 0
    evictions: int = 0
    overflow: int = 0                    # requests with a group that could not be stored
    uncached: int = 0                    # groups that could not be stored (CapacityError)
    ops: int = 0                         # policy calls (``policyreplay`` counts them)
    last_error: str = ""
    wall_s: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.chain_tokens if self.chain_tokens else 0.0

    @property
    def block_hit_ratio(self) -> float:
        return self.hit_blocks / self.chain_blocks if self.chain_blocks else 0.0

    @property
    def avoided_fraction(self) -> float:
        return self.avoided_s / self.recompute_s if self.recompute_s else 0.0


def bench_config(trace: ChainTrace, pages: dict[str, int], page_size: int, policy: str,
                 costs: dict[str, float]) -> CacheConfig:
    """A tiny-payload config whose pools hold ``pages[m]`` pages; ``recompute_cost`` per token is
    the measured seconds relative to text; modality priorities as the multimodal presets'."""
    mods = sorted({i.modality for i in trace.items.values()})
    total = sum(pages[m] for m in mods) + len(mods)       # half a page of slack per pool: the
    specs = {m: ModalitySpec(page_size=page_size, share=(pages[m] + 0.5) / total,   # carve rounds down
                             recompute_cost=costs[m] / costs["text"],
                             priority=PRIORITY.get(m, 1.0)) for m in mods}
    return CacheConfig(model="eviction-bench", num_layers=1, num_kv_heads=1, head_dim=1,
                       dtype="float32", device="cpu", device_bytes=total * page_size * TOKEN_BYTES,
                       host_bytes=0, disk_dir=None, eviction_policy=policy, modalities=specs)


def pool_floor(trace: ChainTrace, page_size: int) -> Counter:
    """Pages each modality's pool must hold for the largest request (its chain stays attached),
    plus its largest group (the room a put needs while the chain is held)."""
    need: Counter = Counter()
    big: Counter = Counter()
    for r in trace.requests:
        per: Counter = Counter()
        for u in [*r.chain, *r.outputs]:
            it = trace.items[u]
            per[it.modality] += -(-it.tokens // page_size)
        for m, n in per.items():
            need[m] = max(need[m], n)
    for it in trace.items.values():
        big[it.modality] = max(big[it.modality], -(-it.tokens // page_size))
    return need + big


class _NextUse:
    """Belady's oracle: the next request (after now) whose chain holds a group."""

    def __init__(self, trace: ChainTrace):
        self.uses: dict[int, list[int]] = {}
        for i, r in enumerate(trace.requests):
            for u in r.chain:
                self.uses.setdefault(u, []).append(i)
        self.uid_of: dict[bytes, int] = {}
        self.now = 0

    def __call__(self, group: ModalityGroup) -> float:
        uid = self.uid_of.get(group.key.digest) if group.key is not None else None
        reqs = self.uses.get(uid) if uid is not None else None
        if not reqs:
            return float("inf")
        i = bisect.bisect_right(reqs, self.now)
        return float(reqs[i]) if i < len(reqs) else float("inf")


def split_pages(trace: ChainTrace, page_size: int) -> tuple[ChainTrace, dict[int, list[int]]]:
    """Every group as a chain of one-page groups; returns the new trace and uid -> page uids."""
    items: dict[int, Item] = {}
    pages_of: dict[int, list[int]] = {}
    nxt = max(trace.items) + 1
    for uid in _topological(trace):
        it = trace.items[uid]
        parent = pages_of[it.parent][-1] if it.parent is not None else None
        ids = []
        left = it.tokens
        while left > 0:
            n = min(page_size, left)
            items[nxt] = Item(nxt, it.modality, n, parent)
            ids.append(nxt)
            parent = nxt
            nxt += 1
            left -= n
        pages_of[uid] = ids
    reqs = [Request(r.time, [p for u in r.chain for p in pages_of[u]],
                    [p for u in r.outputs for p in pages_of[u]]) for r in trace.requests]
    return ChainTrace(trace.name + "/pages", items, reqs), pages_of


def _topological(trace: ChainTrace) -> list[int]:
    out, seen = [], set()
    for uid in trace.items:
        stack = []
        u: int | None = uid
        while u is not None and u not in seen:
            stack.append(u)
            u = trace.items[u].parent
        for v in reversed(stack):
            seen.add(v)
            out.append(v)
    return out


def replay(trace: ChainTrace, policy: str, pages: dict[str, int], costs: dict[str, float],
           page_size: int = 64) -> ReplayResult:
    """One replay of ``trace`` through a fresh cache whose pools hold ``pages`` per modality.
    ``policy``: a name in ``mmtier.eviction.POLICIES``, ``belady`` or ``page_lru``."""
    t0 = time.perf_counter()
    res = ReplayResult(policy)
    run, groups_of = trace, None
    if policy == "page_lru":
        run, groups_of = split_pages(trace, page_size)
    cfg = bench_config(trace, pages, page_size, "lru" if policy in ("page_lru", "belady") else policy,
                       costs)
    oracle = _NextUse(run) if policy == "belady" else None
    biggest = max(it.tokens for it in run.items.values())
    k = torch.randn(1, biggest, 1, 1)
    with TieredKVCache(cfg, BeladyPolicy(cfg, oracle) if oracle is not None else None) as cache:
        keys: dict[int, object] = {}

        def key_of(uid: int):
            key = keys.get(uid)
            return key if key is not None else derive(uid)

        def derive(uid: int):
            it = run.items[uid]
            parent = keys[it.parent] if it.parent is not None else None
            key = cache.content_key(it.modality, uid.to_bytes(8, "little"), tenant=TENANT,
                                    parent=parent)
            keys[uid] = key
            if oracle is not None:
                oracle.uid_of[key.digest] = uid
            return key

        def store(uid: int, key) -> bool:
            """Whether the group is now stored (``False``: no room while the chain is held)."""
            derive(uid)                       # as a client does before a put: notes the parent
            n = run.items[uid].tokens
            try:
                if cache.put(key, k[:, :n], k[:, :n]):
                    res.puts += 1
            except CapacityError as exc:
                res.uncached += 1
                res.last_error = str(exc)
                return False
            return True

        for i, r in enumerate(run.requests):
            if oracle is not None:
                oracle.now = i
            seq = cache.create_sequence(tenant=TENANT)
            present: dict[int, bool] = {}
            before = res.uncached
            try:
                for uid in r.chain:
                    key = key_of(uid)
                    present[uid] = cache.contains(key)
                    if not present[uid] and not store(uid, key):
                        break                 # the rest of the chain hangs off it: uncached
                    cache.attach(seq, key)
            finally:
                cache.release(seq)
            for uid in r.outputs:
                key = key_of(uid)
                if not cache.contains(key):
                    store(uid, key)
            res.overflow += res.uncached > before
            _score(trace, trace.requests[i], present, groups_of, run, costs, res)
        res.evictions = int(cache.stats().counters.get("evictions", 0))
    res.wall_s = time.perf_counter() - t0
    return res


def _score(trace: ChainTrace, r: Request, present: dict[int, bool], groups_of, run: ChainTrace,
           costs: dict[str, float], res: ReplayResult) -> None:
    """Add the request's prefix hit (tokens, seconds avoided) to ``res``."""
    res.requests += 1
    hit = True
    before = res.hit_blocks
    for uid in r.chain:
        it = trace.items[uid]
        res.chain_tokens += it.tokens
        res.chain_blocks += it.blocks
        res.chain_tokens_by_mod[it.modality] += it.tokens
        res.recompute_s += it.tokens * costs[it.modality]
        if not hit:
            continue
        if groups_of is None:
            got = it.tokens if present.get(uid) else 0
        else:
            got = 0
            for p in groups_of[uid]:
                if not present.get(p):
                    break
                got += run.items[p].tokens
            if it.modality != "text" and got < it.tokens:
                got = 0
        res.hit_tokens += got
        res.hit_tokens_by_mod[it.modality] += got
        res.avoided_s += got * costs[it.modality]
        hit = got == it.tokens
        res.hit_blocks += it.blocks if hit else 0
    res.hit_blocks_by_request.append(res.hit_blocks - before)
