"""TieredKVCache's in-process contract, against the float64 oracle and exact bookkeeping."""

from __future__ import annotations

import pytest
import torch

from mmtier import (
    CacheConfig,
    CapacityError,
    DTypeError,
    ForeignKeyError,
    ModalitySpec,
    ShapeError,
    TieredKVCache,
    UnknownKeyError,
    UnknownModalityError,
)
from mmtier.errors import ClosedError
from tests.support.oracle import Logical, oracle_attention, rel_err

L, H, D = 2, 2, 64


def make_cfg(backend, **over) -> CacheConfig:
    """The test cache's config on ``backend`` (its attention backend and device)."""
    base = dict(
        model="tiny-mm", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
        modalities={
            "text": ModalitySpec(page_size=16),
            "vision": ModalitySpec(page_size=64),
            "audio": ModalitySpec(page_size=32),
            "vision_embed": ModalitySpec(kind="embedding", width=48, page_size=64),
        },
        device_bytes=16 << 20, **backend.cfg())
    base.update(over)
    return CacheConfig(**base)


def kv(n, layers=L, heads=H, dim=D, dtype=torch.float32):
    return torch.randn(layers, n, heads, dim, dtype=dtype), torch.randn(layers, n, heads, dim, dtype=dtype)


@pytest.fixture
def cache(backend):
    with TieredKVCache(make_cfg(backend)) as c:
        yield c


def build_multimodal(cache, tenant="acme", image=b"\x89PNG-cat", audio=b"RIFF-clip"):
    seq = cache.create_sequence(tenant=tenant)
    ref = Logical()
    k, v = kv(21)
    cache.append(seq, "text", k, v)
    ref.add(k, v, "text0")
    ikey = cache.content_key("vision", image, tenant=tenant)
    ki, vi = kv(150)
    assert not cache.contains(ikey)
    assert cache.put(ikey, ki, vi)
    cache.attach(seq, ikey)
    ref.add(ki, vi, "image")
    k, v = kv(7)
    cache.append(seq, "text", k, v)
    ref.add(k, v, "text1")
    akey = cache.content_key("audio", audio, tenant=tenant)
    ka, va = kv(45)
    cache.put(akey, ka, va)
    cache.attach(seq, akey)
    ref.add(ka, va, "audio")
    k, v = kv(19)
    cache.append(seq, "text", k, v)
    ref.add(k, v, "text2")
    return seq, ref, ikey, akey, (ki, vi)


@pytest.mark.parametrize("n_q", [1, 5, 40])
@pytest.mark.parametrize("layer", [0, 1])
def test_attention_three_page_sizes_matches_oracle(cache, n_q, layer):
    seq, ref, *_ = build_multimodal(cache)
    hq = 8
    q = torch.randn(n_q, hq, D)
    out = torch.full((n_q, hq, D), float("nan"))
    out = cache.attention(seq, layer, q)
    k, v, pos = ref.gathered(layer)
    assert k.shape[0] == cache.sequence(seq).length == 242
    q_pos = torch.arange(242 - n_q, 242)
    expect, _ = oracle_attention(q, q_pos, k, v, pos, causal=True)
    assert torch.isfinite(out).all()
    assert rel_err(out, expect) < 1e-5


def test_attention_state_lse_matches_oracle(cache):
    seq, ref, *_ = build_multimodal(cache)
    q = torch.randn(3, 4, D)
    out, lse = cache.attention_state(seq, 1, q)
    k, v, pos = ref.gathered(1)
    expect, expect_lse = oracle_attention(q, torch.arange(239, 242), k, v, pos)
    assert rel_err(out, expect) < 1e-5
    assert rel_err(lse, expect_lse) < 1e-6


