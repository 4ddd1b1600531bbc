"""The C row copy (``mmtier.native.rows``) against torch's own copy: every layout the data path
hands it, both store paths (streaming and ``memcpy``), the NaN / Inf test fused into it, and
the cache's paths that use it (a put's refusal, ``EngineBlocks`` both ways) with the helper on
and off. Destinations are poisoned first; inputs are fresh random values."""

from __future__ import annotations

import pytest
import torch

from mmtier import CacheConfig, DTypeError, ModalitySpec, TieredKVCache
from mmtier.native import build
from mmtier.native import rows as native_rows
from mmtier.pages.copies import EngineBlocks, pages_into_kv

pytestmark = pytest.mark.skipif(not native_rows.available(),
                                reason="no C compiler here: the native row copy is not built "
                                       "(the torch path runs instead; covered by every other test)")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype)


def poisoned_like(shape, dtype, order=None):
    t = torch.full(shape, float("nan"), dtype=dtype)
    return t if order is None else t.permute(*order)


@pytest.fixture
def no_native(monkeypatch):
    """The helper switched off for one test: the callers take their torch paths."""
    monkeypatch.setattr(native_rows, "_fn", lambda: None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("head_dim", [128, 40, 64])
def test_a_layout_change_equals_torchs_copy(dtype, stream, head_dim):
    """Pages ``[n, L, 2, P, H, D]`` into vLLM-like blocks ``[n, H, P, 2, D]`` of one layer, and
    back: bitwise torch's result, rows of 80 bytes (no streaming store fits) to 512."""
    gen = torch.Generator().manual_seed(head_dim * 7 + stream)
    n, L, P, H = 5, 3, 16, 4
    pages = rand((n, L, 2, P, H, head_dim), dtype, gen)
    layer = 1
    src = pages[:, layer].permute(0, 2, 3, 1, 4)                   # [n, P, H, 2, D]
    dst = poisoned_like((n, H, P, 2, head_dim), dtype).permute(0, 2, 1, 3, 4)
    want = torch.empty_like(dst).copy_(src)
    assert native_rows.copy_view(dst, src, stream=stream, tally=native_rows.Tally())
    assert torch.equal(dst, want)
    back = poisoned_like((n, L, 2, P, H, head_dim), dtype)
    assert native_rows.copy_view(back[:, layer].permute(0, 2, 3, 1, 4), dst, stream=stream,
                                 tally=native_rows.Tally())
    assert torch.equal(back[:, layer], pages[:, layer])
    assert back[:, 0].isnan().all() and back[:, 2].isnan().all()   # nothing else written


def test_units_at_scattered_addresses_copy_each_unit_and_nothing_else():
    gen = torch.Generator().manual_seed(11)
    blocks = rand((12, 4, 16, 256), torch.bfloat16, gen)          # 12 blocks of [H, P, 2D]
    stage = poisoned_like((5, 4, 16, 256), torch.bfloat16)
    ids = [7, 2, 9, 0, 11]
    es = blocks.element_size()
    src = blocks.data_ptr() + torch.tensor(ids) * blocks.stride(0) * es
    dst = stage.data_ptr() + torch.arange(5) * stage.stride(0) * es
    assert native_rows.copy_units(dst, src, stage[0], blocks[0], stream=True)
    assert torch.equal(stage, blocks[ids])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -float("nan")])
def test_the_fused_test_finds_one_non_finite_value_anywhere(dtype, stream, value):
    gen = torch.Generator().manual_seed(hash((str(dtype), stream, str(value))) & 0xFFFF)
    src = rand((6, 16, 4, 128), dtype, gen).transpose(1, 2)
    clean = native_rows.Tally()
    dst = poisoned_like((6, 4, 16, 128), dtype)
    assert native_rows.copy_view(dst, src, stream=stream, tally=clean)
    assert clean.complete and not clean.nonfinite
    assert torch.equal(dst, src)
    at = tuple(int(torch.randint(s, (1,), generator=gen)) for s in src.shape)
    src[at] = value
    bad = native_rows.Tally()
    assert native_rows.copy_view(dst, src, stream=stream, tally=bad)
    assert bad.complete and bad.nonfinite
    # the largest finite values and subnormals are finite
    big = torch.full((4, 16, 128), torch.finfo(dtype).max, dtype=dtype)
    big[1] = -torch.finfo(dtype).max
    big[2] = torch.finfo(dtype).tiny / 4
    ok = native_rows.Tally()
    assert native_rows.copy_view(torch.empty_like(big), big, stream=stream, tally=ok)
    assert ok.complete and not ok.nonfinite


