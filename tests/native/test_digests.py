"""The verified copy (``mmtier.native.digests``): XXH3-64 taken by the copy that moves each page,
equal to python's ``xxhash`` on the same bytes, on the vector and the portable code; a digest
that differs stops the copy at that page and poisons its destination; and the host tier's
paths that use it (copy in, copy out into K/V of any layout, promotion) against the torch
paths, with fresh random inputs and poisoned destinations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from mmtier import CacheConfig, CorruptDataError, ModalitySpec, TieredKVCache
from mmtier.core.groups import Tier
from mmtier.native import digests as native_digests
from mmtier.native.rows import row_space
from mmtier.storage.page_digests import copy_out_verified, page_rows_of

pytestmark = pytest.mark.skipif(not native_digests.available(),
                                reason="no C compiler here: the native verified copy is not built "
                                       "(xxhash and torch run instead; covered by every other test)")


def addrs(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.data_ptr() + torch.arange(n, dtype=torch.int64) * (t.stride(0) * t.element_size())


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("nbytes", [256, 320, 1024, 1088, 2048, 16448, 65536, 3 << 20])
@pytest.mark.parametrize("row", [64, 256, None])
def test_the_digest_is_xxh3_of_the_bytes(scalar, nbytes, row):
    row = row or nbytes
    if nbytes % row:
        pytest.skip("rows must tile the unit")
    rng = np.random.default_rng(nbytes + row + scalar)
    src = torch.from_numpy(rng.integers(0, 256, (3, nbytes), dtype=np.uint8))
    dst = torch.zeros_like(src)
    space = ([nbytes // row], [row], [row], row) if row < nbytes else ([], [], [], row)
    res = native_digests.copy_digest(addrs(dst, 3), addrs(src, 3), space, scalar=scalar)
    assert res is not None and res.bad == -1
    assert res.digests == [xxhash.xxh3_64_intdigest(r.numpy().tobytes()) for r in src]
    assert torch.equal(dst, src)
    only = native_digests.copy_digest(None, addrs(src, 3), space, scalar=scalar)
    assert only.digests == res.digests


def test_short_units_and_odd_rows_are_left_to_the_caller():
    src = torch.zeros(2, 4096, dtype=torch.uint8)
    assert native_digests.copy_digest(None, addrs(src, 2), ([], [], [], 192)) is None     # <= 240 bytes
    assert native_digests.copy_digest(None, addrs(src, 2), ([32], [96], [96], 96)) is None  # 96-byte rows


@pytest.mark.parametrize("scalar", [False, True])
def test_a_layout_change_digests_each_source_page(scalar):
    """Pages ``[n, L, 2, P, H, D]`` into K and V ``[L, n * P, H, D]`` (two tensors): the copy
    walks each page in its own memory order, so its digest is the page's xxh3."""
    gen = torch.Generator().manual_seed(7)
    n, L, P, H, D = 4, 3, 16, 2, 64
    pages = torch.randn(n, L, 2, P, H, D, generator=gen).to(torch.bfloat16)
    k = torch.full((L, n * P, H, D), float("nan"), dtype=torch.bfloat16)
    v = torch.full_like(k, float("nan"))
    es = 2
    dims = [(L, k.stride(0) * es, pages.stride(1) * es), (2, v.data_ptr() - k.data_ptr(), pages.stride(2) * es),
            (P, k.stride(1) * es, pages.stride(3) * es), (H, k.stride(2) * es, pages.stride(4) * es)]
    from mmtier.native.rows import merge_dims
    space = merge_dims(dims, D * es)
    dst = k.data_ptr() + torch.arange(n, dtype=torch.int64) * (P * k.stride(1) * es)
    want = [xxhash.xxh3_64_intdigest(r) for r in page_rows_of(pages)]
    res = native_digests.copy_digest(dst, addrs(pages, n), space, expect=want, scalar=scalar)
    assert res.bad == -1 and res.digests == want
    assert torch.equal(k, pages[:, :, 0].transpose(0, 1).flatten(1, 2))
    assert torch.equal(v, pages[:, :, 1].transpose(0, 1).flatten(1, 2))


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("bad", [0, 2, 4])
def test_the_first_page_that_differs_stops_the_copy_and_is_poisoned(scalar, bad):
    rng = np.random.default_rng(bad)
    src = torch.from_numpy(rng.standard_normal((5, 512)).astype(np.float32))
    want = [xxhash.xxh3_64_intdigest(r) for r in page_rows_of(src)]
    src[bad, int(rng.integers(512))] += 1.0                       # one value of one page changed
    dst = torch.zeros_like(src)
    space = row_space(dst[0], src[0])
    res = native_digests.copy_digest(addrs(dst, 5), addrs(src, 5), space, expect=want, scalar=scalar)
    assert res.bad == bad
    assert torch.equal(dst[:bad], src[:bad])                     # verified pages landed
    assert dst[bad].isnan().all()                                # the bad one poisoned
    assert (dst[bad + 1:] == 0).all()                            # nothing after it copied