def test_cross_attention_to_one_group(cache):
    seq, ref, ikey, akey, _ = build_multimodal(cache)
    q = torch.randn(4, 4, D)
    out = cache.attention(seq, 0, q, groups=[ikey], causal=False)
    k, v, pos = ref.gathered(0, select={"image"})
    expect, _ = oracle_attention(q, torch.zeros(4, dtype=torch.long), k, v, pos, causal=False)
    assert rel_err(out, expect) < 1e-5
    both = cache.attention(seq, 0, q, groups=[ikey, akey], causal=False)
    k, v, pos = ref.gathered(0, select={"image", "audio"})
    expect, _ = oracle_attention(q, torch.zeros(4, dtype=torch.long), k, v, pos, causal=False)
    assert rel_err(both, expect) < 1e-5


def test_vision_pool_with_its_own_head_dim(backend):
    cfg = make_cfg(backend, modalities={"text": ModalitySpec(page_size=16),
                               "vision": ModalitySpec(page_size=64, head_dim=80, num_kv_heads=1)})
    assert cfg.modalities["vision"].head_dim == 80 and cfg.modalities["text"].head_dim == D
    with TieredKVCache(cfg) as cache:
        seq = cache.create_sequence()
        cache.append(seq, "text", *kv(10))
        key = cache.content_key("vision", b"img-80")
        ki, vi = kv(100, heads=1, dim=80)
        cache.put(key, ki, vi)
        cache.attach(seq, key)
        q = torch.randn(2, 4, 80)
        out = cache.attention(seq, 1, q, groups=[key], causal=False)
        expect, _ = oracle_attention(q, torch.zeros(2), ki[1], vi[1], torch.arange(100), causal=False)
        assert rel_err(out, expect) < 1e-5
        with pytest.raises(ShapeError):       # 80-dim queries cannot attend to 64-dim text
            cache.attention(seq, 1, q)


def test_second_sequence_reuses_image_stored_once(cache):
    seq1, _, ikey, _, (ki, vi) = build_multimodal(cache)
    before = cache.stats()
    seq2 = cache.create_sequence(tenant="acme")
    cache.append(seq2, "text", *kv(3))
    key2 = cache.content_key("vision", b"\x89PNG-cat", tenant="acme")
    assert key2 == ikey
    assert cache.contains(key2)                # no second put
    cache.attach(seq2, key2)
    after = cache.stats()
    assert after.tiers["device"]["vision"].groups == 1
    assert after.tiers["device"]["vision"].pages == before.tiers["device"]["vision"].pages == 3
    assert after.counters["puts"] == 2         # the image and the audio, once each
    assert after.by_modality["vision"]["shared_attaches"] == 1
    # both sequences read the same pages
    q = torch.randn(1, 2, D)
    out = cache.attention(seq2, 0, q, groups=[key2], causal=False)
    expect, _ = oracle_attention(q, torch.zeros(1), ki[0], vi[0], torch.arange(150), causal=False)
    assert rel_err(out, expect) < 1e-5
    assert cache.put(key2, ki, vi) is False    # a second put stores nothing


def test_tenant_separation(cache):
    ka = cache.content_key("vision", b"same-bytes", tenant="tenant-a")
    kb = cache.content_key("vision", b"same-bytes", tenant="tenant-b")
    assert ka != kb and ka.digest != kb.digest
    cache.put(ka, *kv(64))
    assert cache.contains(ka)
    assert not cache.contains(kb)              # B never hits A's content
    seq_b = cache.create_sequence(tenant="tenant-b")
    with pytest.raises(ForeignKeyError):
        cache.attach(seq_b, ka)                # nor can it attach A's key
    assert cache.sequence(seq_b).length == 0


def test_prefix_keys_chain(cache):
    s1, s2, s3 = (cache.create_sequence(tenant="acme") for _ in range(3))
    k, v = kv(12)
    cache.append(s1, "text", k, v, tokens=list(range(12)))
    cache.append(s2, "text", k.clone(), v.clone(), tokens=list(range(12)))
    cache.append(s3, "text", k, v, tokens=list(range(1, 13)))
    p1, p2, p3 = (cache.prefix_key(s) for s in (s1, s2, s3))
    assert p1 == p2 and p1 != p3
    img1 = cache.content_key("vision", b"img", tenant="acme", parent=p1)
    img3 = cache.content_key("vision", b"img", tenant="acme", parent=p3)
    plain = cache.content_key("vision", b"img", tenant="acme")
    assert len({img1, img3, plain}) == 3
    assert img1.sharing == "prefix" and plain.sharing == "content"


