"""Prefix-aware eviction on tiny pools: leaf-first, bundles across pools, bimodal insertion, and
the cache recording each prefix-dependent group's parent (exact orders)."""

from __future__ import annotations

import pytest
import torch

from mmtier import TieredKVCache
from mmtier.config import CacheConfig, ModalitySpec
from mmtier.content import KeyMaker
from mmtier.core.groups import ModalityGroup, Tier
from mmtier.eviction import POLICIES, BimodalLRUPolicy, LRUPolicy
from tests.eviction.test_eviction import CFG, PAGE, Groups

D, H = Tier.DEVICE, Tier.HOST


def chain(gs: Groups, spec: str, tier: Tier = D) -> list[ModalityGroup]:
    """``"a>b>c"``: a, then b chained to a, then c chained to b (all text)."""
    out, parent = [], None
    for name in spec.split(">"):
        g = ModalityGroup(len(gs.by_name) + 1, None, CFG.modalities["text"], 4, tier=tier,
                          parent=parent)
        gs.by_name[name] = g
        gs.policy.on_insert(g)
        out.append(g)
        parent = g
    return out


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_leaf_first_every_policy(policy):
    gs = Groups(POLICIES[policy](CFG))
    a, b, c = chain(gs, "a>b>c")
    gs.policy.on_access(a)                       # the root is the most recent: LRU alone says b, c, a
    assert gs.order() == ["c", "b", "a"]
    assert gs.names(gs.policy.victims(D, PAGE)) == ["c"]     # one page needed: the leaf only


def test_parent_freed_within_one_call_joins_at_its_rank():
    gs = Groups(LRUPolicy(CFG))
    a, b = chain(gs, "a>b")
    x = gs.add("x")                              # newer than a and b, no children
    gs.policy.on_access(b)                       # b (the leaf) is now newer than x
    # a is oldest but held by b; b goes when it is reached; a then ranks before x
    assert gs.order() == ["x", "b", "a"]
    assert gs.names(gs.policy.victims(D, 2 * PAGE)) == ["x", "b"]
    del x


def test_pinned_child_keeps_its_whole_chain():
    gs = Groups(LRUPolicy(CFG))
    a, b, c = chain(gs, "a>b>c")
    y = gs.add("y")
    c.refs = 1                                   # a running sequence holds the leaf
    assert gs.order() == ["y"]
    c.refs = 0
    assert gs.order() == ["c", "b", "a", "y"]
    del y


def test_parent_in_a_faster_tier_than_its_child_may_move_down():
    gs = Groups(LRUPolicy(CFG))
    a, b = chain(gs, "a>b")
    b.tier = H
    gs.policy.on_move(b, D)
    assert gs.order(D) == ["a"]                  # the child sits below: a may follow it down
    a.tier = H
    gs.policy.on_move(a, D)
    assert gs.order(H) == ["b", "a"]
    b.tier = D                                   # promoted again: a may not leave the host tier
    gs.policy.on_move(b, H)
    assert gs.order(H) == []
    assert gs.order(D) == ["b"]


def test_removed_child_releases_its_parent():
    gs = Groups(LRUPolicy(CFG))
    a, b = chain(gs, "a>b")
    assert gs.order() == ["b", "a"]
    gs.policy.on_remove(b)
    assert gs.order() == ["a"]


def test_child_in_another_pool_goes_first_as_a_bundle():
    gs = Groups(LRUPolicy(CFG))
    t = gs.add("t", "text")
    v = ModalityGroup(99, None, CFG.modalities["vision"], 8, parent=t)
    gs.by_name["v"] = v
    gs.policy.on_insert(v)
    u = gs.add("u", "text")
    # the text pool needs a page: t is oldest, held only by its image (vision pool): both go,
    # the image first; only t's bytes count for the text pool
    assert gs.names(gs.policy.victims(D, PAGE, "text")) == ["v", "t"]
    v.refs = 1                                   # the image is in use: t stays, u goes
    assert gs.names(gs.policy.victims(D, PAGE, "text")) == ["u"]
    del u


def _keys_by_admission(n: int) -> tuple[list, list]:
    km = KeyMaker("tiny", "secret")
    admitted, rejected = [], []
    i = 0
    while len(admitted) < n or len(rejected) < n:
        k = km.derive(modality="text", layout=(), media=i.to_bytes(4, "little"), tenant_salt=b"t" * 16)
        (admitted if k.digest[0] % BimodalLRUPolicy.admit_every == 0 else rejected).append(k)
        i += 1
    return admitted[:n], rejected[:n]


