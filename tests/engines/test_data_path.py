"""The data path between tiers: page runs moved by slices, ``read_group(out=)`` / ``read_groups``
with one copy per group from each tier, ``DiskTier.put_many`` and parallel ``get_many``, and
verified reads of host copies and transfers (real corruption of the real bytes: a miss plus a
counter, never wrong KV)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from mmtier import CacheConfig, ModalitySpec, TieredKVCache
from mmtier.cache import GroupPages
from mmtier.content import KeyMaker
from mmtier.core.groups import Tier
from mmtier.errors import CapacityError, CorruptDataError, DTypeError, ShapeError
from mmtier.pages.copies import kv_into_pages, pages_into_kv
from mmtier.storage import DiskTier, HostTier, Mover

L, H, D, P = 3, 2, 16, 8


def cfg(tmp_path, device_groups=2, host_groups=2, disk=True, **over):
    """One ``text`` modality of 8-token pages, float32; groups of 40 tokens (5 pages)."""
    page = L * 2 * P * H * D * 4
    base = dict(model="tiny-path", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
                modalities={"text": ModalitySpec(page_size=P)}, device="cpu",
                device_bytes=device_groups * 5 * page + 64, host_bytes=host_groups * 5 * page,
                disk_dir=(tmp_path / "spill") if disk else None, disk_bytes=64 << 20,
                disk_free_floor_bytes=0)
    base.update(over)
    return CacheConfig(**base)


def kv(n=40):
    return torch.randn(L, n, H, D), torch.randn(L, n, H, D)


def in_three_tiers(cache, keys):
    """After the puts: flush the spills; when the background spills left no group in host
    memory (their timing varies), bring one disk group up (a prefetch), so each tier holds one."""
    cache.flush()
    if not any(cache.index.groups[k].tier == Tier.HOST for k in keys):
        cache.prefetch(next(k for k in keys if cache.index.groups[k].tier == Tier.DISK))
        cache.flush()
    assert {cache.index.groups[k].tier for k in keys} == {Tier.DEVICE, Tier.HOST, Tier.DISK}


def poisoned(n=40):
    return torch.full((L, n, H, D), float("nan")), torch.full((L, n, H, D), float("nan"))


# ---------------------------------------------------------------------------- page copies
@pytest.mark.parametrize("n", [8, 37, 40, 41])
def test_kv_into_pages_and_back_over_shuffled_runs(n):
    """Scattered page ids (runs of 1, 2 and 3 pages, out of order), a partial last page: every
    token lands at its page and slot, and comes back equal; untouched pages stay poisoned."""
    view = torch.full((16, L, 2, P, H, D), float("nan"))
    ids = [9, 10, 11, 3, 0, 1][: -(-n // P)]
    k, v = kv(n)
    kv_into_pages(view, ids, k, v)
    for t in range(n):
        p, s = ids[t // P], t % P
        assert torch.equal(view[p, :, 0, s], k[:, t]) and torch.equal(view[p, :, 1, s], v[:, t])
    others = [i for i in range(16) if i not in ids]
    assert torch.isnan(view[others]).all()
    out_k, out_v = poisoned(n)
    pages_into_kv([view[i:i + 1] for i in ids], out_k, out_v)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)


def test_kv_into_pages_refuses_too_few_pages():
    view = torch.zeros(4, L, 2, P, H, D)
    with pytest.raises(ShapeError):
        kv_into_pages(view, [0, 1], *kv(24))


# ---------------------------------------------------------------------------- read_group(out=)
def test_read_group_into_out_from_every_tier(tmp_path):
    """Groups on the device, in host memory and on disk, read into the caller's tensors
    (strided ones too): equal to what was put, and the very tensors given are returned."""
    with TieredKVCache(cfg(tmp_path)) as cache:
        keys = [cache.content_key("text", b"g%d" % i) for i in range(6)]
        data = {key: kv() for key in keys}
        for key in keys:
            cache.put(key, *data[key])
        in_three_tiers(cache, keys)
        for key in keys:
            base_k = torch.full((L, H, 40, D), float("nan"))        # [L, n, H, D] as a strided view
            out = (base_k.transpose(1, 2), torch.full((L, 40, H, D), float("nan")))
            got = cache.read_group(key, out=out)
            assert got[0] is out[0] and got[1] is out[1]
            assert torch.equal(out[0], data[key][0]) and torch.equal(out[1], data[key][1])
            k2, v2 = cache.read_group(key)                           # and new tensors
            assert torch.equal(k2, data[key][0]) and torch.equal(v2, data[key][1])
        outs = [poisoned() for _ in keys]
        cache.read_groups(keys, out=outs)                            # disk reads side by side
        for key, (ok, ov) in zip(keys, outs):
            assert torch.equal(ok, data[key][0]) and torch.equal(ov, data[key][1])


@pytest.mark.parametrize("bad", ["shape", "dtype", "not_a_pair", "shared"])
def test_read_group_refuses_a_bad_out_and_changes_nothing(tmp_path, bad):
    with TieredKVCache(cfg(tmp_path, disk=False)) as cache:
        key = cache.content_key("text", b"g")
        cache.put(key, *kv())
        before = cache.stats().counters.get("exports", 0)
        good = poisoned()
        out = {"shape": (torch.zeros(L, 39, H, D), good[1]),
               "dtype": (good[0].double(), good[1]),
               "not_a_pair": good[0],
               "shared": (good[0], good[0])}[bad]
        with pytest.raises((ShapeError, DTypeError)):
            cache.read_group(key, out=out)
        assert cache.stats().counters.get("exports", 0) == before
        assert torch.isnan(good[1]).all()


def _engine_stage(n_blocks):
    """An engine's staging in vLLM's CPU layout ``[L, blocks, heads, block_size, 2 * head_dim]``
    (K then V along the last axis) and its block-split K/V views ``[L, blocks, P, H, D]``."""
    stage = torch.randn(L, n_blocks, H, P, 2 * D)
    t = stage.transpose(2, 3)
    return stage, t[..., :D], t[..., D:]


def test_put_and_read_group_of_block_split_views_from_every_tier(tmp_path):
    """``put`` of an engine stage's block-split views (no single token stride) stores the same
    KV as the flattened tensors; ``read_group(out=)`` into another stage's views brings it back
    from the device, host and disk tiers."""
    with TieredKVCache(cfg(tmp_path)) as cache:
        keys = [cache.content_key("text", b"b%d" % i) for i in range(6)]
        stages = {key: _engine_stage(5) for key in keys}
        for key in keys:
            _, k5, v5 = stages[key]
            assert cache.put(key, k5, v5)
        in_three_tiers(cache, keys)
        for key in keys:
            _, k5, v5 = stages[key]
            flat_k, flat_v = cache.read_group(key)
            assert torch.equal(flat_k, k5.reshape(L, 40, H, D)) and torch.equal(flat_v, v5.reshape(L, 40, H, D))
            out_stage, ok, ov = _engine_stage(5)
            out_stage.fill_(float("nan"))
            got = cache.read_group(key, out=(ok, ov))
            assert got[0] is ok and torch.equal(out_stage, stages[key][0])


def test_block_split_put_refuses_bad_blocks_and_changes_nothing(tmp_path):
    with TieredKVCache(cfg(tmp_path, disk=False)) as cache:
        key = cache.content_key("text", b"bad")
        before = cache.stats().counters.get("puts", 0)
        stage, k5, v5 = _engine_stage(5)
        stage[2, 3, 1, 4, D + 7] = float("inf")                 # one V value of one block
        with pytest.raises(DTypeError, match="NaN or Inf"):
            cache.put(key, k5, v5)
        wrong = torch.randn(L, 5, P + 1, H, D)                  # blocks that are not pages
        with pytest.raises(ShapeError):
            cache.put(key, wrong, wrong.clone())
        with pytest.raises(ShapeError):
            cache.put(key, k5[:, :0], v5[:, :0])
        assert not cache.contains(key) and cache.stats().counters.get("puts", 0) == before
        cache.put(key, *kv(37))                                  # partial last page: not block-split
        out_stage, ok, ov = _engine_stage(5)
        with pytest.raises(ShapeError):
            cache.read_group(key, out=(ok, ov))


# ---------------------------------------------------------------------------- disk put_many / get_many
def _tier_keys(spec, n):
    maker = KeyMaker("tiny-path", "s")
    return [maker.derive(modality="text", layout=spec.layout_fields(), media=hashlib.sha256(b"%d" % i).digest(),
                         tenant_salt=b"t" * 32) for i in range(n)]


@pytest.mark.parametrize("layout", ["standard", "legacy"])
def test_engine_blocks_put_and_read_back_from_every_tier(tmp_path, layout):
    """A group put straight from an engine's per-layer paged tensors (scattered blocks, vLLM's
    two layouts) reads back bitwise into another engine's blocks from each tier (the host read
    checked page by page), and equals the same tokens put as plain K/V."""
    from mmtier.engines.vllm import copy as vllm_copy
    from mmtier.pages.copies import EngineBlocks

    nb = 12

    def engine(fill):
        make = (lambda: torch.randn(nb, P, H, 2 * D).transpose(1, 2)) if layout == "standard" else \
            (lambda: torch.randn(2, nb, P, H, D))
        return [make() if fill else torch.full_like(make(), float("nan")) for _ in range(L)]
    src = engine(True)
    ids = [[7, 2, 3, 11, 0], [4, 5, 6, 1, 9], [10, 8, 3, 2, 1], [0, 1, 2, 3, 4], [11, 9, 7, 5, 3],
           [6, 8, 10, 0, 2]]
    with TieredKVCache(cfg(tmp_path)) as cache:
        keys = [cache.content_key("text", b"e%d" % i) for i in range(6)]
        for key, blocks in zip(keys, ids):
            assert cache.put(key, *(vllm_copy.engine_blocks(src, D, blocks),) * 2)
        in_three_tiers(cache, keys)
        for key, blocks in zip(keys, ids):
            k, v = cache.read_group(key)                   # the plain form: tokens in block order
            sk = torch.stack([torch.cat([vllm_copy.kv_views(t, D)[0][b] for b in blocks]) for t in src])
            sv = torch.stack([torch.cat([vllm_copy.kv_views(t, D)[1][b] for b in blocks]) for t in src])
            assert torch.equal(k, sk) and torch.equal(v, sv)
            dst = engine(False)
            back = [5, 6, 7, 0, 11]
            got = cache.read_group(key, out=vllm_copy.engine_blocks(dst, D, back))
            assert isinstance(got[0], EngineBlocks)
            for t_src, t_dst in zip(src, dst):
                ks, vs = vllm_copy.kv_views(t_src, D)
                kd, vd = vllm_copy.kv_views(t_dst, D)
                assert torch.equal(kd[back], ks[blocks]) and torch.equal(vd[back], vs[blocks])
                rest = [b for b in range(nb) if b not in back]
                assert torch.isnan(kd[rest]).all() and torch.isnan(vd[rest]).all()


def test_engine_blocks_bad_input_is_refused_and_changes_nothing(tmp_path):
    from mmtier.engines.vllm import copy as vllm_copy

    src = [torch.randn(8, P, H, 2 * D).transpose(1, 2) for _ in range(L)]
    with TieredKVCache(cfg(tmp_path, disk=False)) as cache:
        key = cache.content_key("text", b"bad")
        used = cache.pools["text"].num_used
        src[1].transpose(1, 2)[3, 2, 1, D + 4] = float("inf")        # a V value of block 3
        with pytest.raises(DTypeError):
            cache.put(key, *(vllm_copy.engine_blocks(src, D, [0, 3, 5]),) * 2)
        with pytest.raises(ShapeError):                              # blocks of another model
            cache.put(key, *(vllm_copy.engine_blocks(src[:2], D, [0, 1]),) * 2)
        with pytest.raises(ShapeError):
            vllm_copy.engine_blocks(src, D, [0, 0])
        assert not cache.contains(key) and cache.pools["text"].num_used == used
        big = [torch.full((8, P, H, 2 * D), 3e38).transpose(1, 2) for _ in range(L)]
        big[0].transpose(1, 2)[:, :, :, :D] *= -1                   # finite, but the sums overflow
        assert cache.put(key, *(vllm_copy.engine_blocks(big, D, [0, 1, 2, 4, 6]),) * 2)
        k, _ = cache.read_group(key)
        assert torch.isfinite(k).all() and (k[0] == -3e38).all()
        with pytest.raises(ShapeError):                              # 4 blocks for a 5-page group
            cache.read_group(key, out=vllm_copy.engine_blocks(src, D, [0, 1, 2, 4]))


def test_put_many_is_durable_and_get_many_reads_side_by_side(tmp_path):
    spec = cfg(tmp_path).spec("text")
    keys = _tier_keys(spec, 6)
    pages = [torch.randn(5, *spec.page_shape) for _ in keys]
    with DiskTier(tmp_path / "d", model="tiny-path", capacity_bytes=64 << 20) as disk:
        entries = disk.put_many([(k, spec, 40, p) for k, p in zip(keys, pages)])
        assert [e.key for e in entries] == keys and disk.stats()["writes"] == 6
        out = torch.full((30, *spec.page_shape), float("nan"))
        assert disk.get_many(keys, spec, "tiny-path", out, [5] * 6) == [True] * 6
        assert torch.equal(out, torch.cat(pages))
        assert disk.stats()["hits"] == 6
    with DiskTier(tmp_path / "d", model="tiny-path", capacity_bytes=64 << 20) as again:   # warm restart
        out = torch.full((30, *spec.page_shape), float("nan"))
        assert again.get_many(keys, spec, "tiny-path", out, [5] * 6) == [True] * 6   # full reads
        assert torch.equal(out, torch.cat(pages))


def test_put_many_raises_the_first_failure_after_writing_the_rest(tmp_path):
    spec = cfg(tmp_path).spec("text")
    keys = _tier_keys(spec, 3)
    pages = [torch.randn(5, *spec.page_shape) for _ in keys]
    budget = 2 * (5 * spec.page_bytes + 4096)
    with DiskTier(tmp_path / "d", model="tiny-path", capacity_bytes=budget) as disk:
        with pytest.raises(CapacityError):
            disk.put_many([(k, spec, 40, p) for k, p in zip(keys, pages)])
        held = [k for k in keys if disk.contains(k)]
        assert len(held) == 2
        for k in held:
            assert torch.equal(disk.get(k, spec, "tiny-path"), pages[keys.index(k)])


# ---------------------------------------------------------------------------- verified host reads
def _flip_slab_byte(entry, page=1):
    """Flip one byte of a page of a host entry, in the slab itself."""
    row = entry.slab_view[entry.slots[page]].view(-1).view(torch.uint8)
    row[row.numel() // 2] ^= 0xFF


def test_host_entry_checksum_mismatch_is_an_error_never_data(tmp_path):
    spec = cfg(tmp_path).spec("text")
    key = _tier_keys(spec, 1)[0]
    pages = torch.randn(5, *spec.page_shape)
    host = HostTier(8 << 20)
    entry = host.put(key, spec, 40, pages)
    assert len(entry.sums) == 5 and torch.equal(entry.gather(), pages)
    _flip_slab_byte(entry)
    with pytest.raises(CorruptDataError):
        entry.gather()
    with pytest.raises(CorruptDataError):
        entry.copy_to(torch.zeros(5, *spec.page_shape), range(5))
    assert host.stats()["corrupt_reads"] == 2
    # a spill of the corrupt copy writes nothing
    disk = DiskTier(tmp_path / "d", model="tiny-path", capacity_bytes=64 << 20)
    with Mover(host, disk, model="tiny-path", max_inflight_bytes=8 << 20) as mover:
        with pytest.raises(CorruptDataError):
            mover.spill(key, spec, 40).result(timeout=30)
    assert not disk.contains(key) and not list((tmp_path / "d").glob("*.arrow"))
    disk.close()
    host.close()


@pytest.mark.parametrize("page", [0, 3, 4])         # first, middle, last
def test_cache_host_copy_corrupted_is_a_miss_and_counted(tmp_path, page):
    # demote: the first groups are pushed down to the host by the later puts
    with TieredKVCache(cfg(tmp_path, disk=False, host_groups=4, put_placement="demote")) as cache:
        keys = [cache.content_key("text", b"g%d" % i) for i in range(3)]
        for key in keys:
            cache.put(key, *kv())
        g = cache.index.groups[keys[0]]
        assert g.tier == Tier.HOST
        assert list(g.location.sums) == g.location.page_sums()   # the digests the fused copy took
        _flip_slab_byte(g.location, page=page)
        out = poisoned()
        with pytest.raises(CorruptDataError):
            cache.read_group(keys[0], out=out)
        for t in out:                                      # not a byte of the bad page copied
            assert torch.isnan(t[:, page * P:]).all()
        c = cache.stats().counters
        assert c["host_corrupt_reads"] == 1 and c["corrupt_reads"] == 1
        assert not cache.contains(keys[0])                 # a miss from now on
        assert cache.lower.host.get(keys[0]) is None       # the bad copy is gone
        k, v = cache.read_group(keys[1])                   # the others are untouched
        assert k.shape == (L, 40, H, D)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("per_run", [1, 2, 5])
def test_cache_host_read_hands_out_only_verified_runs(tmp_path, monkeypatch, per_run, native):
    """Without the native helper, the host read checks pages in runs of ``CHECK_BYTES`` and
    copies a run only once all its pages matched: with page 3 bad, the runs before its run land
    (bitwise), nothing after. With it, the copy checks each page as it moves it: the pages
    before page 3 land, page 3's destination is poisoned, nothing after it is copied."""
    import mmtier.native.digests as native_digests
    import mmtier.storage.host_slabs as host_mod

    if native and not native_digests.available():
        pytest.skip("no C compiler here: the native verified copy is not built")
    if not native:
        monkeypatch.setattr(native_digests, "_fn", lambda: None)
    page_bytes = cfg(tmp_path).spec("text").page_bytes
    monkeypatch.setattr(host_mod, "CHECK_BYTES", per_run * page_bytes)
    # demote: the first groups are pushed down to the host by the later puts
    with TieredKVCache(cfg(tmp_path, disk=False, host_groups=4, put_placement="demote")) as cache:
        keys = [cache.content_key("text", b"g%d" % i) for i in range(4)]
        src = [kv() for _ in keys]
        for key, (k, v) in zip(keys, src):
            cache.put(key, k, v)
        assert cache.index.groups[keys[1]].tier == Tier.HOST
        out = poisoned()                                   # an intact group: every run, bitwise
        cache.read_group(keys[1], out=out)
        assert torch.equal(out[0], src[1][0]) and torch.equal(out[1], src[1][1])
        _flip_slab_byte(cache.index.groups[keys[0]].location, page=3)
        out = poisoned()
        with pytest.raises(CorruptDataError):
            cache.read_group(keys[0], out=out)
        landed = (3 if native else (3 // per_run) * per_run) * P   # the tokens before page 3 (or its run)
        for t, s in zip(out, src[0]):
            assert torch.equal(t[:, :landed], s[:, :landed])
            assert torch.isnan(t[:, landed:]).all()
        assert cache.stats().counters["host_corrupt_reads"] == 1 and not cache.contains(keys[0])


def test_cache_promotion_of_a_corrupted_host_copy_is_a_miss(tmp_path):
    # demote: the first groups are pushed down to the host by the later puts
    with TieredKVCache(cfg(tmp_path, disk=False, host_groups=4, put_placement="demote")) as cache:
        keys = [cache.content_key("text", b"g%d" % i) for i in range(3)]
        for key in keys:
            cache.put(key, *kv())
        _flip_slab_byte(cache.index.groups[keys[0]].location)
        seq = cache.create_sequence()
        with pytest.raises(Exception) as info:             # attach promotes it: the copy fails its check
            cache.attach(seq, keys[0])
        assert type(info.value).__name__ == "UnknownKeyError"
        assert cache.stats().counters["host_corrupt_reads"] == 1


def test_cache_spill_of_a_corrupted_host_copy_forgets_the_group_and_writes_no_file(tmp_path):
    """A host copy damaged before its background spill: the spill's verified read refuses it,
    the completion counts it, drops the host copy and forgets the group (a miss from now on);
    no file for it reaches the disk tier and the other groups come back bitwise. (Write-behind
    off: with it each group is on disk before its host copy is damaged, and its spill only drops
    the host copy, tests/cache/test_write_behind.py.)"""
    with TieredKVCache(cfg(tmp_path, device_groups=2, host_groups=2, write_behind=False)) as cache:
        keys = [cache.content_key("text", b"g%d" % i) for i in range(8)]
        src = {key: kv() for key in keys}
        for key in keys[:4]:
            cache.put(key, *src[key])
        cache.flush()
        damaged = [k for k in keys[:4] if cache.index.groups[k].tier == Tier.HOST]
        assert damaged
        for key in damaged:
            _flip_slab_byte(cache.index.groups[key].location)
        for key in keys[4:]:                               # pushes the host groups to disk
            cache.put(key, *src[key])
        cache.flush()
        c = cache.stats().counters
        assert c["host_corrupt_reads"] == len(damaged) == c["corrupt_reads"]
        assert c.get("spill_failures", 0) == 0
        on_disk = {p.name for p in (tmp_path / "spill").rglob("*.arrow")}
        spilled = [k for k in keys if k not in damaged and cache.index.groups[k].tier == Tier.DISK]
        assert spilled and len(on_disk) == len(spilled)     # one file per group on disk, by key
        assert all(any(k.hex in name for name in on_disk) for k in spilled)
        for key in damaged:
            assert not cache.contains(key) and cache.lower.host.get(key) is None
            assert not any(key.hex in name for name in on_disk)
        for key in keys:
            if key not in damaged:
                k, v = cache.read_group(key)
                assert torch.equal(k, src[key][0]) and torch.equal(v, src[key][1])


# ---------------------------------------------------------------------------- verified transfers
def test_transfer_checksum_mismatch_is_refused_and_counted(tmp_path):
    """A group exported (meta with one xxh3 per page) and imported elsewhere; one byte of the
    shipped buffer flipped: the import raises, counts, keeps nothing and frees its pages."""
    with TieredKVCache(cfg(tmp_path, disk=False)) as src, \
            TieredKVCache(cfg(tmp_path, disk=False, key_secret=src.cfg.key_secret)) as dst:
        key = src.content_key("text", b"shipped")
        k, v = kv()
        src.put(key, k, v)
        meta, buf = src.export_pages(key).to_wire()
        assert len(meta["xxh3"]) == 5
        bad = np.array(buf, copy=True)
        bad[bad.size // 3] ^= 0xFF
        used = dst.pools["text"].num_used
        with pytest.raises(CorruptDataError):
            dst.import_pages(key, GroupPages.from_wire(meta, bad))
        assert dst.stats().counters["transfer_corrupt_reads"] == 1
        assert not dst.holds([key])[0] and dst.pools["text"].num_used == used
        with pytest.raises(ShapeError):                    # no checksums: refused up front
            dst.import_pages(key, GroupPages.from_wire({"num_tokens": 40}, buf))
        assert dst.import_pages(key, GroupPages.from_wire(meta, buf))   # the intact buffer is stored
        k2, v2 = dst.read_group(key)
        assert torch.equal(k2, k) and torch.equal(v2, v)


def test_export_from_a_lower_tier_zeroes_the_last_page_past_the_group(tmp_path):
    """A 37-token group (5 pages, the last one 5 tokens): whatever its pages held before, the
    bytes an export ships past token 37 are zeros, and its checksums match what it ships."""
    with TieredKVCache(cfg(tmp_path, disk=False, host_groups=4)) as cache:
        for i in range(3):                               # the pool's pages get written first
            cache.put(cache.content_key("text", b"filler%d" % i), *kv(40))
        key = cache.content_key("text", b"short")
        cache.put(key, *kv(37))
        for i in range(3):                               # push it down to the host tier
            cache.put(cache.content_key("text", b"more%d" % i), *kv(40))
        assert cache.index.groups[key].tier == Tier.HOST
        meta, buf = cache.export_pages(key).to_wire()
        pages = torch.from_numpy(buf).view(torch.float32).view(5, L, 2, P, H, D)
        assert (pages[-1, :, :, 37 - 4 * P:] == 0).all()
        dst = TieredKVCache(cfg(tmp_path / "b", disk=False, key_secret=cache.cfg.key_secret))
        assert dst.import_pages(key, GroupPages.from_wire(meta, buf))   # the checksums are of what was shipped
        dst.close()


def test_transfer_from_host_and_disk_tiers_carries_checksums(tmp_path):
    with TieredKVCache(cfg(tmp_path)) as src, \
            TieredKVCache(cfg(tmp_path / "b", disk=False, key_secret=src.cfg.key_secret)) as dst:
        keys = [src.content_key("text", b"g%d" % i) for i in range(6)]
        data = {key: kv() for key in keys}
        for key in keys:
            src.put(key, *data[key])
        in_three_tiers(src, keys)
        where = {tier: next(k for k in keys if src.index.groups[k].tier == tier) for tier in (Tier.HOST, Tier.DISK)}
        for key in where.values():
            meta, buf = src.export_pages(key).to_wire()
            assert dst.import_pages(key, GroupPages.from_wire(meta, buf))
            k, v = dst.read_group(key)
            assert torch.equal(k, data[key][0]) and torch.equal(v, data[key][1])


# ---------------------------------------------------------------------------- the disk budget
def test_background_spills_side_by_side_respect_a_tight_disk_budget(tmp_path):
    """A disk budget of six groups and many puts: the background spills that run side by side
    make room for each other (the victims dropped first), so none is refused for budget, and
    every group still held reads back equal."""
    page = L * 2 * P * H * D * 4
    with TieredKVCache(cfg(tmp_path, host_groups=4, disk_bytes=6 * (5 * page + 4096))) as cache:
        data = {}
        for i in range(30):
            key = cache.content_key("text", b"g%d" % i)
            data[key] = kv()
            cache.put(key, *data[key])
        cache.flush()
        c = cache.stats().counters
        assert c.get("spill_failures", 0) == 0 and cache.lower.disk.stats()["budget_refusals"] == 0
        assert c["spills_to_disk"] > 6                   # the budget was the limit, many times over
        held = [k for k in data if cache.holds([k])[0]]
        assert len(held) >= 6
        for key in held:
            k, v = cache.read_group(key)
            assert torch.equal(k, data[key][0]) and torch.equal(v, data[key][1])


@pytest.mark.parametrize("layout", ["k|v last axis", "k, v halves", "separate"])
def test_paired_view_is_k_and_v_exactly_or_none(layout):
    from mmtier.pages.copies import paired_view
    if layout == "k|v last axis":
        t = torch.randn(L, 5, H, P, 2 * D).transpose(2, 3)
        k, v = t[..., :D], t[..., D:]
    elif layout == "k, v halves":
        t = torch.randn(L, 2, 5, P, H, D)
        k, v = t[:, 0], t[:, 1]
    else:
        k, v = torch.randn(L, 5, P, H, D), torch.randn(L, 5, P, H, D)
    both = paired_view(k, v)
    if layout == "separate":
        assert both is None and paired_view(v, k) is None
        return
    assert torch.equal(both[..., 0, :], k) and torch.equal(both[..., 1, :], v)
    assert paired_view(v, k) is None                # V before K: not this view