def test_embeddings_round_trip(cache):
    key = cache.content_key("vision_embed", b"img", tenant="acme")
    x = torch.randn(100, 48)
    assert cache.put_embedding(key, x)
    got = cache.get_embedding(key)
    assert torch.equal(got.cpu(), x)
    with pytest.raises(UnknownModalityError):
        cache.put(key, *kv(4))                 # an embedding key cannot hold KV
    vkey = cache.content_key("vision", b"img", tenant="acme")
    with pytest.raises(UnknownModalityError):
        cache.put_embedding(vkey, x)
    with pytest.raises(ShapeError):
        cache.put_embedding(cache.content_key("vision_embed", b"other"), torch.randn(10, 47))


def _state(cache):
    s = cache.stats()
    return (s.to_dict()["tiers"], {k: v for k, v in s.counters.items() if k not in ("hits", "misses")},
            s.sequences)


def test_bad_input_raises_typed_errors_and_changes_nothing(cache, backend):
    seq, *_ = build_multimodal(cache)
    length = cache.sequence(seq).length
    state = _state(cache)
    key = cache.content_key("vision", b"new", tenant="acme")
    other = TieredKVCache(make_cfg(backend, model="other-model"))
    foreign = other.content_key("vision", b"new")
    bad_calls = [
        (ShapeError, lambda: cache.append(seq, "text", *kv(5, heads=3))),
        (ShapeError, lambda: cache.append(seq, "text", torch.randn(L, 5, H, D), torch.randn(L, 6, H, D))),
        (ShapeError, lambda: cache.put(key, *kv(0))),
        (DTypeError, lambda: cache.append(seq, "text", *kv(5, dtype=torch.float16))),
        (DTypeError, lambda: cache.put(key, torch.full((L, 4, H, D), float("nan")), torch.randn(L, 4, H, D))),
        (DTypeError, lambda: cache.put(key, torch.randn(L, 4, H, D), torch.full((L, 4, H, D), float("inf")))),
        (UnknownModalityError, lambda: cache.append(seq, "smell", *kv(5))),
        (UnknownModalityError, lambda: cache.content_key("smell", b"x")),
        (UnknownKeyError, lambda: cache.attach(seq, key)),
        (UnknownKeyError, lambda: cache.attention(seq, 0, torch.randn(1, 2, D), groups=[key])),
        (ForeignKeyError, lambda: cache.put(foreign, *kv(4))),
        (ForeignKeyError, lambda: cache.contains(foreign)),
        (ShapeError, lambda: cache.attention(seq, 2, torch.randn(1, 2, D))),
        (ShapeError, lambda: cache.attention(seq, 0, torch.randn(1, 3, D))),
        (ShapeError, lambda: cache.attention(seq, 0, torch.randn(length + 1, 2, D))),
        (DTypeError, lambda: cache.attention(seq, 0, torch.randn(1, 2, D).double())),
        (UnknownKeyError, lambda: cache.attach(other.create_sequence(), key)),
    ]
    for err, call in bad_calls:
        with pytest.raises(err):
            call()
        assert _state(cache) == state, err
        assert cache.sequence(seq).length == length
    forged = type(key)(key.digest, key.modality, key.sharing, key.scope, bytes(32))
    with pytest.raises(ForeignKeyError):
        cache.put(forged, *kv(4))
    other.close()


