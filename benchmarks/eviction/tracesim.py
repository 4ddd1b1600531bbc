"""Trace simulator: replays a dialogue trace through real page pools, groups and policies.

``plan(trace, text_page)`` turns the trace into turns of group uses. Keys follow mmtier's rules:
a conversation's context is a prefix-dependent chain (system prompt, then each earlier turn's
media and text, each key chaining its parent); content-only media (``sharing == 'content'``) are
keyed by tenant and content alone, so other conversations of the tenant reuse them; the tenant
is part of every key, so nothing is shared across tenants. Text is sealed into groups of whole
pages at the end of each turn (as vLLM caches only full blocks); the tail carries into the
conversation's next turn and is prefilled again.

``replay(plan, store, ...)`` runs the turns with up to ``concurrency`` in flight: a turn attaches
(pins) its context groups and new media, prefills its private text run, then decodes one text
page per step while the media it holds stay pinned; at the end the run is sealed and every
reference is released. A conversation's next turn waits for its previous one.

Stores: ``GroupTiers`` (whole groups; any ``EvictionPolicy``) and ``PageTiers`` (page-granular
LRU, the baseline: single pages are evicted, so a group missing any page is recomputed whole).
Both keep device pages in real ``PagePool``s over one small arena (the payloads are never
written: this measures bookkeeping, not copies) and model host and disk as byte budgets, with
the cascade device -> host -> disk -> drop. Byte figures use the real model's page bytes.
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from mmtier.config import CacheConfig, ModalitySpec
from mmtier.core.groups import ModalityGroup, Tier
from mmtier.eviction import EvictionPolicy
from mmtier.pages.pool import PagePool

from .belady import BeladyPolicy
from .workloads import Trace

INF = float("inf")


# ---------------------------------------------------------------------------------- the plan
@dataclass
class Turn:
    req: int
    conv: int
    lookups: list[tuple[int, str, int]]         # (key, modality, tokens): context + new media
    prefill: int                                # private text tokens computed at admission
    reply: int                                  # tokens decoded afterwards
    seal_key: int | None                        # key of the sealed text group (None: < 1 page)
    seal_tokens: int


@dataclass
class Plan:
    turns: list[Turn]
    groups: dict[int, tuple[str, int]]           # key -> (modality, tokens), every group
    uses: dict[int, list[int]]                   # key -> reqs that look it up (sorted)
    conv_groups: dict[int, set[int]]             # conversation -> keys in its context
    content: set[int] = field(default_factory=set)   # content-only keys (no parent)

    def next_use(self, key: int, now: int) -> float:
        reqs = self.uses.get(key)
        if not reqs:
            return INF
        i = bisect.bisect_right(reqs, now)
        return float(reqs[i]) if i < len(reqs) else INF


def plan(trace: Trace, text_page: int = 16) -> Plan:
    t = trace.table.to_pydict()
    intern: dict[tuple, int] = {}

    def key(*fields) -> int:
        return intern.setdefault(fields, len(intern) + 1)

    state: dict[int, dict] = {}
    turns: list[Turn] = []
    groups: dict[int, tuple[str, int]] = {}
    uses: dict[int, list[int]] = defaultdict(list)
    conv_groups: dict[int, set[int]] = defaultdict(set)
    content: set[int] = set()
    n = len(t["req"])
    i = 0
    while i < n:
        req, conv, tenant = t["req"][i], t["conv"][i], t["tenant"][i]
        st = state.setdefault(conv, {"chain": key("root", tenant), "history": [], "carry": 0})
        new: list[int] = []
        text = 0
        text_id = 0
        while i < n and t["req"][i] == req:
            role, mod, media, tokens = t["role"][i], t["modality"][i], t["media"][i], t["tokens"][i]
            if role == "system":                      # whole pages shared; the tail carries
                sealed = tokens // text_page * text_page
                st["carry"] += tokens - sealed
                if sealed:
                    k = key("prefix", st["chain"], "text", media)
                    groups[k] = (mod, sealed)
                    st["chain"] = k
                    new.append(k)
            elif role == "media":
                if t["sharing"][i] == "content":
                    k = key("content", tenant, mod, media)
                    content.add(k)
                    st["chain"] = key("after", st["chain"], k)
                else:
                    k = key("prefix", st["chain"], mod, media)
                    st["chain"] = k
                groups[k] = (mod, tokens)
                new.append(k)
            else:
                text += tokens
                if role == "user":
                    text_id = media
                    prefill = st["carry"] + tokens
            i += 1
        lookups = list(dict.fromkeys(st["history"] + new))
        total = st["carry"] + text
        sealed = total // text_page * text_page
        seal_key = key("prefix", st["chain"], "text", text_id) if sealed else None
        st["carry"] = total - sealed
        st["history"] = lookups
        if seal_key is not None:
            groups[seal_key] = ("text", sealed)
            st["chain"] = seal_key
            st["history"] = lookups + [seal_key]
        for k in lookups:
            uses[k].append(req)
            conv_groups[conv].add(k)
        turns.append(Turn(req, conv, [(k, *groups[k]) for k in lookups], prefill,
                          total - prefill, seal_key, sealed))
    return Plan(turns, groups, dict(uses), dict(conv_groups), content)


# ---------------------------------------------------------------------------------- stats
@dataclass
class Stats:
    uses: Counter = field(default_factory=Counter)          # by modality: lookups
    hits: Counter = field(default_factory=Counter)          # served without recompute
    device_hits: Counter = field(default_factory=Counter)
    use_bytes: Counter = field(default_factory=Counter)
    hit_bytes: Counter = field(default_factory=Counter)
    use_cost: Counter = field(default_factory=Counter)
    hit_cost: Counter = field(default_factory=Counter)
    device_hit_cost: Counter = field(default_factory=Counter)
    moved: Counter = field(default_factory=Counter)         # 'DEVICE->HOST' etc.: bytes
    dropped_bytes: int = 0
    overflow: int = 0                                       # groups no tier could take

    def record(self, mod: str, nbytes: int, cost: float, found: Tier | None) -> None:
        self.uses[mod] += 1
        self.use_bytes[mod] += nbytes
        self.use_cost[mod] += cost
        if found is not None:
            self.hits[mod] += 1
            self.hit_bytes[mod] += nbytes
            self.hit_cost[mod] += cost
            if found == Tier.DEVICE:
                self.device_hit_cost[mod] += cost

    def ratio(self, what: str = "cost", mod: str | None = None) -> float:
        num = {"cost": self.hit_cost, "bytes": self.hit_bytes, "count": self.hits,
               "device_cost": self.device_hit_cost}[what]
        den = {"cost": self.use_cost, "bytes": self.use_bytes, "count": self.uses,
               "device_cost": self.use_cost}[what]
        if mod is not None:
            return num[mod] / den[mod] if den[mod] else 0.0
        total = sum(den.values())
        return sum(num.values()) / total if total else 0.0

    @property
    def bytes_moved(self) -> int:
        return sum(self.moved.values())


# ---------------------------------------------------------------------------------- pools
def tiny_pools(specs: dict[str, ModalitySpec], pages: dict[str, int]) -> dict[str, PagePool]:
    """Real ``PagePool``s with the real page sizes in tokens over one small arena (1 layer, 1 head,
    head dim 1, float32: 8 bytes per token), so page counts are real and memory is tiny."""
    tiny = {m: ModalitySpec(name=m, page_size=s.page_size, num_layers=1, num_kv_heads=1,
                            head_dim=1, dtype="float32") for m, s in specs.items()}
    arena = torch.empty(sum(pages[m] * tiny[m].page_bytes for m in specs), dtype=torch.uint8)
    out, off = {}, 0
    for m in specs:
        n = pages[m] * tiny[m].page_bytes
        out[m] = PagePool(tiny[m], arena[off:off + n])
        off += n
    return out


class _Tiers:
    """What both stores share: pools, byte budgets, stats."""

    def __init__(self, cfg: CacheConfig, device_pages: dict[str, int], host_bytes: int,
                 disk_bytes: int):
        self.cfg = cfg
        self.specs = cfg.modalities
        self.pools = tiny_pools(self.specs, device_pages)
        self.cap = {Tier.HOST: host_bytes, Tier.DISK: disk_bytes}
        self.used = {Tier.HOST: 0, Tier.DISK: 0}
        self.stats = Stats()
        self.now = 0


# ---------------------------------------------------------------------------------- groups
class GroupTiers(_Tiers):
    """Whole-group residency under an ``EvictionPolicy``: a group is on one tier, all of it."""

    def __init__(self, cfg: CacheConfig, policy: EvictionPolicy, device_pages: dict[str, int],
                 host_bytes: int, disk_bytes: int, plan: Plan | None = None):
        super().__init__(cfg, device_pages, host_bytes, disk_bytes)
        self.policy = policy
        self.groups: dict[int, ModalityGroup] = {}          # key -> stored group
        self.keys: dict[int, int] = {}                      # gid -> key
        self._gid = 0
        self.private: dict[int, ModalityGroup] = {}         # unsealed runs on the device
        if isinstance(policy, BeladyPolicy) and plan is not None:
            policy.oracle = lambda g: plan.next_use(self.keys.get(g.gid, -1), self.now)

    def set_now(self, now: int) -> None:
        self.now = now
        if isinstance(self.policy, BeladyPolicy):
            self.policy.now = float(now)

    # -- the driver's interface
    def attach(self, key: int, mod: str, tokens: int) -> tuple[Tier | None, ModalityGroup]:
        g = self.groups.get(key)
        if g is None:
            g = self._new(mod, tokens)
            g.refs = 1
            self.keys[g.gid] = key
            if self._place(g):
                self.groups[key] = g
                self.policy.on_insert(g)
            else:
                del self.keys[g.gid]
            return None, g
        found = g.tier
        g.refs += 1
        self.policy.on_access(g)
        if g.tier != Tier.DEVICE:
            self._promote(g)
        return found, g

    def start_private(self, mod: str, tokens: int) -> ModalityGroup:
        g = self._new(mod, tokens)
        g.refs = 1
        if self._room_device(mod, g.num_pages):
            g.pages = self.pools[mod].allocate(g.num_pages)
            self.private[g.gid] = g
            self.policy.on_insert(g)
        else:
            self.stats.overflow += 1
        return g

    def grow(self, g: ModalityGroup, tokens: int) -> None:
        if g.gid not in self.private:
            g.num_tokens += tokens
            return
        extra = g.spec.pages_for(g.num_tokens + tokens) - g.num_pages
        if extra and not self._room_device(g.modality, extra):
            self.stats.overflow += 1                        # decode continues uncached
            self._forget(g)
        else:
            g.pages += self.pools[g.modality].allocate(extra)
        g.num_tokens += tokens

    def seal(self, g: ModalityGroup, key: int | None, tokens: int) -> None:
        if self.private.pop(g.gid, None) is None:
            return
        if key is None or tokens == 0 or key in self.groups:
            self._forget(g)
            return
        keep = g.spec.pages_for(tokens)
        self.pools[g.modality].free(g.pages[keep:])
        g.pages = g.pages[:keep]
        g.num_tokens = tokens
        self.groups[key] = g
        self.keys[g.gid] = key
        self.policy.on_access(g)

    def release(self, g: ModalityGroup) -> None:
        g.refs -= 1
        if g.refs == 0 and self.keys.get(g.gid) in self.groups:
            self.policy.on_release(g)

    # -- mechanism
    def _new(self, mod: str, tokens: int) -> ModalityGroup:
        self._gid += 1
        return ModalityGroup(self._gid, None, self.specs[mod], tokens, last_access=0.0)

    def _place(self, g: ModalityGroup) -> bool:
        if self._room_device(g.modality, g.num_pages):
            g.pages = self.pools[g.modality].allocate(g.num_pages)
            g.tier = Tier.DEVICE
            return True
        for tier in (Tier.HOST, Tier.DISK):
            if self._room_bytes(tier, g.nbytes):
                g.tier = tier
                self.used[tier] += g.nbytes
                self.stats.moved[f"DEVICE->{tier.name}"] += g.nbytes
                return True
        self.stats.overflow += 1
        return False

    def _room_device(self, mod: str, pages: int) -> bool:
        pool = self.pools[mod]
        if pages > pool.num_pages:
            return False
        while pool.num_free < pages:
            need = (pages - pool.num_free) * self.specs[mod].page_bytes
            victims = self.policy.victims(Tier.DEVICE, need, mod)
            if not victims:
                return False
            for v in victims:
                self._demote(v)
        return True

    def _room_bytes(self, tier: Tier, nbytes: int) -> bool:
        if nbytes > self.cap[tier]:
            return False
        while self.cap[tier] - self.used[tier] < nbytes:
            victims = self.policy.victims(tier, nbytes - (self.cap[tier] - self.used[tier]))
            if not victims:
                return False
            for v in victims:
                self._demote(v)
        return True

    def _demote(self, g: ModalityGroup) -> None:
        old = g.tier
        for tier in (Tier.HOST, Tier.DISK):
            if tier > old and self._room_bytes(tier, g.nbytes):
                self._leave(g)
                g.tier = tier
                self.used[tier] += g.nbytes
                self.stats.moved[f"{old.name}->{tier.name}"] += g.nbytes
                self.policy.on_move(g, old)
                return
        self.stats.dropped_bytes += g.nbytes
        self._forget(g)

    def _promote(self, g: ModalityGroup) -> None:
        old = g.tier
        if self._room_device(g.modality, g.num_pages):
            self._leave(g)
            g.pages = self.pools[g.modality].allocate(g.num_pages)
            g.tier = Tier.DEVICE
            self.stats.moved[f"{old.name}->DEVICE"] += g.nbytes
            self.policy.on_move(g, old)

    def _leave(self, g: ModalityGroup) -> None:
        if g.tier == Tier.DEVICE:
            self.pools[g.modality].free(g.pages)
            g.pages = []
        else:
            self.used[g.tier] -= g.nbytes

    def _forget(self, g: ModalityGroup) -> None:
        self._leave(g)
        self.private.pop(g.gid, None)
        key = self.keys.pop(g.gid, None)
        if key is not None and self.groups.get(key) is g:
            del self.groups[key]
        self.policy.on_remove(g)

    def check(self) -> None:
        """Invariants: a group's pages all sit in one tier; budgets and pools add up."""
        on_device = Counter()
        used = Counter()
        live = list(self.groups.values()) + list(self.private.values())
        for g in live:
            if g.tier == Tier.DEVICE:
                assert len(g.pages) == g.num_pages, g
                assert all(self.pools[g.modality].refcount(p) == 1 for p in g.pages), g
                on_device[g.modality] += g.num_pages
            else:
                assert g.pages == [], g
                used[g.tier] += g.nbytes
        for m, pool in self.pools.items():
            assert pool.num_used == on_device[m], (m, pool.num_used, on_device[m])
        for tier in (Tier.HOST, Tier.DISK):
            assert self.used[tier] == used[tier] <= self.cap[tier], (tier, self.used[tier])


