"""The cache across device, host and disk: demotion of whole groups, attention where the pages
live merged by log-sum-exp, warm restart over the same directory, corrupt files as misses."""

from __future__ import annotations

import pytest
import torch

from mmtier import CacheConfig, ModalitySpec, TieredKVCache, UnknownKeyError
from mmtier.core.groups import Tier
from mmtier.errors import CorruptDataError
from tests.support.oracle import oracle_attention, rel_err

L, H, D = 2, 2, 32
TOKEN_BYTES = 2 * L * H * D * 4          # K and V, all layers, float32
VISION_PAGE = 32 * TOKEN_BYTES
TEXT_PAGE = 16 * TOKEN_BYTES


def make_cfg(backend, tmp_path, device_pages=4, host_pages=4, disk=True, **over):
    """Three tiers on ``backend`` (its attention backend and device): ``device_pages`` vision
    pages on the device, ``host_pages`` vision pages' worth of host bytes, a disk tier."""
    base = dict(
        model="tiny-tiers", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
        modalities={"text": ModalitySpec(page_size=16, share=0.25),
                    "vision": ModalitySpec(page_size=32, share=0.5),
                    "vision_embed": ModalitySpec(kind="embedding", width=16, page_size=32, share=0.25)},
        device_bytes=2 * device_pages * VISION_PAGE + 64,
        host_bytes=host_pages * VISION_PAGE, disk_dir=(tmp_path / "spill") if disk else None,
        disk_bytes=64 << 20, disk_free_floor_bytes=0, **backend.cfg())
    base.update(over)
    return CacheConfig(**base)


def kv(n):
    return torch.randn(L, n, H, D), torch.randn(L, n, H, D)


def tiers_of(cache, keys):
    return [cache.index.groups[k].tier for k in keys]


def test_unreferenced_groups_cascade_device_host_disk(tmp_path, backend):
    # the cascade is the demotion's: each put into the full pool pushes the oldest group down
    with TieredKVCache(make_cfg(backend, tmp_path, put_placement="demote")) as cache:
        assert cache.pools["vision"].num_pages == 4
        keys = [cache.content_key("vision", f"img{i}".encode()) for i in range(6)]
        data = {}
        for key in keys:                      # 2 pages each: 12 pages over device 4 + host 4
            data[key] = kv(64)
            cache.put(key, *data[key])
        cache.flush()                         # let background spills land
        where = tiers_of(cache, keys)
        assert where[-2:] == [Tier.DEVICE, Tier.DEVICE]
        assert Tier.DISK in where and where.count(Tier.DEVICE) == 2
        s = cache.stats()
        assert s.tiers["device"]["vision"].groups == 2
        total = sum(s.tiers[t]["vision"].groups for t in ("device", "host", "disk"))
        assert total == 6                     # nothing lost, nothing split
        assert s.counters["spills"] >= 4 and s.counters.get("evictions", 0) == 0


def test_attention_across_three_tiers_equals_oracle(tmp_path, backend, monkeypatch):
    """Device, host and disk parts equal the oracle once merged; the merge runs on the device
    part's device, with the cache's backend (the lower parts' small states go up to it)."""
    import mmtier.attention.plan as cache_module

    merges = []
    real_merge = cache_module.merge_attention_states

    def spy(outs, lses, **kw):
        merges.append(({o.device for o in outs} | {s.device for s in lses}, kw.get("backend")))
        return real_merge(outs, lses, **kw)

    monkeypatch.setattr(cache_module, "merge_attention_states", spy)
    cfg = make_cfg(backend, tmp_path, device_pages=4, host_pages=4)
    with TieredKVCache(cfg) as cache:
        seq = cache.create_sequence()
        ks, vs = [], []
        for i in range(5):                    # 5 images x 2 pages, all attached: referenced
            k, v = kv(60)
            key = cache.content_key("vision", f"img{i}".encode())
            cache.put(key, k, v)
            cache.attach(seq, key)
            ks.append(k)
            vs.append(v)
        k, v = kv(20)
        cache.append(seq, "vision", k, v)     # a private run of the same pool
        ks.append(k)
        vs.append(v)
        where = {s.group.tier for s in cache.sequence(seq).segments}
        assert Tier.DEVICE in where and (Tier.HOST in where or Tier.DISK in where)
        q = torch.randn(3, 4, D)
        for layer in range(L):
            out = cache.attention(seq, layer, q)
            kk = torch.cat(ks, dim=1)[layer]
            vv = torch.cat(vs, dim=1)[layer]
            t = kk.shape[0]
            expect, _ = oracle_attention(q, torch.arange(t - 3, t), kk, vv, torch.arange(t))
            assert rel_err(out, expect) < 1e-5 and out.device == q.device
        assert len(merges) == L and all(m == ({cache.arena.storage.device}, backend.name) for m in merges)
        cache.release(seq)
        assert cache.pools["vision"].num_used == sum(
            len(g.pages) for g in cache.index.groups.values() if g.tier == Tier.DEVICE)