def test_full_device_without_lower_tier_raises_capacity_error(backend):
    cfg = make_cfg(backend, device_bytes=4 * 64 * (2 * L * H * D * 4) + 4 * 16 * (2 * L * H * D * 4),
                   modalities={"text": ModalitySpec(page_size=16, share=0.2),
                               "vision": ModalitySpec(page_size=64, share=0.8)})
    with TieredKVCache(cfg) as cache:
        assert cache.pools["vision"].num_pages == 4
        seq = cache.create_sequence()
        held = cache.content_key("vision", b"held")
        cache.put(held, *kv(128))               # 2 pages, attached below: pinned
        cache.attach(seq, held)
        loose = cache.content_key("vision", b"loose")
        cache.put(loose, *kv(64))               # 1 page, unreferenced
        state = _state(cache)
        big = cache.content_key("vision", b"big")
        with pytest.raises(CapacityError):
            cache.put(big, *kv(200))            # 4 pages: only 1 free + 1 evictable
        assert _state(cache) == state and cache.contains(loose)
        cache.put(big, *kv(120))                # 2 pages: evicts the unreferenced group, whole
        assert not cache.contains(loose) and cache.contains(held)
        assert cache.stats().counters["evictions"] == 1


def test_unreferenced_groups_go_least_recently_used_first(backend):
    page = 64 * 2 * L * H * D * 4
    cfg = make_cfg(backend, device_bytes=3 * page, modalities={"vision": ModalitySpec(page_size=64)})
    with TieredKVCache(cfg) as cache:
        a, b, c, d = (cache.content_key("vision", x) for x in (b"a", b"b", b"c", b"d"))
        for key in (a, b, c):
            cache.put(key, *kv(64))
        assert cache.contains(a)                # a lookup does not count as a use...
        cache.read_group(a)                     # ...a read does: a becomes most recent
        cache.put(d, *kv(64))                   # evicts b, the least recently used
        assert [cache.contains(k) for k in (a, b, c, d)] == [True, False, True, True]


def test_release_frees_private_pages_and_keeps_shared(cache):
    seq, _, ikey, akey, _ = build_multimodal(cache)
    assert cache.pools["text"].num_used > 0
    cache.release(seq)
    assert cache.pools["text"].num_used == 0
    assert cache.contains(ikey) and cache.contains(akey)
    with pytest.raises(UnknownKeyError):
        cache.attention(seq, 0, torch.randn(1, 2, D))
    with pytest.raises(UnknownKeyError):
        cache.release(seq)


def test_append_fills_pages_across_calls(cache):
    seq = cache.create_sequence()
    ref = Logical()
    for n in (5, 11, 1, 30, 16):
        k, v = kv(n)
        cache.append(seq, "text", k, v)
        ref.add(k, v, "t")
    table = cache.sequence(seq)
    assert len(table.segments) == 1 and table.length == 63
    assert len(table.text_blocks[0].group.pages) == 4
    q = torch.randn(63, 2, D)
    out = cache.attention(seq, 1, q)
    k, v, pos = ref.gathered(1)
    expect, _ = oracle_attention(q, torch.arange(63), k, v, pos)
    assert rel_err(out, expect) < 1e-5


def test_views_by_modality_and_key(cache):
    seq, _, ikey, akey, _ = build_multimodal(cache)
    table = cache.sequence(seq)
    assert [s.group.modality for s in table.segments] == ["text", "vision", "text", "audio", "text"]
    assert len(table.text_blocks) == 3 and len(table.vision_blocks) == 1 and len(table.audio_blocks) == 1
    assert set(table.by_key) == {ikey, akey}
    assert table.vision_blocks[0].start == 21


def test_closed_cache_refuses_calls(backend):
    cache = TieredKVCache(make_cfg(backend))
    cache.close()
    with pytest.raises(ClosedError):
        cache.create_sequence()


def test_read_group_exports_exact_kv_and_leases_protect(cache):
    from mmtier import LeaseExpiredError

    key = cache.content_key("vision", b"export")
    k, v = kv(100)
    cache.put(key, k, v)
    got_k, got_v = cache.read_group(key)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    lease = cache.lease(key, ttl=60)
    g = cache.index.groups[key]
    assert not g.evictable                          # a live lease protects it
    assert g not in cache.policy.victims(g.tier, 1 << 40, "vision")
    got_k, _ = cache.read_group(key, lease=lease)
    assert torch.equal(got_k, k)
    cache.release_lease(lease)
    assert g.evictable
    dead = cache.lease(key, ttl=1e-9)               # expires at once: the read must fail cleanly
    with pytest.raises(LeaseExpiredError):
        cache.read_group(key, lease=dead)
    assert [(kk, tier) for kk, tier, _ in cache.inventory()] == [(key, "device")]