def test_bimodal_lru_files_unadmitted_new_groups_first_and_reused_ones_by_recency():
    pol = BimodalLRUPolicy(CFG)
    gs = Groups(pol)
    (ka1, ka2), (kr1, kr2) = _keys_by_admission(2)
    spec = CFG.modalities["text"]
    made = {}
    for name, key in (("a1", ka1), ("r1", kr1), ("a2", ka2), ("r2", kr2)):
        g = ModalityGroup(len(made) + 1, key, spec, 4)
        made[name] = g
        gs.by_name[name] = g
        pol.on_insert(g)
    assert gs.order() == ["r1", "r2", "a1", "a2"]
    made["r1"].hits = 1                           # a later request found r1: LRU-ordered now
    pol.on_access(made["r1"])
    assert gs.order() == ["r2", "a1", "a2", "r1"]
    # a new group chained to a new, unadmitted parent inherits the decision, whatever its hash
    child = ModalityGroup(9, ka1, spec, 4, parent=made["r2"])
    gs.by_name["c"] = child
    pol.on_insert(child)
    assert gs.order() == ["c", "r2", "a1", "a2", "r1"]


# ---------------------------------------------------------------------------------- the cache
def tiny_cache(policy: str = "lru", pages: int = 4) -> TieredKVCache:
    cfg = CacheConfig(model="tiny", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32",
                      device="cpu", device_bytes=pages * 4 * 16, eviction_policy=policy,
                      modalities={"text": ModalitySpec(page_size=4)})
    return TieredKVCache(cfg)


def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, n, 1, 2), torch.randn(1, n, 1, 2)


def test_cache_records_parents_and_evicts_the_leaf_before_an_older_parent():
    with tiny_cache(pages=3) as cache:
        root = cache.content_key("text", b"root", tenant="t")
        cache.put(root, *kv(4))
        child = cache.content_key("text", b"child", tenant="t", parent=root)
        cache.put(child, *kv(4))
        other = cache.content_key("text", b"other", tenant="t")
        cache.put(other, *kv(4))
        assert cache.index.groups[child].parent is cache.index.groups[root]
        assert cache.index.groups[other].parent is None
        # full: a fourth group needs a page; root is the oldest but its child is cached
        cache.put(cache.content_key("text", b"new", tenant="t"), *kv(4))
        assert cache.contains(root) and not cache.contains(child) and cache.contains(other)


def test_cache_links_a_parent_named_by_prefix_key():
    with tiny_cache(pages=4) as cache:
        img = cache.content_key("text", b"image", tenant="t")
        cache.put(img, *kv(4))
        seq = cache.create_sequence(tenant="t")
        cache.attach(seq, img)
        cache.append(seq, "text", *kv(2))        # a private run after it
        after = cache.content_key("text", b"next", tenant="t", parent=cache.prefix_key(seq))
        cache.put(after, *kv(4))
        assert cache.index.groups[after].parent is cache.index.groups[img]
        cache.release(seq)
        # re-stored after eviction, the group finds its parent again
        cache.residency.drop(cache.index.groups[after])
        again = cache.content_key("text", b"next", tenant="t", parent=cache.prefix_key(cache.create_sequence(tenant="t")))
        del again
        cache.put(after, *kv(4))
        assert cache.index.groups[after].parent is cache.index.groups[img]


def test_lineage_notes_are_bounded_and_hop_through_chain_keys():
    from mmtier.core.lineage import Lineage

    km = KeyMaker("tiny", "secret")
    k = [km.derive(modality="text", layout=(), media=bytes([i]), tenant_salt=b"t" * 16) for i in range(5)]
    stored = ModalityGroup(1, k[0], CFG.modalities["text"], 4)
    lin = Lineage(max_notes=3)
    lin.note(k[1], k[0])                     # k1 chains the stored k0
    lin.note(k[2], k[1])                     # k2 chains k1 (a chain key, never stored)
    assert lin.parent_of(k[2], {k[0]: stored}) is stored
    assert lin.parent_of(k[3], {k[0]: stored}) is None
    lin.note(k[3], k[0])
    lin.note(k[4], k[0])                     # the least recently used note (k1) is dropped
    assert len(lin) == 3
    assert lin.parent_of(k[2], {k[0]: stored}) is None
    assert lin.parent_of(k[4], {k[0]: stored}) is stored


def test_a_sealed_run_records_its_parent_and_goes_before_it():
    """``seal`` (how the transformers adapter stores spans written layer by layer) links the
    group to the one its key chains, as ``put`` does: a sealed chain is evicted leaf first.
    (It once did not: a sealed child outlived its evicted parent, useless.)"""
    with tiny_cache(pages=3) as cache:
        seq = cache.create_sequence(tenant="t")
        keys, parent = [], cache.prefix_key(seq)
        for name in (b"a", b"b"):
            res = cache.reserve(seq, "text", 4, new_run=True)
            cache.write_layer(res, 0, *[x[0] for x in kv(4)])
            parent = cache.content_key("text", name, tenant="t", parent=parent)
            assert cache.seal(seq, parent, res)
            keys.append(parent)
        cache.release(seq)
        a, b = keys
        assert cache.index.groups[b].parent is cache.index.groups[a] and cache.index.groups[a].parent is None
        cache.put(cache.content_key("text", b"x", tenant="t"), *kv(4))         # the third page
        cache.put(cache.content_key("text", b"y", tenant="t"), *kv(4))         # evicts one: the leaf
        assert cache.contains(a) and not cache.contains(b)