def test_disk_groups_stream_for_attention(tmp_path, backend):
    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=0)
    cfg = cfg.model_copy(update={"host_bytes": 0})
    with TieredKVCache(cfg) as cache:
        seq = cache.create_sequence()
        ks, vs = [], []
        for i in range(3):
            k, v = kv(64)
            key = cache.content_key("vision", f"d{i}".encode())
            cache.put(key, k, v)
            cache.attach(seq, key)
            ks.append(k)
            vs.append(v)
        assert [s.group.tier for s in cache.sequence(seq).segments].count(Tier.DISK) == 2
        q = torch.randn(2, 2, D)
        out = cache.attention(seq, 1, q, causal=False)
        expect, _ = oracle_attention(q, torch.zeros(2), torch.cat(ks, 1)[1], torch.cat(vs, 1)[1],
                                     torch.arange(192), causal=False)
        assert rel_err(out, expect) < 1e-5


def _mixed_on_disk(cache, count, every):
    """``count`` groups attached to a new sequence (vision, and text every ``every``-th), let
    spill; returns the sequence, their K, V, keys, and the keys that ended on disk (both kinds)."""
    seq = cache.create_sequence()
    ks, vs, keys = [], [], []
    for i in range(count):
        kind, n = ("vision", 50) if i % every else ("text", 30)
        k, v = kv(n)
        key = cache.content_key(kind, f"{every}-{i}".encode())
        cache.put(key, k, v)
        cache.attach(seq, key)
        ks.append(k)
        vs.append(v)
        keys.append(key)
    cache.flush()
    on_disk = [key for key in keys if cache.index.groups[key].tier == Tier.DISK]
    assert {key.modality for key in on_disk} == {"text", "vision"}
    return seq, ks, vs, keys, on_disk


def test_disk_groups_are_read_one_layer_per_call(tmp_path, backend):
    """Attention over one layer reads only that layer's bytes of each disk-resident page (1/L
    of the group), verified, and equals the float64 oracle for every layer."""
    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=0).model_copy(update={"host_bytes": 0})
    with TieredKVCache(cfg) as cache:
        seq, ks, vs, keys, on_disk = _mixed_on_disk(cache, 6, every=2)
        assert len(on_disk) >= 4
        disk = cache.lower.disk
        page_bytes = sum(disk.info(key).num_pages * cfg.spec(key.modality).page_bytes
                         for key in on_disk)
        file_bytes = sum(disk.info(key).nbytes for key in on_disk)
        q = torch.randn(3, 4, D)
        kk, vv = torch.cat(ks, 1), torch.cat(vs, 1)
        t = kk.shape[1]
        for layer in (1, 0, 1):
            before = disk.stats()["read_bytes"]
            out = cache.attention(seq, layer, q)
            read = disk.stats()["read_bytes"] - before
            assert tiers_of(cache, on_disk) == [Tier.DISK] * len(on_disk)
            expect, _ = oracle_attention(q, torch.arange(t - 3, t), kk[layer], vv[layer], torch.arange(t))
            assert rel_err(out, expect) < 1e-5
            assert read == page_bytes // L and read < file_bytes / L
        assert cache.stats().counters.get("corrupt_reads", 0) == 0