def test_attention_restricted_to_modalities(cache):
    seq, ref, *_ = build_multimodal(cache)
    q = torch.randn(2, 2, D)
    out = cache.attention(seq, 0, q, modalities=["text"])
    k, v, pos = ref.gathered(0, select={"text0", "text1", "text2"})
    expect, _ = oracle_attention(q, torch.tensor([240, 241]), k, v, pos)
    assert rel_err(out, expect) < 1e-5
    with pytest.raises(UnknownModalityError):
        cache.attention(seq, 0, q, modalities=["smell"])


def test_parts_attend_at_their_absolute_positions(cache):
    """``attention_state_parts`` places segments of several local sequences (a pool's runs and
    proxies of a cluster sequence) at positions of a bigger sequence in one call: equal to the
    oracle over those keys at those positions, causal masking included; a group attached twice
    is told apart by its local start; a segment named twice is refused (typed, nothing changed)."""
    run = cache.create_sequence()
    k0, v0 = kv(50)
    cache.append(run, "text", k0, v0)
    proxy = cache.create_sequence()
    keys, ks, vs = [], [], []
    for i, n in enumerate((40, 70)):
        key = cache.content_key("vision", f"part-{i}".encode())
        k, v = kv(n)
        cache.put(key, k, v)
        cache.attach(proxy, key)
        keys.append(key)
        ks.append(k)
        vs.append(v)
    cache.attach(proxy, keys[0])                 # the same image again, later in the sequence
    local = [s.start for s in cache.sequence(proxy).segments]          # 0, 40, 110
    where = {"run": 300, "img0": 500, "img1": 120, "img0again": 1000}
    parts = [(run, None, where["run"], None),
             (proxy, [keys[0]], where["img0"] - local[0], local[0]),
             (proxy, [keys[1]], where["img1"] - local[1], None),
             (proxy, [keys[0]], where["img0again"] - local[2], local[2])]
    q = torch.randn(2, 4, D)
    q_pos = torch.tensor([520, 1100])            # the first query sees part of img0, not img0again
    out, lse = cache.attention_state_parts(parts, 1, q, q_pos)
    pieces = [(k0, v0, where["run"]), (ks[0], vs[0], where["img0"]), (ks[1], vs[1], where["img1"]),
              (ks[0], vs[0], where["img0again"])]
    pos = torch.cat([torch.arange(a, a + k.shape[1]) for k, _, a in pieces])
    expect, expect_lse = oracle_attention(q, q_pos, torch.cat([k for k, _, _ in pieces], 1)[1],
                                          torch.cat([v for _, v, _ in pieces], 1)[1], pos)
    assert rel_err(out, expect) < 1e-5 and rel_err(lse, expect_lse) < 1e-6
    before = cache.stats().counters
    with pytest.raises(ShapeError):              # img0 without a start names both of its segments
        cache.attention_state_parts(parts + [(proxy, [keys[0]], 0, None)], 1, q, q_pos)
    assert cache.stats().counters == before


