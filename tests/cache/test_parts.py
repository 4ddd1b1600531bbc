"""``TieredKVCache``'s parts alone, without the facade: each built from real small parts (a real
``DeviceArena`` of a tiny config, the policy and counters the cache would give it, the lock
residency creates) and
checked on what it owns: keys and lineage, the group index, residency (room, export, promotion,
the life cycle), the sequences' tables and refcounts, shared groups, attention and the engine's
per-layer surface."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mmtier.attention.planner import AttentionPlanner
from mmtier.cache.engine_surface import EngineSurface
from mmtier.cache.group_index import GroupIndex
from mmtier.cache.keys import CacheKeys
from mmtier.cache.sequences import Sequences
from mmtier.cache.shared_groups import SharedGroups
from mmtier.config import CacheConfig, ModalitySpec
from mmtier.content import KeyMaker
from mmtier.core.groups import ModalityGroup, Tier
from mmtier.core.locking import OwnerLock
from mmtier.core.segments import SequenceHandle, SequenceTable
from mmtier.errors import (
    CapacityError,
    ClosedError,
    DTypeError,
    ForeignKeyError,
    PrefixMismatchError,
    ShapeError,
    UnknownKeyError,
    UnknownModalityError,
)
from mmtier.eviction import make_policy
from mmtier.pages.payload import write_fresh_pages
from mmtier.pages.pool import DeviceArena
from mmtier.stats import Counters
from mmtier.tiers.residency import Residency
from tests.support.oracle import oracle_attention, rel_err

L, H, D = 2, 2, 16
TOKEN_BYTES = 2 * L * H * D * 4          # K and V, all layers, float32
VISION_PAGE = 8 * TOKEN_BYTES


def make_cfg(host_pages: int = 0, device_pages: int = 4, **over) -> CacheConfig:
    """``device_pages`` vision pages on the device (as many text pages of 4 tokens, half the
    bytes), ``host_pages`` vision pages' worth of host memory; no disk."""
    base = dict(
        model="tiny-parts", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
        modalities={"text": ModalitySpec(page_size=4, share=0.25),
                    "vision": ModalitySpec(page_size=8, share=0.5),
                    "vision_embed": ModalitySpec(kind="embedding", width=12, page_size=8, share=0.25)},
        device="cpu", attention_backend="torch", device_bytes=2 * device_pages * VISION_PAGE + 64,
        host_bytes=host_pages * VISION_PAGE, key_secret="parts-secret")
    base.update(over)
    return CacheConfig(**base)


def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(L, n, H, D), torch.randn(L, n, H, D)


@dataclass
class Parts:
    """The parts wired as the facade wires them (each given what it uses, nothing shared by a
    base class)."""

    cfg: CacheConfig
    arena: DeviceArena
    lock: OwnerLock
    counters: Counters
    index: GroupIndex
    keyer: CacheKeys
    residency: Residency
    seqs: Sequences
    shared: SharedGroups
    planner: AttentionPlanner
    engine: EngineSurface


def make_parts(**cfg_over) -> Parts:
    cfg = make_cfg(**cfg_over)
    arena, counters, policy = DeviceArena(cfg), Counters(), make_policy(cfg)
    maker = KeyMaker(cfg.model, cfg.key_secret)
    index = GroupIndex(policy, counters)
    residency = Residency(cfg, arena.pools, maker, index, policy, counters)
    lock = residency.lock                      # residency owns the lock; the parts take it there
    keyer = CacheKeys(cfg, maker, index.lineage, lock)
    seqs = Sequences(cfg, keyer, index, residency, policy, counters)   # registers with residency
    shared = SharedGroups(cfg, keyer, index, residency, policy, counters)
    planner = AttentionPlanner(cfg, arena.device, maker, seqs, residency, policy, counters)
    engine = EngineSurface(cfg, keyer, index, seqs, residency, planner, policy)
    return Parts(cfg, arena, lock, counters, index, keyer, residency, seqs, shared, planner, engine)