def every_layer_matches_oracle(cache, seq, q, ks, vs) -> None:
    """Each layer's attention of ``q`` (the last ``len(q)`` positions) over ``seq`` equals the
    oracle's over the concatenated ``ks`` / ``vs``."""
    kk, vv = torch.cat(ks, 1), torch.cat(vs, 1)
    t, n = kk.shape[1], q.shape[0]
    for layer in range(L):
        out = cache.attention(seq, layer, q)
        expect, _ = oracle_attention(q, torch.arange(t - n, t), kk[layer], vv[layer], torch.arange(t))
        assert rel_err(out, expect) < 1e-5


def test_disk_stream_in_many_batches_equals_oracle_and_fails_as_a_whole(tmp_path, monkeypatch, backend):
    """Disk groups of two modalities streamed in several small batches, each computed as it
    lands and merged by log-sum-exp, equal the oracle; a corrupt file in one batch makes the
    whole call a miss (every bad group dropped), and the next call serves the rest exactly."""
    from mmtier.attention import streaming
    from mmtier.attention.lower_operands import disk_stream

    monkeypatch.setattr(streaming, "BATCH_BYTES", VISION_PAGE)    # bytes read: one of 2 layers
    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=0).model_copy(update={"host_bytes": 0})
    with TieredKVCache(cfg) as cache:
        seq, ks, vs, keys, on_disk = _mixed_on_disk(cache, 9, every=3)
        assert len(on_disk) >= 6
        batches = disk_stream(cache.lower, cache.sequence(seq).segments, 0).batches
        assert len(batches) >= 4
        for _, fut in batches:
            fut.result(timeout=60)
        q = torch.randn(2, 4, D)
        every_layer_matches_oracle(cache, seq, q, ks, vs)
        victims = [on_disk[1], on_disk[-1]]
        for victim in victims:      # a call over layer 0 reads (and verifies) only layer 0's
            extent = cache.lower.disk.info(victim).extents[0]     # bytes: damage one of them
            _flip_one_byte(tmp_path / "spill" / extent.name, at=extent.offsets[0] + 5)
        with pytest.raises(CorruptDataError):
            cache.attention(seq, 0, q)
        assert cache.stats().counters["corrupt_reads"] == 2
        assert not any(cache.contains(v) for v in victims)
        assert all(cache.contains(k) for k in keys if k not in victims)


def test_a_long_disk_read_takes_fewer_larger_batches(tmp_path, monkeypatch, backend):
    """Past ``BATCH_BYTES`` x ``MAX_BATCHES`` a call's batches grow (about ``MAX_BATCHES`` in
    all, none over ``MAX_BATCH_BYTES``), and the answer is the oracle's all the same."""
    from mmtier.attention import streaming
    from mmtier.attention.lower_operands import disk_stream

    monkeypatch.setattr(streaming, "BATCH_BYTES", VISION_PAGE)
    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=0).model_copy(update={"host_bytes": 0})
    with TieredKVCache(cfg) as cache:
        seq, ks, vs, keys, on_disk = _mixed_on_disk(cache, 9, every=3)
        segs = cache.sequence(seq).segments

        def batches() -> int:
            stream = disk_stream(cache.lower, segs, 0)
            for _, fut in stream.batches:
                fut.result(timeout=60)
            stream.close()
            return len(stream.batches)

        many = batches()
        monkeypatch.setattr(streaming, "MAX_BATCHES", 1)
        few = batches()
        assert few < many and few <= len({s.group.modality for s in segs if s.group.tier == Tier.DISK})
        q = torch.randn(2, 4, D)
        every_layer_matches_oracle(cache, seq, q, ks, vs)
        monkeypatch.setattr(streaming, "MAX_BATCH_BYTES", VISION_PAGE)
        assert batches() == many