# ---------------------------------------------------------------------------- host tier
L, H, D, P = 2, 2, 32, 16          # float32 rows of 128 bytes, pages of 8 KiB


def cfg(host_groups=4):
    # demote: the host entries these tests read are made by the device-to-host copy (a demotion)
    spec = ModalitySpec(page_size=P)
    page = L * 2 * P * H * D * 4
    return CacheConfig(model="digests", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
                       modalities={"text": spec}, device="cpu", device_bytes=2 * 3 * page + 64,
                       host_bytes=host_groups * 3 * page, put_placement="demote")


def on_host(cache, n_tokens=40, groups=3):
    gen = torch.Generator().manual_seed(n_tokens)
    keys = [cache.content_key("text", b"g%d" % i) for i in range(groups)]
    src = [(torch.randn(L, n_tokens, H, D, generator=gen), torch.randn(L, n_tokens, H, D, generator=gen))
           for _ in keys]
    for key, (k, v) in zip(keys, src):
        cache.put(key, k, v)
    g = cache.index.groups[keys[0]]
    assert g.tier == Tier.HOST
    return keys, src, g.location


@pytest.mark.parametrize("n_tokens", [40, 48])     # a partial last page, whole pages
def test_host_digests_taken_by_the_copy_in_are_xxh3_and_reads_are_bitwise(n_tokens):
    with TieredKVCache(cfg()) as cache:
        keys, src, entry = on_host(cache, n_tokens)
        assert list(entry.sums) == entry.page_sums()               # xxh3 of what the slab holds
        out = (torch.full_like(src[0][0], float("nan")), torch.full_like(src[0][1], float("nan")))
        cache.read_group(keys[0], out=out)
        assert torch.equal(out[0], src[0][0]) and torch.equal(out[1], src[0][1])


def test_copy_out_into_block_split_and_interleaved_k_v():
    """Block-split destinations, K and V side by side in one buffer (an engine's stage)."""
    with TieredKVCache(cfg()) as cache:
        keys, src, entry = on_host(cache, 48)
        stage = torch.full((L, 3, H, P, 2 * D), float("nan"))
        k, v = stage[..., :D].transpose(2, 3), stage[..., D:].transpose(2, 3)
        assert copy_out_verified(entry, k, v)
        assert torch.equal(k.flatten(1, 2), src[0][0]) and torch.equal(v.flatten(1, 2), src[0][1])


def test_a_corrupt_partial_last_page_is_caught_too():
    with TieredKVCache(cfg()) as cache:
        keys, src, entry = on_host(cache, 40)
        row = page_rows_of(entry.runs()[-1][-1:])[0]
        row[5] ^= 0x10
        out = (torch.full_like(src[0][0], float("nan")), torch.full_like(src[0][1], float("nan")))
        with pytest.raises(CorruptDataError):
            cache.read_group(keys[0], out=out)
        assert torch.isnan(out[0][:, 32:]).all() and torch.isnan(out[1][:, 32:]).all()
        assert not cache.contains(keys[0])
        assert cache.stats().counters["host_corrupt_reads"] == 1


