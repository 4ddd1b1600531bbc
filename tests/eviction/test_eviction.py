"""Eviction policies, leases and the tiered bookkeeping, on tiny pools with exact orders."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.eviction.tracesim import GroupTiers, PageTiers
from mmtier import config as config_mod
from mmtier.config import CacheConfig, ModalitySpec
from mmtier.core.groups import ModalityGroup, Tier
from mmtier.errors import LeaseExpiredError
from mmtier.eviction import (
    POLICIES,
    CostAwarePolicy,
    EvictionPolicy,
    LRUPolicy,
    ModalityLRUPolicy,
    make_policy,
)
from mmtier.pages.pool import PagePool
from mmtier.tiers.leases import LeaseTable

D, H, K = Tier.DEVICE, Tier.HOST, Tier.DISK


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_cfg(policy: str = "lru") -> CacheConfig:
    # 1 layer, 1 head, head dim 2, float32: 16 bytes per token, 64 bytes per 4-token page
    return CacheConfig(
        model="tiny", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32",
        device_bytes=1 << 16, eviction_policy=policy,
        modalities={"text": ModalitySpec(page_size=4, recompute_cost=1.0, priority=2.0),
                    "vision": ModalitySpec(page_size=4, recompute_cost=2.0, priority=4.0),
                    "audio": ModalitySpec(page_size=4, recompute_cost=1.0, priority=1.0)})


CFG = make_cfg()
PAGE = CFG.modalities["text"].page_bytes


class Groups:
    """Groups named by letter, inserted in order: ``gs.add("a", "text", 8)``."""

    def __init__(self, policy: EvictionPolicy):
        self.policy = policy
        self.by_name: dict[str, ModalityGroup] = {}

    def add(self, name: str, mod: str = "text", tokens: int = 4, tier: Tier = D) -> ModalityGroup:
        g = ModalityGroup(len(self.by_name) + 1, None, CFG.modalities[mod], tokens, tier=tier)
        self.by_name[name] = g
        self.policy.on_insert(g)
        return g

    def names(self, groups) -> list[str]:
        rev = {id(g): n for n, g in self.by_name.items()}
        return [rev[id(g)] for g in groups]

    def order(self, tier: Tier = D, modality: str | None = None) -> list[str]:
        return self.names(self.policy.order(tier, modality))


# ---------------------------------------------------------------------------------- policies
def test_policy_map_matches_config_names():
    assert tuple(POLICIES) == config_mod.POLICIES
    for name in POLICIES:
        assert type(make_policy(make_cfg(name))).name == name


def test_lru_exact_order_and_bytes_cover():
    gs = Groups(LRUPolicy(CFG))
    for n in "abcd":
        gs.add(n)
    gs.policy.on_access(gs.by_name["a"])
    gs.policy.on_release(gs.by_name["c"])          # released now: its last use is now
    assert gs.order() == ["b", "d", "a", "c"]
    assert gs.names(gs.policy.victims(D, 1)) == ["b"]
    assert gs.names(gs.policy.victims(D, PAGE)) == ["b"]
    assert gs.names(gs.policy.victims(D, PAGE + 1)) == ["b", "d"]
    assert gs.policy.victims(D, 0) == []
    assert gs.order() == ["b", "d", "a", "c"]       # victims() does not consume


def test_victims_filter_by_tier_and_modality():
    gs = Groups(LRUPolicy(CFG))
    gs.add("t1", "text")
    gs.add("v1", "vision")
    gs.add("h1", "text", tier=H)
    gs.add("a1", "audio")
    gs.add("k1", "vision", tier=K)
    assert gs.order(D) == ["t1", "v1", "a1"]
    assert gs.order(D, "vision") == ["v1"]
    assert gs.order(H) == ["h1"]
    assert gs.order(K, "vision") == ["k1"]
    assert gs.order(K, "text") == []


def test_pinned_busy_and_leased_groups_are_never_victims():
    clock = Clock()
    gs = Groups(LRUPolicy(CFG, clock=clock))
    leases = LeaseTable(ttl=5.0, clock=clock)
    a, b, c, d, e = (gs.add(n) for n in "abcde")
    a.refs = 1
    b.pins = 1
    c.busy = 1
    leases.grant(d)
    assert gs.order() == ["e"]
    assert gs.names(gs.policy.victims(D, 10 * PAGE)) == ["e"]
    clock.t += 5.0                                  # d's lease expires: d is a candidate again
    assert gs.order() == ["d", "e"]
    a.refs = 0
    assert gs.order() == ["a", "d", "e"]


def test_tier_change_without_hook_is_refiled():
    gs = Groups(LRUPolicy(CFG))
    a, b = gs.add("a"), gs.add("b")
    assert gs.names(gs.policy.victims(D, 1)) == ["a"]
    a.tier = H                                      # the cache demoted it, no on_move call
    assert gs.order(H) == ["a"]
    assert gs.order(D) == ["b"]
    b.tier = K                                      # never handed out: found while scanning
    assert gs.order(D) == []
    assert gs.order(K) == ["b"]
    gs.policy.on_move(a, H)
    assert gs.order(H) == ["a"]


def test_removed_groups_disappear_and_heaps_compact():
    gs = Groups(LRUPolicy(CFG))
    for i in range(5):
        gs.add(f"g{i}")
    for _ in range(3000):                           # many stale heap items: rebuilt, still exact
        gs.policy.on_access(gs.by_name["g0"])
    gs.policy.on_remove(gs.by_name["g2"])
    assert gs.order() == ["g1", "g3", "g4", "g0"]
    assert gs.policy._items <= 4 * len(gs.policy) + 1024


def test_victims_do_not_scan_other_tiers():
    gs = Groups(LRUPolicy(CFG))
    for i in range(2000):
        gs.add(f"h{i}", tier=H)                     # older than every device group
    gs.add("d0")
    gs.add("d1")
    calls = []
    real = gs.policy._evictable
    gs.policy._evictable = lambda g, now: calls.append(g) or real(g, now)
    assert gs.names(gs.policy.victims(D, 1)) == ["d0"]
    assert len(calls) <= 2


def test_modality_lru_orders_by_age_over_priority():
    gs = Groups(ModalityLRUPolicy(CFG))
    for name, mod in [("a_old", "audio"), ("v_old", "vision"), ("t1", "text"),
                      ("v_new", "vision"), ("a_new", "audio")]:
        gs.add(name, mod)
    # tick 5; age = 5 - touch + 1: a_old 5/1, v_old 4/4, t1 3/2, v_new 2/4, a_new 1/1
    assert gs.order() == ["a_old", "t1", "v_old", "a_new", "v_new"]
    assert gs.order(D, "vision") == ["v_old", "v_new"]      # within a modality: plain LRU
    # the active conversation touches its image: old audio still goes first
    gs.policy.on_access(gs.by_name["v_old"])
    assert gs.order()[:2] == ["a_old", "t1"]
    assert gs.order()[-1] == "v_old"


def test_modality_lru_keeps_images_longer_than_equally_old_audio():
    gs = Groups(ModalityLRUPolicy(CFG))
    gs.add("img", "vision")
    gs.add("clip", "audio")                         # younger, but priority 1 vs 4
    for i in range(6):
        gs.add(f"x{i}", "text")
    assert gs.order().index("clip") < gs.order().index("img")


def test_cost_aware_gdsf_order_and_inflation():
    gs = Groups(CostAwarePolicy(CFG))
    t = gs.add("t", "text", 8)      # cost 8, 128 B:  H = 1 * 8/128 MiB-scaled = 65536
    v = gs.add("v", "vision", 8)    # cost 16, 128 B: H = 131072
    a = gs.add("a", "audio", 8)     # cost 8, 128 B:  H = 65536 (inserted after t)
    gs.policy.on_access(t)
    gs.policy.on_access(t)          # freq 3: H = 196608
    assert gs.order() == ["a", "v", "t"]
    a.tier = H
    gs.policy.on_move(a, D)         # a leaves the device: L[device] = H(a)
    assert gs.policy.inflation[D] == 65536.0
    gs.add("n", "text", 8)          # H = 65536 + 65536 = 131072: ties with v, v was first
    assert gs.order() == ["v", "n", "t"]
    gs.policy.on_remove(v)
    assert gs.policy.inflation[D] == 131072.0
    assert gs.order() == ["n", "t"]
    assert gs.order(H) == ["a"]


def test_a_new_policy_is_one_class():
    class MRU(EvictionPolicy):
        name = "mru"

        def _key(self, entry):
            return -float(self.tick)

    gs = Groups(MRU(CFG))
    for n in "abc":
        gs.add(n)
    assert gs.order() == ["c", "b", "a"]


# ---------------------------------------------------------------------------------- leases
def test_lease_lifecycle_with_injected_clock():
    clock = Clock(10.0)
    table = LeaseTable(ttl=2.0, clock=clock)
    g = ModalityGroup(7, None, CFG.modalities["text"], 4)
    lease = table.grant(g)
    assert lease.gid == 7 and lease.expiry == 12.0 and g.leases == {lease.id: 12.0}
    table.check(lease)
    clock.t = 11.5
    lease2 = table.renew(lease, ttl=3.0)
    assert lease2.id == lease.id and lease2.expiry == 14.5 and g.leases[lease.id] == 14.5
    clock.t = 14.5                                  # expiry is exclusive
    with pytest.raises(LeaseExpiredError):
        table.check(lease2)
    with pytest.raises(LeaseExpiredError):
        table.renew(lease2)                         # dead for good
    assert g.leases == {} and len(table) == 0
    other = table.grant(g)
    table.release(other)
    table.release(other)                            # idempotent
    with pytest.raises(LeaseExpiredError):
        table.check(other)
    third = table.grant(g)
    assert table.revoke(g.gid) == 1
    assert not table.alive(third) and g.leases == {}


def test_read_under_expired_lease_never_returns_reused_memory():
    clock = Clock()
    policy = LRUPolicy(CFG, clock=clock)
    table = LeaseTable(ttl=1.0, clock=clock)
    spec = CFG.modalities["text"]
    pool = PagePool(spec, torch.zeros(2 * spec.page_bytes, dtype=torch.uint8))
    g = ModalityGroup(1, None, spec, 4, pages=pool.allocate(1))
    pool.view[g.pages] = 1.0
    policy.on_insert(g)

    def fast_copy():
        return pool.view[g.pages].clone()

    assert torch.all(table.read(g, fast_copy) == 1.0)

    def slow_copy():
        assert policy.victims(D, 1) == []           # leased while the copy runs
        clock.t += 2.0                              # the copy outlives the lease ...
        assert policy.victims(D, 1) == [g]          # ... so the group is evicted
        pool.free(g.pages)
        reused = pool.allocate(1)                   # and its page reused by someone else
        pool.view[reused] = 2.0
        return pool.view[g.pages].clone()

    with pytest.raises(LeaseExpiredError):
        table.read(g, slow_copy)
    assert table.expired_reads == 1 and g.leases == {}


# ---------------------------------------------------------------------------------- tiers
def tiers(policy: str, device_pages: int, host: int, disk: int) -> GroupTiers:
    cfg = make_cfg(policy)
    return GroupTiers(cfg, make_policy(cfg), {m: device_pages for m in cfg.modalities}, host, disk)


def test_group_tiers_cascade_whole_groups_lru():
    s = tiers("lru", 4, 2 * PAGE, 2 * PAGE)
    a = s.attach(1, "text", 8)[1]                   # 2 pages each
    s.release(a)
    b = s.attach(2, "text", 8)[1]
    s.release(b)
    c = s.attach(3, "text", 8)[1]                   # device full: a -> host
    s.release(c)
    assert (a.tier, b.tier, c.tier) == (H, D, D)
    s.release(s.attach(4, "text", 8)[1])            # b -> host, a -> disk
    assert (a.tier, b.tier) == (K, H)
    s.release(s.attach(5, "text", 8)[1])            # c -> host, b -> disk, a dropped
    assert 1 not in s.groups and (b.tier, c.tier) == (K, H)
    found, g = s.attach(2, "text", 8)               # disk hit: promoted whole
    assert found == K and g is b and b.tier == D and len(b.pages) == 2
    assert s.stats.moved["DISK->DEVICE"] == 2 * PAGE
    s.check()


def test_page_lru_partial_eviction_forces_whole_recompute():
    cfg = make_cfg()
    p = PageTiers(cfg, {m: 3 for m in cfg.modalities}, 0, 0)
    s = GroupTiers(cfg, make_policy(cfg), {m: 3 for m in cfg.modalities}, 0, 0)
    for store in (p, s):
        store.release(store.attach(1, "vision", 8)[1])     # 2 pages
        store.release(store.attach(2, "vision", 4)[1])     # 1 page: pool full
        store.release(store.attach(3, "vision", 4)[1])     # evicts one page / the whole of 1
    assert p.attach(2, "vision", 4)[0] == D
    assert p.attach(1, "vision", 8)[0] is None             # one page of 1 was lost: recompute
    assert s.attach(2, "vision", 4)[0] == D
    assert s.attach(1, "vision", 8)[0] is None
    assert s.stats.dropped_bytes == 3 * PAGE               # whole groups (1, then 3), no part


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(sorted(POLICIES)),
       ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 11), st.integers(1, 12)),
                    min_size=1, max_size=60))
def test_no_tier_ever_holds_part_of_a_group_and_pins_hold(policy, ops):
    clock = Clock()
    cfg = make_cfg(policy)
    s = GroupTiers(cfg, make_policy(cfg, clock=clock), {m: 6 for m in cfg.modalities},
                   5 * PAGE, 7 * PAGE)
    leases = LeaseTable(ttl=3.0, clock=clock)
    mods = ["text", "vision", "audio"]
    held: list[ModalityGroup] = []
    runs: list[ModalityGroup] = []
    live = []
    def stored(g: ModalityGroup) -> bool:
        return g.gid in s.private or s.groups.get(s.keys.get(g.gid, -1)) is g

    for op, x, n in ops:
        protected = [g for g in held + runs if g.refs > 0]
        protected += [g for g, lease in live if leases.alive(lease)]
        before = {id(g): (g, g.tier) for g in protected if stored(g)}
        touched = None
        if op == 0 or op == 1:                      # attach a keyed group
            held.append(s.attach(x, mods[x % 3], 4 * (x % 3) + 4)[1])
        elif op == 2 and held:                      # release one reference
            s.release(held.pop(x % len(held)))
        elif op == 3:                               # a private run grows (or starts)
            if runs and x % 2:
                touched = runs[x % len(runs)]
                s.grow(touched, n)
            else:
                runs.append(s.start_private(mods[x % 3], n))
        elif op == 4 and runs:                      # seal a run under a fresh key
            touched = runs.pop(x % len(runs))
            s.seal(touched, 100 + len(s.keys) * 13 + x, max(1, touched.num_tokens - n % 4))
            s.release(touched)
        elif op == 5:                               # lease a stored group; time passes
            candidates = list(s.groups.values())
            if candidates:
                g = candidates[x % len(candidates)]
                live.append((g, leases.grant(g, ttl=float(n % 4 + 1))))
            clock.t += 1.0
        s.check()
        for g, tier in before.values():             # pinned or leased: never demoted, dropped
            if g is not touched:
                assert stored(g), g
                assert g.tier <= tier, g