@pytest.mark.parametrize("persist", [False, True])
def test_warm_restart_knows_every_group_on_disk(tmp_path, backend, persist):
    """Three groups spilled to disk; the fourth is on the device when the cache closes:
    ``persist_on_close`` writes it too (a restart then knows all four), without it only the
    spilled three come back (write-behind off: with it, every put is on disk anyway,
    tests/cache/test_write_behind.py)."""
    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=0).model_copy(
        update={"host_bytes": 0, "persist_on_close": persist, "write_behind": False})
    data = {}
    with TieredKVCache(cfg) as cache:
        for i in range(4):
            key = cache.content_key("vision", f"w{i}".encode(), tenant="acme")
            data[key] = kv(50)
            cache.put(key, *data[key])
        on_disk = [k for k in data if cache.index.groups[k].tier == Tier.DISK]
        assert len(on_disk) == 3
        held = [k for k in data if k not in on_disk]
        assert [cache.index.groups[k].tier for k in held] == [Tier.DEVICE]
    (tmp_path / "spill" / "leftover.arrow.tmp").write_bytes(b"partial write")
    with TieredKVCache(cfg) as again:
        assert not (tmp_path / "spill" / "leftover.arrow.tmp").exists()
        for key in on_disk:
            key2 = again.content_key("vision", f"w{list(data).index(key)}".encode(), tenant="acme")
            assert key2 == key and again.contains(key2)
        seq = again.create_sequence(tenant="acme")
        key = on_disk[0]
        again.attach(seq, key)
        q = torch.randn(1, 2, D)
        out = again.attention(seq, 0, q, causal=False)
        k, v = data[key]
        expect, _ = oracle_attention(q, torch.zeros(1), k[0], v[0], torch.arange(50), causal=False)
        assert rel_err(out, expect) < 1e-5
        assert again.stats().counters["adopted_from_disk"] == 3 + persist
        assert again.contains(held[0]) == persist
        if persist:                   # the group written at close reads back exactly
            got_k, got_v = again.read_group(held[0])
            assert torch.equal(got_k, data[held[0]][0]) and torch.equal(got_v, data[held[0]][1])


def test_warm_restart_removes_private_runs_and_keeps_shared_groups(tmp_path, backend):
    """A private run (a sequence's own K/V) on disk is unreachable after its cache is gone: a
    new cache removes its file and counts it, and still adopts the shared groups beside it."""
    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=1)
    with TieredKVCache(cfg) as cache:
        for _ in range(3):            # 2 text pages each: the first run goes device -> host -> disk
            cache.append(cache.create_sequence(tenant="acme"), "text", *kv(32))
        shared = [cache.content_key("vision", f"s{i}".encode(), tenant="acme") for i in range(4)]
        for key in shared:
            cache.put(key, *kv(40))
        on_disk = [k for k in shared if cache.index.groups[k].tier == Tier.DISK]
        assert on_disk and cache.stats().tiers["disk"]["text"].groups == 1
        text_files = sorted((tmp_path / "spill").glob("text-*.arrow"))
        assert len(text_files) == 1
    with TieredKVCache(cfg) as again:
        st = again.stats()
        assert st.counters["private_runs_removed_at_start"] == 1
        # the shared groups still on the device and host were written at close: all four
        assert st.counters["adopted_from_disk"] == len(shared) > len(on_disk)
        assert not any(p.exists() for p in text_files)
        assert st.tiers["disk"]["text"].groups == 0 and st.tiers["disk"]["text"].bytes == 0
        assert st.tiers["disk"]["vision"].groups == len(shared)
        assert all(again.contains(k) for k in shared)
        assert len(again.index.groups) == len(shared)