def test_promotion_checks_each_page_as_it_copies_it():
    """Attach promotes a host group into the device pool through the verified copy: intact, the
    pages arrive bitwise; a flipped byte makes it a miss and frees what was taken."""
    with TieredKVCache(cfg()) as cache:
        keys, src, entry = on_host(cache, 48)
        seq = cache.create_sequence()
        cache.attach(seq, keys[0])
        assert cache.index.groups[keys[0]].tier == Tier.DEVICE
        k, v = cache.read_group(keys[0])
        assert torch.equal(k, src[0][0]) and torch.equal(v, src[0][1])
        second = cache.index.groups[keys[1]]
        if second.tier != Tier.HOST:
            pytest.skip("the second group was not left on the host by this pool's room")
        page_rows_of(second.location.runs()[0][:1])[0][100] ^= 0x01
        with pytest.raises(Exception):                       # noqa: B017 - the miss's type is the cache's
            cache.attach(cache.create_sequence(), keys[1])
        assert not cache.contains(keys[1])


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_checked_copy_flags_each_non_finite_value_and_no_finite_extreme(dtype, scalar):
    """The finiteness scan taken in the copy (``check``), at values and places a vector test can
    get wrong: the first and last element of a unit, a stripe's lanes either side of a scramble,
    the unit's last stripe (its own key); finite extremes (max, -max, the smallest subnormal)
    never flagged; digests and bytes as the plain copy's in every case."""
    from mmtier.native.rows import CHECK_KINDS
    gen = torch.Generator().manual_seed(23)
    n = 4096                                          # 8-16 KiB units: several scrambles each
    fi = torch.finfo(dtype)
    src = torch.randn(3, n, generator=gen).to(dtype)
    src[0, :7] = fi.max
    src[1, 100:103] = -fi.max
    src[2, -5:] = torch.tensor(fi.tiny / 8, dtype=dtype)
    row = n * src.element_size()
    offs = torch.arange(3, dtype=torch.int64) * row

    def copy(s: torch.Tensor):
        dst = torch.full_like(s, float("nan"))
        res = native_digests.copy_digest(dst.data_ptr() + offs, s.data_ptr() + offs, ([], [], [], row),
                                         check=CHECK_KINDS[dtype], scalar=scalar)
        assert torch.equal(dst.view(torch.uint8), s.view(torch.uint8))
        assert res.digests == [xxhash.xxh3_64_intdigest(r) for r in s.view(torch.uint8).numpy()]
        return res

    assert not copy(src).nonfinite
    stripe = 64 // src.element_size()
    places = [(0, 0), (2, n - 1), (1, 16 * stripe - 1), (1, 16 * stripe), (2, n - stripe), (0, 5 * stripe + 3)]
    for (u, i), value in zip(places, [float("nan"), float("inf"), float("-inf"), -float("nan"),
                                      float("inf"), float("nan")]):
        bad = src.clone()
        bad[u, i] = value
        assert copy(bad).nonfinite, (u, i, value)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_a_copy_split_over_threads_gives_the_one_thread_result(threads):
    """A copy without ``expect`` split over ``threads`` (runs of at least 4 MiB of units, the
    last run shorter where the units do not divide): every byte, every digest and the
    finiteness flag as one thread's, and a NaN in the last unit (the last thread's run) found."""
    from mmtier.native.rows import CHECK_KINDS
    gen = torch.Generator().manual_seed(threads)
    units, n = 23, 1 << 20                          # 2 MiB units: 46 MiB, up to 11 runs
    src = torch.randn(units, n, generator=gen).to(torch.bfloat16)
    row = n * src.element_size()
    offs = torch.arange(units, dtype=torch.int64) * row
    want = [xxhash.xxh3_64_intdigest(r) for r in src.view(torch.uint8).numpy()]

    def copy(s: torch.Tensor, t: int):
        dst = torch.full_like(s, float("nan"))
        res = native_digests.copy_digest(dst.data_ptr() + offs, s.data_ptr() + offs, ([], [], [], row),
                                         check=CHECK_KINDS[torch.bfloat16], threads=t)
        assert torch.equal(dst.view(torch.uint8), s.view(torch.uint8))
        return res

    one, split = copy(src, 1), copy(src, threads)
    assert split.digests == one.digests == want and split.bad == -1 and not split.nonfinite
    bad = src.clone()
    bad[-1, n - 1] = float("nan")
    assert copy(bad, threads).nonfinite
    plain = native_digests.copy_digest(None, src.data_ptr() + offs, ([], [], [], row), threads=threads)
    assert plain.digests == want                    # digests only: one thread, the same digests