def stored(p: Parts, key, k, v) -> ModalityGroup:
    """A shared group put the way ``SharedGroups.store`` does, through the residency's room."""
    spec = p.cfg.spec(key.modality)
    with p.lock:
        pool = p.arena.pools[key.modality]
        pages = p.residency.allocate(pool, spec.pages_for(k.shape[1]), [])
        write_fresh_pages(pool, k, v, pages, "torch")
        return p.index.insert(key, spec, k.shape[1], pages)


# ---------------------------------------------------------------------- keys
def test_keys_check_tenants_and_keys_and_note_lineage_only_for_a_good_call():
    cfg = make_cfg()
    lock = OwnerLock()
    keyer = CacheKeys(cfg, KeyMaker(cfg.model, cfg.key_secret), GroupIndex(make_policy(cfg), Counters()).lineage, lock)
    assert keyer.salt(None) == keyer.salt("default") != keyer.salt("acme")
    for bad in ("", 3):
        with pytest.raises(ForeignKeyError):
            keyer.salt(bad)
    image = keyer.content_key("vision", b"cat", tenant="acme")
    assert image.sharing == "content" and len(keyer.lineage) == 0
    with pytest.raises(DTypeError):
        keyer.content_key("vision", "cat", tenant="acme", parent=image)
    assert len(keyer.lineage) == 0                               # refused: nothing noted
    child = keyer.content_key("text", b"after", tenant="acme", parent=image)
    assert child.sharing == "prefix" and len(keyer.lineage) == 1
    parent_group = ModalityGroup(1, image, cfg.spec("vision"), 8)
    assert keyer.lineage.parent_of(child, {image: parent_group}) is parent_group
    assert keyer.check_key(image, "kv") is cfg.spec("vision")
    with pytest.raises(UnknownModalityError):
        keyer.check_key(image, "embedding")
    other = CacheKeys(cfg.model_copy(update={"key_secret": "another"}), KeyMaker(cfg.model, "another"),
                      keyer.lineage, lock)
    with pytest.raises(ForeignKeyError):
        keyer.check_key(other.content_key("vision", b"cat"))


def test_keys_place_a_prefix_key_only_under_its_own_prefix():
    cfg = make_cfg()
    keyer = CacheKeys(cfg, KeyMaker(cfg.model, cfg.key_secret), GroupIndex(make_policy(cfg), Counters()).lineage,
                      OwnerLock())
    seq = SequenceHandle(7, "acme")
    table = SequenceTable(seq)
    here = keyer.prefix_key(seq, table)
    keyer.check_place(seq, table, keyer.content_key("text", b"x", tenant="acme", parent=here), table.chain)
    keyer.check_place(seq, table, keyer.content_key("vision", b"img", tenant="acme"), table.chain)  # anywhere
    elsewhere = keyer.content_key("vision", b"other", tenant="acme")        # not a chain key of seq
    with pytest.raises(PrefixMismatchError):
        keyer.check_place(seq, table, keyer.content_key("text", b"x", tenant="acme", parent=elsewhere),
                          table.chain)
    with pytest.raises(PrefixMismatchError):                 # the same prefix, another tenant's chain
        keyer.check_place(SequenceHandle(8, "globex"), table,
                          keyer.content_key("text", b"x", tenant="acme", parent=here), table.chain)