def test_attention_plans_from_host_tables(cache, monkeypatch):
    """The cache hands the kernels their index tables built on the host, int32, with the host
    copies alongside (``PagedKV.host``, ``host_q_indptr``): planning a launch reads those, not
    the device. Checked on every device-part call of a multimodal sequence."""
    import mmtier.attention.plan as cache_module

    seen = []
    real = cache_module.paged_attention

    def spy(q, q_indptr, q_pos, operands, **kw):
        host_q = kw.get("host_q_indptr")
        assert host_q is not None and host_q.device.type == "cpu"
        assert torch.equal(host_q, q_indptr.cpu()) and q_pos.dtype == torch.int32
        for op in operands:
            assert op.host is not None
            for name in ("seg_indptr", "seg_page_indptr", "seg_start", "seg_len", "page_ids"):
                dev, host = getattr(op, name), getattr(op.host, name)
                assert dev.dtype == host.dtype == torch.int32 and torch.equal(dev.cpu(), host)
        seen.append(len(operands))
        return real(q, q_indptr, q_pos, operands, **kw)

    monkeypatch.setattr(cache_module, "paged_attention", spy)
    seq, ref, *_ = build_multimodal(cache)
    q = torch.randn(2, 4, D)
    out = cache.attention(seq, 1, q)
    k, v, pos = ref.gathered(1)
    expect, _ = oracle_attention(q, torch.tensor([240, 241]), k, v, pos)
    assert rel_err(out, expect) < 1e-5 and seen == [3]      # text, vision, audio pools


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (host syncs exist only there)")
def test_attention_on_cuda_makes_no_host_sync(backend):
    """On a GPU an attention call over device-resident pages never waits on the device: CUDA's
    sync debug mode turns any synchronizing call (``.item()``, ``.tolist()``, a blocking copy)
    into an error. Queries and positions are on the GPU, as an engine would give them."""
    if backend.name != "triton" or backend.device == "cpu":
        pytest.skip("the no-sync path is the Triton backend on a CUDA pool")
    with TieredKVCache(make_cfg(backend)) as cache:
        seq, ref, *_ = build_multimodal(cache)
        dev = cache.arena.device
        q = torch.randn(3, 8, D, device=dev)
        pos = torch.arange(239, 242, device=dev)
        cache.attention(seq, 0, q)                           # compile the kernels first
        cache.attention_state(seq, 0, q, q_positions=pos)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = cache.attention(seq, 0, q)
            out2, _ = cache.attention_state(seq, 0, q, q_positions=pos)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert out.device == q.device
        k, v, kpos = ref.gathered(0)
        expect, _ = oracle_attention(q.cpu(), torch.arange(239, 242), k, v, kpos)
        assert rel_err(out.cpu(), expect) < 1e-5 and rel_err(out2.cpu(), expect) < 1e-5


def test_a_write_that_fails_midway_changes_nothing(backend, monkeypatch):
    """A kernel launch that raises during ``append`` or ``put`` (a device fault, an interpreter
    error) leaves pages, the sequence and the index as they were; the next call works."""
    import mmtier.pages.payload as payload

    with TieredKVCache(make_cfg(backend)) as cache:
        seq = cache.create_sequence(tenant="acme")
        k0, v0 = kv(10)
        cache.append(seq, "text", k0, v0)
        used = {m: p.num_used for m, p in cache.pools.items()}
        before = (cache.sequence(seq).length, cache.prefix_key(seq))
        real = payload.write_kv

        def broken(*a, **kw):
            raise RuntimeError("injected launch failure")

        real_pages = payload.kv_into_pages

        def broken_midway(view, ids, k, v, *rest):      # the first pages land, then it fails
            real_pages(view, ids[:1], k[:, :view.shape[3]], v[:, :view.shape[3]], *rest)
            raise RuntimeError("injected copy failure")

        monkeypatch.setattr(payload, "write_kv", broken)
        monkeypatch.setattr(payload, "kv_into_pages", broken_midway)
        key = cache.content_key("vision", b"img", tenant="acme")
        with pytest.raises(RuntimeError):
            cache.append(seq, "text", *kv(30))          # extends the run and needs a new page
        with pytest.raises(RuntimeError):
            cache.put(key, *kv(70))                      # fails after its first page
        assert {m: p.num_used for m, p in cache.pools.items()} == used
        assert (cache.sequence(seq).length, cache.prefix_key(seq)) == before
        assert not cache.contains(key)
        monkeypatch.setattr(payload, "write_kv", real)
        k1, v1 = kv(30)
        cache.append(seq, "text", k1, v1)
        q = torch.randn(1, 4, D)
        k, v = torch.cat([k0, k1], 1), torch.cat([v0, v1], 1)
        expect, _ = oracle_attention(q, torch.tensor([39]), k[1], v[1], torch.arange(40))
        assert rel_err(cache.attention(seq, 1, q), expect) < 1e-5