def test_writing_at_close_takes_only_what_the_disk_budget_holds_and_drops_nothing(tmp_path, backend):
    """A disk budget of three vision groups: the three spilled stay, the one on the device at
    close is not written: nothing on disk is dropped for it (write-behind off)."""
    group_bytes = 2 * VISION_PAGE                          # a 50-token group: two vision pages
    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=0).model_copy(
        update={"host_bytes": 0, "disk_bytes": 3 * group_bytes + group_bytes // 2, "write_behind": False})
    with TieredKVCache(cfg) as cache:
        keys = [cache.content_key("vision", f"b{i}".encode(), tenant="acme") for i in range(4)]
        for key in keys:
            cache.put(key, *kv(50))
        assert tiers_of(cache, keys) == [Tier.DISK] * 3 + [Tier.DEVICE]
    with TieredKVCache(cfg) as again:
        assert again.stats().counters["adopted_from_disk"] == 3
        assert [again.contains(k) for k in keys] == [True, True, True, False]


def _flip_one_byte(path, at=None):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["flip", "truncate", "zero_tail"])
def test_corrupt_file_is_a_miss_never_wrong_kv(tmp_path, damage, backend):
    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=0).model_copy(update={"host_bytes": 0})
    with TieredKVCache(cfg) as cache:
        keys = [cache.content_key("vision", f"c{i}".encode()) for i in range(3)]
        for key in keys:
            cache.put(key, *kv(64))
        victim = keys[0]
        assert cache.index.groups[victim].tier == Tier.DISK
        files = sorted((tmp_path / "spill").glob(f"vision-{victim.hex}*.arrow"))
        assert files
        raw = files[0].read_bytes()
        if damage == "flip":
            _flip_one_byte(files[0])
        elif damage == "truncate":
            files[0].write_bytes(raw[: len(raw) // 3])
        else:
            files[0].write_bytes(raw[: len(raw) // 2] + bytes(len(raw) - len(raw) // 2))
        seq = cache.create_sequence()
        # The restart path checks the footer; the read path checks every page's checksum.
        with pytest.raises((UnknownKeyError, CorruptDataError)):
            cache.attach(seq, victim)
            cache.attention(seq, 0, torch.randn(1, 2, D), groups=[victim], causal=False)
        assert not cache.contains(victim)               # now a plain miss
        counters = cache.stats().counters
        assert counters.get("corrupt_reads", 0) + counters.get("disk_corrupt_reads", 0) >= 1


def test_host_only_tier_drops_least_recent_at_the_bottom(tmp_path, backend):
    # demote: each put pushes the pool's oldest group into the host tier, which drops its oldest
    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=4, disk=False, put_placement="demote")
    with TieredKVCache(cfg) as cache:
        keys = [cache.content_key("vision", f"h{i}".encode()) for i in range(4)]
        for key in keys:
            cache.put(key, *kv(64))
        assert [cache.contains(k) for k in keys] == [False, True, True, True]
        assert cache.index.groups[keys[1]].tier == Tier.HOST
        assert cache.stats().counters["evictions"] == 1


def test_attach_promotes_a_host_group_when_room_allows(tmp_path, backend):
    # demote: the third put pushes ``a`` down, so the attach must bring it back up
    cfg = make_cfg(backend, tmp_path, device_pages=4, host_pages=4, disk=False, put_placement="demote")
    with TieredKVCache(cfg) as cache:
        a, b, c = (cache.content_key("vision", x) for x in (b"a", b"b", b"c"))
        k, v = kv(64)
        cache.put(a, k, v)
        cache.put(b, *kv(64))
        cache.put(c, *kv(64))                 # a goes to host
        assert cache.index.groups[a].tier == Tier.HOST
        seq = cache.create_sequence()
        cache.attach(seq, a)                  # room is made by demoting b (unreferenced)
        assert cache.index.groups[a].tier == Tier.DEVICE
        assert cache.stats().counters["restores"] == 1
        q = torch.randn(1, 2, D)
        out = cache.attention(seq, 0, q, causal=False)
        expect, _ = oracle_attention(q, torch.zeros(1), k[0], v[0], torch.arange(64), causal=False)
        assert rel_err(out, expect) < 1e-5


def test_prefetch_brings_a_disk_group_to_host(tmp_path, backend):
    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=6)
    with TieredKVCache(cfg) as cache:
        keys = [cache.content_key("vision", f"p{i}".encode()) for i in range(6)]
        data = {}
        for key in keys:
            data[key] = kv(64)
            cache.put(key, *data[key])
        cache.flush()
        on_disk = [k for k in keys if cache.index.groups[k].tier == Tier.DISK]
        assert on_disk, [cache.index.groups[k].tier for k in keys]
        target = on_disk[0]
        for key in keys:                        # free the host tier: drop what sits there
            g = cache.index.groups[key]
            if g.tier == Tier.HOST:
                cache.residency.drop(g)
        assert cache.prefetch(target) is True
        cache.flush()
        assert cache.index.groups[target].tier == Tier.HOST
        assert cache.stats().counters["prefetched"] == 1
        seq = cache.create_sequence()
        cache.attach(seq, target)
        q = torch.randn(1, 2, D)
        k, v = data[target]
        out = cache.attention(seq, 1, q, causal=False)
        expect, _ = oracle_attention(q, torch.zeros(1), k[1], v[1], torch.arange(64), causal=False)
        assert rel_err(out, expect) < 1e-5


def test_embeddings_spill_and_come_back(tmp_path, backend):
    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=1)
    with TieredKVCache(cfg) as cache:
        assert cache.pools["vision_embed"].num_pages >= 1
        xs = {}
        for i in range(4):
            key = cache.content_key("vision_embed", f"e{i}".encode())
            xs[key] = torch.randn(30, 16)
            cache.put_embedding(key, xs[key])
        for key, x in xs.items():
            assert torch.equal(cache.get_embedding(key).cpu(), x)


def test_stream_buffers_are_reused_and_given_back(tmp_path, monkeypatch, backend):
    """Decode steps over disk groups reuse the staging buffers of the step before (no fresh
    allocation after the first), and a call that fails midway gives every buffer back."""
    import time

    import mmtier.attention.plan as plan_module

    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=0).model_copy(update={"host_bytes": 0})
    with TieredKVCache(cfg) as cache:
        seq = cache.create_sequence()
        for i in range(6):
            key = cache.content_key("vision", f"b{i}".encode())
            cache.put(key, *kv(60))
            cache.attach(seq, key)
        cache.flush()
        tiers = [s.group.tier for s in cache.sequence(seq).segments]
        assert tiers.count(Tier.DISK) >= 4 and Tier.DEVICE in tiers
        staging = cache.lower.staging
        q = torch.randn(1, 4, D)
        first = cache.attention(seq, 0, q)
        allocated = staging.allocated
        assert allocated >= 1 and not staging._out
        for _ in range(3):
            assert torch.equal(cache.attention(seq, 0, q), first)
        assert staging.allocated == allocated and staging.reused >= 3 and not staging._out
        counters = cache.stats().counters
        assert counters["stream_buffers_reused"] == staging.reused > 0
        assert counters["stream_buffer_bytes_pooled"] > 0 and counters["disk_read_bytes"] > 0

        def device_part_fails(*a, **kw):
            raise RuntimeError("injected: the device part failed while the disk reads ran")

        monkeypatch.setattr(plan_module, "paged_attention", device_part_fails)
        with pytest.raises(RuntimeError, match="injected"):
            cache.attention(seq, 0, q)
        for _ in range(100):                                  # late reads give back as they land
            if not staging._out:
                break
            time.sleep(0.05)
        assert not staging._out
        monkeypatch.undo()
        assert torch.equal(cache.attention(seq, 0, q), first)


