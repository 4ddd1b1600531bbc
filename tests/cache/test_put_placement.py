"""Where a put lands when its device pool is full (``CacheConfig.put_placement``,
``tiers.placement``): written around the device straight into the host tier in one copy, or
pushing the policy's victims down first (``demote``); ``auto``, the default, writes around a CPU
pool. Tiny pools, fresh random
K/V, exact bytes back, the device pool's bytes compared before and after (a put written around
never touches them), digests and NaN / Inf checks taken by the one copy, nothing lost when the
host tier overflows to disk; and ``read_group`` without ``out=`` returns pooled memory."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import xxhash

from mmtier import CacheConfig, DTypeError, ModalitySpec, TieredKVCache
from mmtier.errors import ConfigError, CorruptDataError
from mmtier.native import digests as native_digests
from mmtier.native import rows as native_rows
from mmtier.storage.page_digests import kv_in_digested, page_rows_of
from mmtier.storage.staging import LEND_MIN_BYTES

L, H, D, P = 2, 2, 64, 16
N = 64                                          # tokens per group: 4 pages
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def group_bytes(dtype: torch.dtype, n: int = N) -> int:
    return -(-n // P) * L * 2 * P * H * D * torch.empty((), dtype=dtype).element_size()


def cfg(placement: str, *, dtype=torch.float32, device_groups=2, host_groups=8, disk_dir=None,
        policy="lru") -> CacheConfig:
    gb = group_bytes(dtype)
    return CacheConfig(model="placement", num_layers=L, num_kv_heads=H, head_dim=D,
                       dtype=str(dtype).removeprefix("torch."), modalities={"text": ModalitySpec(page_size=P)},
                       device="cpu", device_bytes=device_groups * gb, host_bytes=host_groups * gb,
                       disk_dir=disk_dir, put_placement=placement, eviction_policy=policy,
                       persist_on_close=False)


def kv(gen: torch.Generator, dtype=torch.float32, n: int = N):
    return (torch.randn(L, n, H, D, generator=gen).to(dtype), torch.randn(L, n, H, D, generator=gen).to(dtype))


def tiers(cache: TieredKVCache) -> dict:
    return {key: tier for key, tier, _ in cache.inventory()}


def assert_exact(cache: TieredKVCache, key, want) -> None:
    k, v = cache.read_group(key)
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_put_into_a_full_pool_is_written_around_to_the_host_in_one_copy(dtype):
    gen = torch.Generator().manual_seed(1)
    with TieredKVCache(cfg("write_around", dtype=dtype)) as cache:
        data = {cache.content_key("text", b"g%d" % i): kv(gen, dtype) for i in range(5)}
        keys = list(data)
        for key in keys[:2]:
            assert cache.put(key, *data[key])
        device_bytes = cache.pools["text"].view.clone()          # what the pool holds now
        for key in keys[2:]:
            assert cache.put(key, *data[key])
        assert tiers(cache) == {**{k: "device" for k in keys[:2]}, **{k: "host" for k in keys[2:]}}
        # the device pool was never written (no demotion, no page of the new groups)
        assert torch.equal(cache.pools["text"].view.view(torch.uint8), device_bytes.view(torch.uint8))
        c = cache.stats().counters
        assert c.get("spills_to_host", 0) == 0 and c.get("spills", 0) == 0
        assert c["puts_written_around"] == 3 and c["puts"] == 5
        host = cache.lower.host
        assert host.used_bytes == 3 * group_bytes(dtype) and host.stats()["puts"] == 3
        for key in keys[2:]:                    # the digests are the pages' own, taken by the copy
            entry = cache.index.get(key).location
            assert entry.sums == tuple(entry.page_sums())
        for key in keys:
            assert_exact(cache, key, data[key])


def test_demote_pushes_the_oldest_down_and_auto_writes_around_a_cpu_pool():
    gen = torch.Generator().manual_seed(2)
    placed = {}
    for placement in ("demote", "auto"):
        with TieredKVCache(cfg(placement)) as cache:
            data = {cache.content_key("text", b"g%d" % i): kv(gen) for i in range(4)}
            keys = list(data)
            for key in keys:
                assert cache.put(key, *data[key])
            placed[placement] = [tiers(cache)[k] for k in keys]
            c = cache.stats().counters
            placed[placement + "_spills"] = c.get("spills_to_host", 0)
            placed[placement + "_around"] = c.get("puts_written_around", 0)
            for key in keys:
                assert_exact(cache, key, data[key])
    assert placed["demote"] == ["host", "host", "device", "device"]      # the newest on the device
    assert placed["demote_spills"] == 2 and placed["demote_around"] == 0
    assert placed["auto"] == ["device", "device", "host", "host"]        # same memory: one copy
    assert placed["auto_spills"] == 0 and placed["auto_around"] == 2


def test_the_default_is_auto_and_a_wrong_placement_is_a_config_error():
    c = CacheConfig(model="m", num_layers=1, num_kv_heads=1, head_dim=8, modalities={"text": ModalitySpec(page_size=16)},
                    device="cpu", device_bytes=1 << 20)
    assert c.put_placement == "auto"
    with pytest.raises(ConfigError, match="put_placement"):
        CacheConfig(model="m", num_layers=1, num_kv_heads=1, head_dim=8, modalities={"text": ModalitySpec(page_size=16)},
                    device="cpu", device_bytes=1 << 20, put_placement="sideways")


def test_a_cache_with_default_settings_writes_around_its_full_cpu_pool():
    gen = torch.Generator().manual_seed(9)
    base = cfg("auto").model_dump(exclude={"put_placement"})
    default = CacheConfig(**base)                   # put_placement not named: the default
    assert "put_placement" not in default.model_fields_set
    with TieredKVCache(default) as cache:
        data = {cache.content_key("text", b"d%d" % i): kv(gen) for i in range(4)}
        keys = list(data)
        for key in keys[:2]:
            assert cache.put(key, *data[key])
        device_bytes = cache.pools["text"].view.clone()
        for key in keys[2:]:
            assert cache.put(key, *data[key])
        assert [tiers(cache)[k] for k in keys] == ["device", "device", "host", "host"]
        assert torch.equal(cache.pools["text"].view.view(torch.uint8), device_bytes.view(torch.uint8))
        c = cache.stats().counters
        assert c["puts_written_around"] == 2 and c.get("spills_to_host", 0) == 0
        for key in keys:
            assert_exact(cache, key, data[key])


def test_without_a_host_tier_a_put_still_makes_room_on_the_device():
    gen = torch.Generator().manual_seed(3)
    c = cfg("write_around", host_groups=0)
    with TieredKVCache(c) as cache:
        keys = [cache.content_key("text", b"g%d" % i) for i in range(3)]
        data = [kv(gen) for _ in keys]
        for key, d in zip(keys, data):
            assert cache.put(key, *d)
        assert tiers(cache) == {keys[1]: "device", keys[2]: "device"}   # the oldest dropped (LRU)
        assert cache.stats().counters.get("puts_written_around", 0) == 0
        assert_exact(cache, keys[2], data[2])


@pytest.mark.parametrize("n", [N, 37, 5])
def test_partial_last_pages_and_attention_over_a_group_written_around(n):
    gen = torch.Generator().manual_seed(40 + n)
    with TieredKVCache(cfg("write_around", device_groups=1)) as cache:
        filler = cache.content_key("text", b"filler")
        assert cache.put(filler, *kv(gen))
        key = cache.content_key("text", b"img")
        k, v = kv(gen, n=n)
        assert cache.put(key, k, v)
        assert tiers(cache)[key] == "host"
        assert_exact(cache, key, (k, v))
        seq = cache.create_sequence()
        cache.attach(seq, key)
        q = torch.randn(3, 2 * H, D, generator=gen)
        out = cache.attention(seq, 1, q, causal=False)
        kk = k[1].double().repeat_interleave(2, dim=1)            # GQA: 2 query heads per KV head
        vv = v[1].double().repeat_interleave(2, dim=1)
        w = torch.softmax(torch.einsum("qhd,khd->hqk", q.double(), kk) * D ** -0.5, dim=-1)
        want = torch.einsum("hqk,khd->qhd", w, vv)
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
        cache.release(seq)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_payload_that_is_not_finite_is_refused_by_the_copy_and_changes_nothing(dtype, value):
    gen = torch.Generator().manual_seed(5)
    with TieredKVCache(cfg("write_around", dtype=dtype, device_groups=1)) as cache:
        assert cache.put(cache.content_key("text", b"filler"), *kv(gen, dtype))
        host = cache.lower.host
        used, inventory = host.used_bytes, sorted(map(repr, cache.inventory()))
        for n, at in ((N, (1, 50, 1, 63)), (37, (0, 36, 0, 0))):    # whole pages; the partial page
            k, v = kv(gen, dtype, n)
            v[at] = value
            key = cache.content_key("text", b"bad%d" % n)
            with pytest.raises(DTypeError, match="NaN or Inf"):
                cache.put(key, k, v)
            assert not cache.holds([key])[0]
            assert host.used_bytes == used and sorted(map(repr, cache.inventory())) == inventory
        good = kv(gen, dtype)
        key = cache.content_key("text", b"bad%d" % N)                # the key is still free to store
        assert cache.put(key, *good)
        assert_exact(cache, key, good)


def test_block_split_puts_are_written_around_too():
    gen = torch.Generator().manual_seed(6)
    with TieredKVCache(cfg("write_around", device_groups=1)) as cache:
        assert cache.put(cache.content_key("text", b"filler"), *kv(gen))
        k, v = kv(gen)
        key = cache.content_key("text", b"blocks")
        # an engine's blocks, K and V side by side in one stage ([L, blocks, P, H, 2, D])
        stage = torch.stack([k, v], dim=-2).view(L, N // P, P, H, 2, D)
        assert cache.put(key, stage[..., 0, :], stage[..., 1, :])
        assert tiers(cache)[key] == "host"
        entry = cache.index.get(key).location
        assert entry.sums == tuple(entry.page_sums())
        assert_exact(cache, key, (k, v))


def test_a_flipped_byte_in_a_group_written_around_is_a_miss_and_counted():
    gen = torch.Generator().manual_seed(7)
    with TieredKVCache(cfg("write_around", device_groups=1)) as cache:
        assert cache.put(cache.content_key("text", b"filler"), *kv(gen))
        key = cache.content_key("text", b"victim")
        assert cache.put(key, *kv(gen))
        entry = cache.index.get(key).location
        slab = cache.lower.host.slab_view(entry.spec)
        slab[entry.slots[2]].view(torch.uint8).view(-1)[1234] ^= 0x10
        with pytest.raises(CorruptDataError):
            cache.read_group(key)
        assert not cache.holds([key])[0]
        assert cache.stats().counters["host_corrupt_reads"] == 1


@pytest.mark.parametrize("policy", ["lru", "adaptive_slru"])
def test_nothing_is_lost_when_puts_written_around_overflow_the_host_to_disk(tmp_path, policy):
    gen = torch.Generator().manual_seed(8)
    c = cfg("write_around", device_groups=2, host_groups=3, disk_dir=str(tmp_path / "disk"), policy=policy)
    with TieredKVCache(c) as cache:
        data = {cache.content_key("text", b"g%d" % i): kv(gen) for i in range(12)}
        for key, d in data.items():
            assert cache.put(key, *d)
        cache.flush()
        where = tiers(cache)
        assert set(where) == set(data)                              # every group still held
        assert sorted(where.values()).count("device") == 2
        assert "disk" in where.values()
        c = cache.stats().counters
        assert c.get("evictions", 0) == 0 and c["puts_written_around"] == 10
        assert cache.lower.host.used_bytes <= 3 * group_bytes(torch.float32)
        for key, d in data.items():
            assert_exact(cache, key, d)


def test_two_threads_putting_one_key_store_it_once():
    gen = torch.Generator().manual_seed(9)
    with TieredKVCache(cfg("write_around", device_groups=1)) as cache:
        assert cache.put(cache.content_key("text", b"filler"), *kv(gen))
        key = cache.content_key("text", b"both")
        d = kv(gen)
        results: list[bool] = []
        start = threading.Barrier(2)

        def put() -> None:
            start.wait()
            results.append(cache.put(key, *d))

        threads = [threading.Thread(target=put) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sorted(results) == [False, True]
        assert cache.lower.host.used_bytes == group_bytes(torch.float32)
        assert_exact(cache, key, d)


def test_read_group_without_out_returns_pooled_memory_of_its_own():
    gen = torch.Generator().manual_seed(10)
    n = 2048                                    # a group of 8 MiB (float32): lent, not allocated
    c = CacheConfig(model="placement", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
                    modalities={"text": ModalitySpec(page_size=P)}, device="cpu",
                    device_bytes=group_bytes(torch.float32, n), host_bytes=4 * group_bytes(torch.float32, n),
                    put_placement="write_around", persist_on_close=False)
    with TieredKVCache(c) as cache:
        data = {cache.content_key("text", b"g%d" % i): kv(gen, n=n) for i in range(3)}
        for key, d in data.items():
            assert cache.put(key, *d)
        staging = cache.lower.staging
        keys = list(data)
        k0, v0 = cache.read_group(keys[1])      # from the host tier
        k1, v1 = cache.read_group(keys[0])      # from the device
        assert k0.nbytes >= LEND_MIN_BYTES
        for t in (k0, v0, k1, v1):              # each its own storage, exactly its bytes
            assert t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes
        assert len({t.data_ptr() for t in (k0, v0, k1, v1)}) == 4
        assert torch.equal(k0, data[keys[1]][0]) and torch.equal(v0, data[keys[1]][1])
        assert torch.equal(k1, data[keys[0]][0]) and torch.equal(v1, data[keys[0]][1])
        view = k0[1, 3:9]                       # a view keeps the memory from coming back
        ptr = k0.data_ptr()
        del k0
        gc.collect()
        reused = staging.reused
        k2, v2 = cache.read_group(keys[2])
        assert ptr not in (k2.data_ptr(), v2.data_ptr())
        assert torch.equal(view, data[keys[1]][0][1, 3:9])
        del view, v0, k1, v1, k2, v2
        gc.collect()
        k3, v3 = cache.read_group(keys[1])      # the memory given back is lent again
        assert staging.reused >= reused + 2
        assert torch.equal(k3, data[keys[1]][0]) and torch.equal(v3, data[keys[1]][1])


@pytest.mark.skipif(not native_digests.available(), reason="no C compiler here: the native helper is not built")
@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_native_copy_takes_page_digests_and_finds_non_finite_values(dtype, scalar):
    gen = torch.Generator().manual_seed(11)
    es = torch.empty((), dtype=dtype).element_size()
    slab = torch.full((8, L, 2, P, H, D), 3.0, dtype=dtype)
    slots = [5, 1, 6]
    k, v = kv(gen, dtype, 40)                    # two whole pages and a partial one
    tally = native_rows.Tally()
    sums = kv_in_digested(slab, slots, k, v, tally)
    assert sums == [xxhash.xxh3_64_intdigest(page_rows_of(slab[s][None])[0]) for s in slots]
    assert tally.complete and not tally.nonfinite
    for i, s in enumerate(slots):
        got = slab[s].transpose(0, 1)            # [2, L, P, H, D]
        m = min(P, 40 - i * P)
        assert torch.equal(got[0, :, :m], k[:, i * P:i * P + m]) and torch.equal(got[1, :, :m], v[:, i * P:i * P + m])
    # the checked copy itself, on the portable path and the vector one, at a non-finite value
    # in the last row of the last unit
    src = torch.randn(4, 1024, generator=gen).to(dtype)
    src[3, 1023] = float("nan")
    dst = torch.empty_like(src)
    row = 1024 * es
    addrs = (torch.arange(4, dtype=torch.int64) * row)
    res = native_digests.copy_digest(dst.data_ptr() + addrs, src.data_ptr() + addrs, ([], [], [], row),
                                     check=native_rows.CHECK_KINDS[dtype], scalar=scalar)
    assert res.nonfinite and torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    assert res.digests == [xxhash.xxh3_64_intdigest(r) for r in src.view(torch.uint8).numpy()]
    src[3, 1023] = 1.0
    res = native_digests.copy_digest(dst.data_ptr() + addrs, src.data_ptr() + addrs, ([], [], [], row),
                                     check=native_rows.CHECK_KINDS[dtype], scalar=scalar)
    assert not res.nonfinite


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the 'auto' rule for a GPU pool")
def test_auto_on_a_gpu_pool_writes_around_only_when_the_room_would_take_running_groups():
    gen = torch.Generator().manual_seed(12)
    gb = group_bytes(torch.float32)
    c = CacheConfig(model="placement", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
                    modalities={"text": ModalitySpec(page_size=P)}, device="cuda:0", device_bytes=2 * gb,
                    host_bytes=8 * gb, put_placement="auto", eviction_policy="lru", persist_on_close=False)
    with TieredKVCache(c) as cache:
        data = {cache.content_key("text", b"g%d" % i): kv(gen) for i in range(4)}
        keys = list(data)
        for key in keys[:2]:
            assert cache.put(key, *(t.cuda() for t in data[key]))
        seq = cache.create_sequence()
        for key in keys[:2]:
            cache.attach(seq, key)              # both device groups serve a running sequence
        assert cache.put(keys[2], *(t.cuda() for t in data[keys[2]]))
        assert tiers(cache)[keys[2]] == "host"  # written around: the room would demote them
        cache.release(seq)
        assert cache.put(keys[3], *(t.cuda() for t in data[keys[3]]))
        where = tiers(cache)
        assert where[keys[3]] == "device" and where[keys[0]] == "host"     # made room: LRU demoted
        c = cache.stats().counters
        assert c["puts_written_around"] == 1 and c["spills_to_host"] == 1
        for key in keys:
            k, v = cache.read_group(key)
            assert torch.equal(k, data[key][0]) and torch.equal(v, data[key][1])