# ---------------------------------------------------------------------- group index
def test_group_index_inserts_files_lineage_and_unindexes_only_its_own_group():
    cfg = make_cfg()
    counters = Counters()
    index = GroupIndex(make_policy(cfg), counters)
    keyer = CacheKeys(cfg, KeyMaker(cfg.model, cfg.key_secret), index.lineage, OwnerLock())
    parent_key = keyer.content_key("vision", b"cat")
    child_key = keyer.content_key("text", b"caption", parent=parent_key)
    with pytest.raises(UnknownKeyError):
        index.require(parent_key)
    parent = index.insert(parent_key, cfg.spec("vision"), 12, [0, 1])
    child = index.insert(child_key, cfg.spec("text"), 5, [0, 1])
    assert index.require(parent_key) is parent and child.parent is parent and parent.parent is None
    assert child.gid > parent.gid and len(index) == 2 and child_key in index
    snap, by_mod = counters.snapshot()
    assert snap["puts"] == 2 and snap["stored_tokens"] == 17 and by_mod["vision"]["stored_tokens"] == 12

    stale = ModalityGroup(index.new_gid(), parent_key, cfg.spec("vision"), 12)
    index.unindex(stale)                                 # another group under the key: not it
    assert index.get(parent_key) is parent
    index.unindex(parent)
    assert parent_key not in index and index.get(child_key) is child

    run = ModalityGroup(index.new_gid(), None, cfg.spec("text"), 4, pages=[2], refs=1)
    sealed_key = keyer.content_key("text", b"sealed", parent=child_key)
    index.name(sealed_key, run)
    assert index.require(sealed_key) is run and run.key == sealed_key and run.parent is child
    assert counters.snapshot()[0]["puts"] == 3


# ---------------------------------------------------------------------- residency
def test_residency_makes_room_by_dropping_and_a_refused_room_changes_nothing():
    p = make_parts()                                      # no lower tiers: room drops groups
    pool = p.arena.pools["vision"]
    keys = [p.keyer.content_key("vision", f"img{i}".encode()) for i in range(3)]
    a = stored(p, keys[0], *kv(16))
    b = stored(p, keys[1], *kv(16))
    assert pool.num_free == 0
    c = stored(p, keys[2], *kv(16))                       # the oldest unreferenced group goes
    assert a.freed and keys[0] not in p.index and not a.pages
    assert p.index.get(keys[1]) is b and p.index.get(keys[2]) is c
    assert p.counters.snapshot()[0]["evictions"] == 1 and pool.num_free == 0
    b.refs = c.refs = 1                                   # held by sequences: nothing may go
    with p.lock, pytest.raises(CapacityError):
        p.residency.make_room(pool, 2, [])
    assert p.index.get(keys[1]) is b and p.index.get(keys[2]) is c and not (b.freed or c.freed)
    assert pool.num_free == 0 and p.counters.snapshot()[0]["evictions"] == 1


def test_residency_keeps_a_pinned_freed_groups_pages_until_it_settles():
    p = make_parts()
    pool = p.arena.pools["vision"]
    key = p.keyer.content_key("vision", b"img")
    g = stored(p, key, *kv(16))
    with p.lock:
        g.pins += 1                                       # a reader holds it
        p.residency.free_group(g)
        assert key not in p.index and g.freed and pool.num_free == 2
        g.pins -= 1
        p.residency.settle(g)
    assert pool.num_free == 4 and g.pages == []


def test_residency_exports_exact_kv_and_refuses_everything_once_closed():
    p = make_parts()
    key = p.keyer.content_key("vision", b"img")
    k, v = kv(13)
    stored(p, key, k, v)
    with pytest.raises(UnknownKeyError):
        p.residency.lease(p.keyer.content_key("vision", b"never put"))
    out_k, out_v = p.residency.read_group(key, lease=p.residency.lease(key))
    assert torch.equal(out_k, k) and torch.equal(out_v, v)
    assert p.residency.holds([key, p.keyer.content_key("vision", b"no")]) == [True, False]
    assert p.residency.inventory() == [(key, "device", p.index.require(key).nbytes)]
    p.residency.close()
    with pytest.raises(ClosedError):
        p.residency.check_open()
    with pytest.raises(ClosedError):
        p.residency.read_group(key)
    p.residency.close()                                   # twice: nothing more