# ---------------------------------------------------------------------------------- pages
class _PGroup:
    __slots__ = ("key", "mod", "tokens", "n", "loc", "dev", "refs", "spec")

    def __init__(self, key, spec: ModalitySpec, tokens: int):
        self.key, self.spec, self.mod, self.tokens = key, spec, spec.name, tokens
        self.n = spec.pages_for(tokens)
        self.loc: list[Tier | None] = []
        self.dev: list[int | None] = []
        self.refs = 0

    @property
    def complete(self) -> bool:
        return len(self.loc) == self.n and None not in self.loc


class PageTiers(_Tiers):
    """Page-granular LRU with the same cascade: pages of unreferenced groups sit in LRU queues
    (a group's pages queued tail first, as vLLM frees blocks); a group missing a page is a miss
    and is recomputed whole."""

    def __init__(self, cfg: CacheConfig, device_pages: dict[str, int], host_bytes: int,
                 disk_bytes: int):
        super().__init__(cfg, device_pages, host_bytes, disk_bytes)
        self.groups: dict[int, _PGroup] = {}
        self.queues: dict[tuple[Tier, str | None], OrderedDict] = defaultdict(OrderedDict)

    def set_now(self, now: int) -> None:
        self.now = now

    def attach(self, key: int, mod: str, tokens: int) -> tuple[Tier | None, _PGroup]:
        g = self.groups.get(key)
        if g is not None and not g.complete and g.refs == 0:
            self._free(g)
            g = None
        if g is None or not g.complete:
            g = _PGroup(key, self.specs[mod], tokens)
            g.refs = 1
            self._fill(g, g.n)
            if g.complete:
                self.groups[key] = g
            return None, g
        found = max(g.loc)
        if g.refs == 0:
            self._unqueue(g)
        g.refs += 1
        for i, tier in enumerate(g.loc):
            if tier != Tier.DEVICE and self._room_device(g.mod, 1):
                self.used[tier] -= g.spec.page_bytes
                g.dev[i] = self.pools[g.mod].allocate(1)[0]
                g.loc[i] = Tier.DEVICE
                self.stats.moved[f"{tier.name}->DEVICE"] += g.spec.page_bytes
        return found, g

    def start_private(self, mod: str, tokens: int) -> _PGroup:
        g = _PGroup(None, self.specs[mod], tokens)
        g.refs = 1
        self._fill(g, g.n)
        return g

    def grow(self, g: _PGroup, tokens: int) -> None:
        g.tokens += tokens
        n = g.spec.pages_for(g.tokens)
        self._fill(g, n - g.n)
        g.n = n

    def seal(self, g: _PGroup, key: int | None, tokens: int) -> None:
        keep = g.spec.pages_for(tokens) if key is not None else 0
        for i in range(keep, len(g.loc)):
            self._free_page(g, i)
        del g.loc[keep:], g.dev[keep:]
        g.n, g.tokens, g.key = keep, tokens, key
        if keep and g.complete and key not in self.groups:
            self.groups[key] = g
        else:
            self._free(g)

    def release(self, g: _PGroup) -> None:
        g.refs -= 1
        if g.refs == 0:
            if self.groups.get(g.key) is g and g.complete:
                for i in reversed(range(len(g.loc))):
                    self._queue(g, i)
            else:
                self._free(g)

    # -- mechanism
    def _fill(self, g: _PGroup, n: int) -> None:
        for _ in range(n):
            i = len(g.loc)
            if self._room_device(g.mod, 1):
                g.loc.append(Tier.DEVICE)
                g.dev.append(self.pools[g.mod].allocate(1)[0])
                continue
            g.dev.append(None)
            for tier in (Tier.HOST, Tier.DISK):
                if self._room_bytes(tier, g.spec.page_bytes):
                    g.loc.append(tier)
                    self.used[tier] += g.spec.page_bytes
                    self.stats.moved[f"DEVICE->{tier.name}"] += g.spec.page_bytes
                    break
            else:
                g.loc.append(None)
                self.stats.overflow += 1
            assert len(g.loc) == i + 1

    def _qkey(self, tier: Tier, mod: str) -> tuple[Tier, str | None]:
        return (tier, mod if tier == Tier.DEVICE else None)

    def _queue(self, g: _PGroup, i: int) -> None:
        if g.loc[i] is not None:
            self.queues[self._qkey(g.loc[i], g.mod)][(id(g), i)] = g

    def _unqueue(self, g: _PGroup) -> None:
        for i, tier in enumerate(g.loc):
            if tier is not None:
                self.queues[self._qkey(tier, g.mod)].pop((id(g), i), None)

    def _room_device(self, mod: str, pages: int) -> bool:
        pool = self.pools[mod]
        q = self.queues[(Tier.DEVICE, mod)]
        while pool.num_free < pages:
            if not q:
                return False
            (_, i), g = q.popitem(last=False)
            self._demote_page(g, i)
        return True

    def _room_bytes(self, tier: Tier, nbytes: int) -> bool:
        if nbytes > self.cap[tier]:
            return False
        q = self.queues[(tier, None)]
        while self.cap[tier] - self.used[tier] < nbytes:
            if not q:
                return False
            (_, i), g = q.popitem(last=False)
            self._demote_page(g, i)
        return True

    def _demote_page(self, g: _PGroup, i: int) -> None:
        old = g.loc[i]
        pb = g.spec.page_bytes
        for tier in (Tier.HOST, Tier.DISK):
            if tier > old and self._room_bytes(tier, pb):
                self._free_page(g, i)
                g.loc[i] = tier
                self.used[tier] += pb
                self.stats.moved[f"{old.name}->{tier.name}"] += pb
                self._queue(g, i)
                return
        self._free_page(g, i)
        g.loc[i] = None
        self.stats.dropped_bytes += pb

    def _free_page(self, g: _PGroup, i: int) -> None:
        tier = g.loc[i]
        if tier == Tier.DEVICE:
            self.pools[g.mod].free([g.dev[i]])
            g.dev[i] = None
        elif tier is not None:
            self.used[tier] -= g.spec.page_bytes
        if tier is not None and g.refs == 0:
            self.queues[self._qkey(tier, g.mod)].pop((id(g), i), None)
        g.loc[i] = None

    def _free(self, g: _PGroup) -> None:
        for i in range(len(g.loc)):
            self._free_page(g, i)
        if g.key is not None and self.groups.get(g.key) is g:
            del self.groups[g.key]