def test_what_it_cannot_copy_it_leaves_alone():
    """Other dtypes on each side, a strided innermost axis: ``False`` and the destination as it
    was (the caller's torch copy then runs); an unchecked dtype counts as unchecked."""
    gen = torch.Generator().manual_seed(5)
    src = rand((64, 8, 128), torch.float32, gen)
    dst = poisoned_like((64, 8, 128), torch.float16)
    assert not native_rows.copy_view(dst, src, tally=native_rows.Tally())
    assert dst.isnan().all()
    wide = poisoned_like((64, 8, 256), torch.float32)[..., ::2]
    assert not native_rows.copy_view(wide, src, tally=native_rows.Tally())
    assert wide.isnan().all()
    ints = torch.randint(0, 100, (64, 8, 128), generator=gen, dtype=torch.int32)
    out = torch.zeros_like(ints)
    tally = native_rows.Tally()
    assert native_rows.copy_view(out, ints, tally=tally)
    assert torch.equal(out, ints) and not tally.complete and tally.unchecked == 1


def test_without_a_compiler_library_is_none_and_nothing_is_cached(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setenv("MMTIER_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_compiler", lambda: None)
    assert build.library("rows") is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setenv("MMTIER_NATIVE", "0")
    assert build.library("rows") is None


def test_a_fresh_build_lands_whole_in_its_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setenv("MMTIER_NATIVE_CACHE", str(tmp_path))
    lib = build.library("rows")
    assert lib is not None and hasattr(lib, "mmtier_copy_rows")
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("librows-") and files[0].suffix == ".so"


# ---------------------------------------------------------------------------- through the cache
L, H, D, P = 2, 4, 128, 16


def engine_layers(gen, dtype, num_blocks=10):
    """Per-layer tensors as vLLM's CPU layout: ``[blocks, H, P, 2D]``, K|V per head."""
    return [rand((num_blocks, H, P, 2 * D), dtype, gen) for _ in range(L)]


def kv_views(t):
    return t[..., :D].transpose(1, 2), t[..., D:].transpose(1, 2)


def cache_cfg(dtype: str):
    return CacheConfig(model="native", num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype,
                       modalities={"text": ModalitySpec(page_size=P)}, device="cpu", device_bytes=32 << 20)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_blocks_round_trip_with_and_without_the_helper(native, dtype, monkeypatch):
    if not native:
        monkeypatch.setattr(native_rows, "_fn", lambda: None)
    gen = torch.Generator().manual_seed(3 + native)
    tdt = getattr(torch, dtype)
    layers = engine_layers(gen, tdt)
    ids = [6, 1, 2, 9]
    with TieredKVCache(cache_cfg(dtype)) as cache:
        key = cache.content_key("text", b"blocks")
        blocks = EngineBlocks([kv_views(t) for t in layers], ids)
        assert cache.put(key, blocks, blocks)
        k, v = cache.read_group(key)
        for layer, t in enumerate(layers):
            kk, vv = kv_views(t)
            assert torch.equal(k[layer], kk[ids].flatten(0, 1))
            assert torch.equal(v[layer], vv[ids].flatten(0, 1))
        out = [torch.full_like(t, float("nan")) for t in layers]
        dest = EngineBlocks([kv_views(t) for t in out], [3, 0, 8, 5])
        cache.read_group(key, out=dest)
        for t, o in zip(layers, out):
            assert torch.equal(o[[3, 0, 8, 5]], t[ids])
            assert o[[1, 2, 4, 6, 7, 9]].isnan().all()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("as_blocks", [True, False])
def test_a_put_with_a_nan_is_refused_by_either_check(native, as_blocks, monkeypatch):
    """The fused test (helper on) and the scan beside the copy (helper off) refuse alike: a
    ``DTypeError``, the pages freed, nothing recorded; the next put of the key works."""
    if not native:
        monkeypatch.setattr(native_rows, "_fn", lambda: None)
    gen = torch.Generator().manual_seed(17 + 2 * native + as_blocks)
    layers = engine_layers(gen, torch.bfloat16)
    ids = [4, 7, 0]
    with TieredKVCache(cache_cfg("bfloat16")) as cache:
        pool = cache.pools["text"]
        free = pool.num_free
        key = cache.content_key("text", b"nan")
        layers[1][ids[2], 3, 5, D + 17] = float("nan")               # one V element of one block
        if as_blocks:
            payload = (EngineBlocks([kv_views(t) for t in layers], ids),) * 2
        else:
            k = torch.stack([kv_views(t)[0][ids].flatten(0, 1) for t in layers])
            v = torch.stack([kv_views(t)[1][ids].flatten(0, 1) for t in layers])
            payload = (k, v)
        with pytest.raises(DTypeError, match="NaN or Inf"):
            cache.put(key, *payload)
        assert pool.num_free == free and not cache.contains(key)
        layers[1][ids[2], 3, 5, D + 17] = 1.0
        blocks = EngineBlocks([kv_views(t) for t in layers], ids)
        assert cache.put(key, blocks, blocks)


def test_the_fused_path_is_the_one_a_cpu_put_takes(monkeypatch):
    """With the helper, a put of CPU tensors into CPU pages starts no scan beside its copy."""
    import mmtier.pages.payload as payload

    started = []
    real = payload.beside
    monkeypatch.setattr(payload, "beside", lambda fn, *a: started.append(fn) or real(fn, *a))
    gen = torch.Generator().manual_seed(23)
    with TieredKVCache(cache_cfg("float32")) as cache:
        k, v = rand((L, 40, H, D), torch.float32, gen), rand((L, 40, H, D), torch.float32, gen)
        assert cache.put(cache.content_key("text", b"fused"), k, v)
        out = (torch.full_like(k, float("nan")), torch.full_like(v, float("nan")))
        cache.read_group(cache.content_key("text", b"fused"), out=out)
        assert torch.equal(out[0], k) and torch.equal(out[1], v)
    assert started == []


def test_pages_into_block_split_tensors_with_the_helper_equal_torch(no_native):
    """The staged load's copy (``pages_into_kv`` into block-split views) by torch, as the
    reference for the same copy with the helper on (the next test)."""
    gen = torch.Generator().manual_seed(29)
    pages = rand((4, L, 2, P, H, D), torch.float16, gen)
    out_k = poisoned_like((L, 4, P, H, D), torch.float16)
    out_v = poisoned_like((L, 4, P, H, D), torch.float16)
    pages_into_kv([pages[:2], pages[2:]], out_k, out_v)
    assert torch.equal(out_k, pages[:, :, 0].transpose(0, 1))
    assert torch.equal(out_v, pages[:, :, 1].transpose(0, 1))


def test_pages_into_block_split_tensors_with_the_helper():
    gen = torch.Generator().manual_seed(29)
    pages = rand((4, L, 2, P, H, D), torch.float16, gen)
    stage = poisoned_like((L, 4, H, P, 2 * D), torch.float16)           # vLLM's layout, K|V
    out_k, out_v = stage[..., :D].transpose(2, 3), stage[..., D:].transpose(2, 3)
    pages_into_kv([pages[:1], pages[1:]], out_k, out_v)
    assert torch.equal(out_k, pages[:, :, 0].transpose(0, 1))
    assert torch.equal(out_v, pages[:, :, 1].transpose(0, 1))