def test_residency_demotes_to_host_and_promotes_back_exactly():
    p = make_parts(host_pages=4)
    keys = [p.keyer.content_key("vision", f"img{i}".encode()) for i in range(3)]
    data = [kv(16) for _ in keys]
    groups = [stored(p, key, *d) for key, d in zip(keys, data)]
    p.residency.flush()
    assert groups[0].tier == Tier.HOST and [g.tier for g in groups[1:]] == [Tier.DEVICE] * 2
    assert p.counters.snapshot()[0].get("evictions", 0) == 0           # moved down, not dropped
    with p.lock:
        assert p.residency.promote(groups[0])
    p.residency.flush()
    assert groups[0].tier == Tier.DEVICE and Tier.HOST in [g.tier for g in groups[1:]]
    for key, (k, v) in zip(keys, data):
        got_k, got_v = p.residency.read_group(key)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


# ---------------------------------------------------------------------- sequences
class _Kept:
    """Something kept per sequence id (as the compiled operands and step plans are)."""

    def __init__(self):
        self.dropped: list[int] = []

    def drop(self, seq_id: int) -> None:
        self.dropped.append(seq_id)


def test_sequences_append_attach_and_release_keep_exact_refcounts():
    p = make_parts()
    text = p.arena.pools["text"]
    with pytest.raises(ForeignKeyError):
        p.seqs.create("")
    assert len(p.seqs) == 0
    seq = p.seqs.create("acme")
    p.seqs.append(seq, "text", *kv(10))
    assert p.seqs.sequence(seq).length == 10 and text.num_used == 3
    with pytest.raises(ShapeError):
        p.seqs.append(seq, "text", torch.randn(L, 2, H, D), torch.randn(L, 3, H, D))
    assert p.seqs.sequence(seq).length == 10 and text.num_used == 3          # refused: unchanged
    p.seqs.append(seq, "text", *kv(1))                    # fills the tail page's slack
    assert p.seqs.sequence(seq).length == 11 and text.num_used == 3

    key = p.keyer.content_key("vision", b"img", tenant="acme")
    group = stored(p, key, *kv(16))
    p.seqs.attach(seq, key)
    other = p.seqs.create("globex")
    with pytest.raises(ForeignKeyError):
        p.seqs.attach(other, key)
    wrong_place = p.keyer.content_key("text", b"x", tenant="acme", parent=key)
    p.index.insert(wrong_place, p.cfg.spec("text"), 4, p.arena.pools["text"].allocate(1))
    with pytest.raises(PrefixMismatchError):
        p.seqs.attach(seq, wrong_place)
    assert group.refs == 1 and p.index.require(wrong_place).refs == 0
    assert len(p.seqs.sequence(seq).segments) == 2 and p.counters.snapshot()[0]["attaches"] == 1
    assert sorted(g.gid for g in p.seqs.held_groups()) == sorted(s.group.gid for s in p.seqs.sequence(seq).segments)

    kept = _Kept()
    p.seqs.release(seq, (kept,))
    assert kept.dropped == [seq.id] and group.refs == 0 and p.index.get(key) is group
    assert text.num_used == 1                             # the private run's pages went, not wrong_place's
    with pytest.raises(UnknownKeyError):
        p.seqs.sequence(seq)
    with pytest.raises(UnknownKeyError):
        p.seqs.release(seq, (kept,))
    assert kept.dropped == [seq.id]                       # a refused release drops nothing more


# ---------------------------------------------------------------------- shared groups
def test_shared_groups_store_once_count_lookups_and_refuse_bad_input():
    p = make_parts()
    vision = p.arena.pools["vision"]
    key = p.keyer.content_key("vision", b"img")
    assert not p.shared.contains(key)
    k, v = kv(9)
    assert p.shared.put(key, k, v) and not p.shared.put(key, *kv(9))
    assert vision.num_used == 2 and p.shared.contains(key)
    snap = p.counters.snapshot()[0]
    assert (snap["misses"], snap["hits"], snap["puts"]) == (1, 1, 1)
    assert torch.equal(p.residency.read_group(key)[0], k)          # the first put's K/V, kept
    bad = p.keyer.content_key("vision", b"bad")
    with pytest.raises(ShapeError):
        p.shared.put(bad, torch.randn(L, 9, H, D + 1), torch.randn(L, 9, H, D + 1))
    assert bad not in p.index and vision.num_used == 2

    ekey = p.keyer.content_key("vision_embed", b"img")
    x = torch.randn(11, 12)
    assert p.shared.put_embedding(ekey, x)
    got = p.shared.get_embedding(ekey)
    assert torch.equal(got, x) and got.data_ptr() != x.data_ptr()
    with pytest.raises(ShapeError):
        p.shared.put_embedding(p.keyer.content_key("vision_embed", b"bad"), torch.randn(11, 13))
    with pytest.raises(UnknownKeyError):
        p.shared.get_embedding(p.keyer.content_key("vision_embed", b"never"))