# ---------------------------------------------------------------------------------- driver
def replay(p: Plan, store: GroupTiers | PageTiers, concurrency: int = 4) -> Stats:
    """Run every turn of the plan through ``store``; return its stats."""
    text_spec = store.specs["text"]
    stats = store.stats
    active: list[dict] = []
    busy: set[int] = set()
    nxt = 0
    while nxt < len(p.turns) or active:
        while nxt < len(p.turns) and len(active) < concurrency and p.turns[nxt].conv not in busy:
            turn = p.turns[nxt]
            store.set_now(turn.req)
            held = []
            for key, mod, tokens in turn.lookups:
                found, g = store.attach(key, mod, tokens)
                spec = store.specs[mod]
                stats.record(mod, spec.pages_for(tokens) * spec.page_bytes,
                             tokens * spec.recompute_cost, found)
                held.append(g)
            run = store.start_private("text", turn.prefill)
            active.append({"turn": turn, "held": held, "run": run, "left": turn.reply})
            busy.add(turn.conv)
            nxt += 1
        for a in list(active):                   # one decode step: a page of text each
            step = min(a["left"], text_spec.page_size)
            if step:
                store.grow(a["run"], step)
                a["left"] -= step
            if a["left"] == 0:
                turn = a["turn"]
                store.seal(a["run"], turn.seal_key, turn.seal_tokens)
                for g in a["held"]:
                    store.release(g)
                if turn.seal_key is not None:
                    store.release(a["run"])
                active.remove(a)
                busy.discard(turn.conv)
    return stats