def test_leaf_first_demotes_a_child_from_its_own_pool(tmp_path, backend):
    """A chain text -> vision -> text with room for two text pages: storing the last text group
    makes room in the text pool, and leaf-first moves the vision child (in the vision pool)
    before its text parent. The child is copied from its own pool's pages and both stay whole
    on disk (before, it was copied through the text pool's view, the copy failed with a shape
    error and the group was dropped)."""
    cfg = make_cfg(backend, tmp_path, device_pages=2, host_pages=0)
    cfg = cfg.model_copy(update={"host_bytes": 0})
    with TieredKVCache(cfg) as cache:
        assert cache.pools["text"].num_pages == 2
        root = cache.content_key("text", b"system prompt")
        img = cache.content_key("vision", b"image", parent=root)
        tail = cache.content_key("text", b"after the image", parent=img)
        data = {root: kv(16), img: kv(40), tail: kv(20)}
        for key in (root, img, tail):
            cache.put(key, *data[key])
        assert tiers_of(cache, [root, img, tail]) == [Tier.DISK, Tier.DISK, Tier.DEVICE]
        for key in (root, img, tail):
            k, v = cache.read_group(key)
            assert torch.equal(k, data[key][0]) and torch.equal(v, data[key][1])
        assert cache.stats().counters.get("spill_failures", 0) == 0