# ---------------------------------------------------------------------- attention
def test_attention_planner_matches_the_oracle_and_leaves_nothing_pinned():
    p = make_parts()
    seq = p.seqs.create()
    kt, vt = kv(13)
    p.seqs.append(seq, "text", kt, vt)
    key = p.keyer.content_key("vision", b"img")
    ki, vi = kv(16)
    stored(p, key, ki, vi)
    p.seqs.attach(seq, key)
    q = torch.randn(3, 2 * H, D)
    for layer in range(L):
        out, lse = p.planner.attention_state(seq, layer, q)
        keys, values = torch.cat([kt[layer], ki[layer]]), torch.cat([vt[layer], vi[layer]])
        ref_out, ref_lse = oracle_attention(q, torch.arange(26, 29), keys, values, torch.arange(29))
        assert rel_err(out, ref_out) < 1e-5 and rel_err(lse, ref_lse) < 1e-5
    cross = p.planner.attention(seq, 0, q, groups=[key], causal=False)
    ref, _ = oracle_attention(q, torch.arange(3), ki[0], vi[0], torch.arange(16), causal=False)
    assert rel_err(cross, ref) < 1e-5
    groups = [s.group for s in p.seqs.sequence(seq).segments]
    assert all(g.pins == 0 for g in groups)
    with pytest.raises(ShapeError):
        p.planner.attention(seq, L, q)                    # no such layer: refused
    with pytest.raises(DTypeError):
        p.planner.attention(seq, 0, q.to(torch.int64))
    with pytest.raises(ShapeError):
        p.planner.attention(seq, 0, torch.randn(30, 2 * H, D))         # more queries than tokens
    assert all(g.pins == 0 for g in groups)


# ---------------------------------------------------------------------- engine surface
def test_engine_surface_writes_layers_seals_once_and_batches_like_single_attention():
    p = make_parts()
    a, b = p.seqs.create(), p.seqs.create()
    k, v = kv(6)
    res = p.engine.reserve(a, "text", 6, new_run=True)
    assert res.group.pins == 1
    key = p.keyer.content_key("text", b"system prompt")
    p.engine.write_layer(res, 0, k[0], v[0])
    with pytest.raises(ShapeError):
        p.engine.seal(a, key, res)                        # still being written
    assert key not in p.index and res.group.key is None
    p.engine.write_layer(res, 1, k[1], v[1])
    assert res.group.pins == 0 and p.engine.seal(a, key, res)
    assert p.index.require(key) is res.group and res.group.key == key
    p.seqs.append(b, "text", *kv(6))
    assert not p.engine.seal(b, key)                      # held already: the run stays private
    assert p.seqs.sequence(b).tail.group.key is None
    p.seqs.attach(b, key)
    got_k, _ = p.residency.read_group(key)
    assert torch.equal(got_k, k)

    q = torch.randn(5, 2 * H, D)
    out = p.engine.attention_batch([a, b], 1, q, [0, 2, 5])
    assert rel_err(out[:2], p.planner.attention(a, 1, q[:2])) < 1e-6
    assert rel_err(out[2:], p.planner.attention(b, 1, q[2:])) < 1e-6
    with pytest.raises(ShapeError):
        p.engine.attention_batch([a, b], 1, q, [0, 2, 5], groups=[None])
    assert all(s.group.pins == 0 for t in (a, b) for s in p.seqs.sequence(t).segments)