def footprint(p: Plan, specs: dict[str, ModalitySpec]) -> dict[str, int]:
    """Bytes of every distinct group, by modality (real page bytes)."""
    out: Counter = Counter()
    for mod, tokens in p.groups.values():
        out[mod] += specs[mod].pages_for(tokens) * specs[mod].page_bytes
    return dict(out)


def waste(p: Plan, specs: dict[str, ModalitySpec], page_size: dict[str, int] | None = None,
          padded: bool = False) -> float:
    """Padding bytes over allocated bytes for every distinct group of the plan. ``page_size``
    overrides the specs' page sizes; ``padded``: one page byte size for every kind (the max
    over kinds of ``page_size * token_bytes``), as a single-size hybrid allocator pads."""
    sizes = page_size or {m: s.page_size for m, s in specs.items()}
    pad_bytes = max(sizes[m] * s.token_bytes for m, s in specs.items())
    alloc = useful = 0
    for mod, tokens in p.groups.values():
        pages = -(-tokens // sizes[mod])
        alloc += pages * (pad_bytes if padded else sizes[mod] * specs[mod].token_bytes)
        useful += tokens * specs[mod].token_bytes
    return 1.0 - useful / alloc if alloc else 0.0


def dedup(p: Plan, specs: dict[str, ModalitySpec]) -> tuple[float, float]:
    """(bytes stored with sharing / bytes if each conversation kept its own copies,
        bytes stored with sharing / bytes if each request kept its own copies)."""
    nb = {k: specs[m].pages_for(t) * specs[m].page_bytes for k, (m, t) in p.groups.items()}
    shared = sum(nb.values())
    per_conv = sum(nb[k] for keys in p.conv_groups.values() for k in keys)
    per_req = sum(nb[k] for turn in p.turns for k, _, _ in turn.lookups)
    per_conv = max(per_conv, 1)
    return shared / per_conv, shared / max(per_req, 1)


def device_pages_for(specs: dict[str, ModalitySpec], device_bytes: int,
                     shares: dict[str, float]) -> dict[str, int]:
    return {m: max(1, int(device_bytes * shares[m] // specs[m].page_bytes)) for m in specs}


__all__ = ["Plan", "Turn", "Stats", "GroupTiers", "PageTiers", "plan", "replay", "footprint",
           "waste", "dedup", "device_pages_for", "tiny_pools", "np"]
