"""fp8 pages (float8_e4m3fn, float8_e5m2) with their scales, through every path.

An fp8 KV cache stores ``K / k_scale`` and ``V / v_scale`` (vLLM's ``--kv-cache-dtype fp8``):
mmtier keeps the fp8 bytes as they are, with the scales in the spec (per tensor, per layer, or
per layer and KV head). Every numeric check is against the float64 oracle over the
*dequantized* values (stored value x scale), with fresh random inputs; pages and slots no
segment lists hold NaN, output buffers are poisoned first.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import torch

from mmtier import CacheConfig, ModalitySpec, TieredKVCache
from mmtier.attention.kernels import paged_attention, spec_scales
from mmtier.attention.kernels.layout import build_paged_kv
from mmtier.attention.kernels.scales import KVScales
from mmtier.core.groups import Tier
from mmtier.errors import ConfigError, CorruptDataError, DTypeError, UnknownKeyError
from mmtier.native import fp8 as native_fp8
from mmtier.pages.kernels import INDEX_DTYPE
from tests.support.oracle import oracle_attention, rel_err

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
NAMES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp8 widens exactly: what is left is float32 arithmetic on the torch path; Triton's dots run on
# bfloat16 tiles (the scaled query and P rounded to bfloat16: 2**-7, test_kernels_triton's TOL)
TOL = {"torch": 2e-5, "triton": 2**-7}


# ---------------------------------------------------------------------------------------------
# kernels: scaled operands against the oracle, torch path and Triton


def _pool_case(dtype, gen, rng, *, page_size, layers, hkv, dim, lengths, k_scale=None, v_scale=None):
    """A pool of pages in shuffled order, NaN in every page and slot not listed; K and V are
    random normals stored as ``value / scale`` (``[layers, hkv]`` scales; none: as they are).
    Returns ``(pool, page lists, per segment the stored K and V [layers, n, Hkv, D])``."""
    need = sum(-(-n // page_size) for n in lengths)
    pool = torch.full((need + 3, layers, 2, page_size, hkv, dim), float("nan")).to(dtype)
    ids = list(range(need + 3))
    rng.shuffle(ids)
    segs, ks, vs = [], [], []
    for n in lengths:
        pages = [ids.pop() for _ in range(-(-n // page_size))]
        k = torch.randn((layers, n, hkv, dim), generator=gen)
        v = torch.randn((layers, n, hkv, dim), generator=gen)
        k = (k if k_scale is None else k / k_scale[:, None, :, None]).to(dtype)
        v = (v if v_scale is None else v / v_scale[:, None, :, None]).to(dtype)
        for j, p in enumerate(pages):
            m = min(page_size, n - j * page_size)
            pool[p, :, 0, :m] = k[:, j * page_size:j * page_size + m]
            pool[p, :, 1, :m] = v[:, j * page_size:j * page_size + m]
        segs.append(pages)
        ks.append(k)
        vs.append(v)
    return pool, segs, ks, vs


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("n_q", [1, 5])
def test_scaled_pools_against_oracle(dtype, backend, n_q):
    """Two fp8 pools (page sizes 16 and 32) with per-layer-and-head scales of their own and one
    bfloat16 pool, one sequence interleaving them; decode and a block of queries."""
    if backend == "triton" and not TRITON:
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1 (./run test sets it)")
    _pools_case(dtype, backend, n_q, scaled=True)


@pytest.mark.skipif(not TRITON, reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1 (./run test sets it)")
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
def test_triton_fp8_in_a_gpus_tile_configuration(dtype, scaled):
    """The Triton kernel in the block sizes, warps and stages a GPU launch takes
    (``as_on_gpu``), fp8 pools with scales and without (vLLM's default scales of 1.0)."""
    from mmtier.pages.kernels.launch import as_on_gpu

    with as_on_gpu():
        _pools_case(dtype, "triton", 3, scaled=scaled)


def _pools_case(dtype, backend: str, n_q: int, *, scaled: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    rng = random.Random(11)
    layers, hkv, dim, group, layer = 3, 2, 64, 3, 2
    ops, keys, values, positions, pos = [], [], [], [], 0
    plans = [(dtype, 16, [37, 16]), (dtype, 32, [50]), (torch.bfloat16, 16, [21])]
    for pool_dtype, size, lengths in plans:
        k_scale = torch.rand(layers, hkv, generator=gen) * 0.05 + 0.005     # as an e4m3 cache's amax / 448
        v_scale = torch.rand(layers, hkv, generator=gen) * 0.05 + 0.005
        fp8 = scaled and pool_dtype in FP8
        pool, segs, ks, vs = _pool_case(pool_dtype, gen, rng, page_size=size, layers=layers, hkv=hkv, dim=dim,
                                        lengths=lengths, k_scale=k_scale if fp8 else None,
                                        v_scale=v_scale if fp8 else None)
        table = []
        for pages, k in zip(segs, ks):
            n = k.shape[1]
            table.append((pages, pos, n))
            positions.append(torch.arange(pos, pos + n))
            pos += n
        op = build_paged_kv(pool.to(DEVICE), layer, [table])
        if fp8:
            op = replace(op, scales=KVScales(k_scale.to(DEVICE), v_scale.to(DEVICE)))
            keys += [k[layer].double() * k_scale[layer][None, :, None].double() for k in ks]
            values += [v[layer].double() * v_scale[layer][None, :, None].double() for v in vs]
        else:
            keys += [k[layer].double() for k in ks]
            values += [v[layer].double() for v in vs]
        ops.append(op)
    q = torch.randn(n_q, hkv * group, dim, generator=gen).to(torch.bfloat16)
    q_pos = torch.arange(pos - n_q, pos, dtype=INDEX_DTYPE)
    q_indptr = torch.tensor([0, n_q], dtype=INDEX_DTYPE)
    ref_out, ref_lse = oracle_attention(q, q_pos, torch.cat(keys), torch.cat(values), torch.cat(positions))
    out, lse = paged_attention(q.to(DEVICE), q_indptr.to(DEVICE), q_pos.to(DEVICE), ops, backend=backend,
                               out_dtype=torch.float32)
    assert not torch.isnan(out).any()
    assert rel_err(out.cpu(), ref_out) <= TOL[backend], rel_err(out.cpu(), ref_out)
    # lse: exact products summed in float32 on the torch path; in Triton the scaled query is
    # rounded to bfloat16 (2**-9 of each score, scores of a few units here)
    assert (lse.cpu().double() - ref_lse).abs().max() <= (1e-4 if backend == "torch" else 2**-7)


@pytest.mark.parametrize("dtype", FP8)
def test_native_widen_is_torch_conversion(dtype):
    """The native widening gives torch's own float32 bits for all 256 bytes (NaN payloads and
    infinities included), over strided blocks, and refuses what it does not take."""
    every = torch.arange(256, dtype=torch.uint8).view(dtype)
    blocks = every.repeat(6).view(6, 256)[::2]               # 3 blocks, 512 bytes apart
    out = torch.full((3, 256), 7.0)
    if not native_fp8.widen(blocks, out):
        pytest.skip("no C compiler here: the torch conversion runs instead")
    want = blocks.float()
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    assert not native_fp8.widen(blocks.float(), out)          # not fp8
    assert not native_fp8.widen(blocks[:, ::2], out[:, :128])  # strided inner axis


# ---------------------------------------------------------------------------------------------
# the cache: config, writes, tiers, restart, keys

L, H, D, HQ = 2, 2, 32, 4
SCALES = {   # what an engine keeps: one per tensor, one per layer (vLLM's k_scale), per layer and head
    "tensor": (0.02, 0.03),
    "layer": ((0.02, 0.05), (0.04, 0.01)),
    "head": (((0.02, 0.05), (0.03, 0.01)), ((0.04, 0.02), (0.01, 0.06))),
}


def scale_rows(value) -> torch.Tensor:
    """``[L, H]`` float64 scales of a config value (the oracle's own broadcast)."""
    t = torch.tensor(value, dtype=torch.float64)
    return t.expand(L, H) if t.dim() == 0 else t[:, None].expand(L, H) if t.dim() == 1 else t


def fp8_cfg(tmp_path, dtype, scales="head", *, device_pages=4, host_pages=4, **over):
    """Two pools (text pages of 16, vision of 32 tokens) of ``device_pages`` vision pages' bytes
    on the device, ``host_pages`` on the host, a disk tier under ``tmp_path``."""
    k_scale, v_scale = SCALES[scales]
    vision_page = 2 * L * 32 * H * D * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    base = dict(model="fp8-tiers", num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype,
                k_scale=k_scale, v_scale=v_scale,
                modalities={"text": ModalitySpec(page_size=16, share=0.5), "vision": ModalitySpec(page_size=32)},
                device_bytes=2 * device_pages * vision_page, host_bytes=host_pages * vision_page,
                disk_dir=tmp_path / "spill", disk_bytes=64 << 20, disk_free_floor_bytes=0, attention_backend="torch")
    base.update(over)
    return CacheConfig(**base)


def stored(n, dtype, cfg, gen):
    """Random normal K/V ``[L, n, H, D]`` quantized as the cache's engine would (value / scale)."""
    ks = scale_rows(cfg.k_scale).float()[:, None, :, None]
    vs = scale_rows(cfg.v_scale).float()[:, None, :, None]
    return ((torch.randn(L, n, H, D, generator=gen) / ks).to(dtype),
            (torch.randn(L, n, H, D, generator=gen) / vs).to(dtype))


def fill(cache, seq, cfg, gen, groups: int, tokens: int):
    """``groups`` of ``tokens`` each into ``seq``: text appended and images put (prefix-dependent)
    in turn, then flushed; the K/V as stored, in order."""
    ks, vs = [], []
    for i in range(groups):
        k, v = stored(tokens, getattr(torch, cfg.dtype), cfg, gen)
        if i % 2:
            cache.append(seq, "text", k, v)
        else:
            key = cache.content_key("vision", f"img{i}".encode(), tenant="acme", parent=cache.prefix_key(seq))
            cache.put(key, k, v)
            cache.attach(seq, key)
        ks.append(k)
        vs.append(v)
    cache.flush()
    return ks, vs


def check_attention(cache, seq, ks, vs, cfg, gen, n_q=3, tol=2e-5):
    """Every layer's attention of ``n_q`` fresh queries against the float64 oracle over the
    dequantized K/V the sequence holds (``tol``: the torch path's float32; Triton's bfloat16
    tiles take ``TOL["triton"]``)."""
    k_all, v_all = torch.cat(ks, 1), torch.cat(vs, 1)
    total = k_all.shape[1]
    for layer in range(L):
        q = torch.randn(n_q, HQ, D, generator=gen)
        out = cache.attention(seq, layer, q)
        k = k_all[layer].double() * scale_rows(cfg.k_scale)[layer][None, :, None]
        v = v_all[layer].double() * scale_rows(cfg.v_scale)[layer][None, :, None]
        ref, _ = oracle_attention(q, torch.arange(total - n_q, total), k, v, torch.arange(total))
        assert rel_err(out, ref) <= tol, (layer, rel_err(out, ref))


@pytest.mark.parametrize("dtype", NAMES.values())
@pytest.mark.parametrize("scales", SCALES)
def test_cache_across_device_host_disk_against_oracle(tmp_path, dtype, scales):
    """Text appended and images put (prefix-dependent) over tiers too small to hold them: the
    groups end up on the device, the host and the disk, and every layer's attention over all of
    them matches the oracle on the dequantized values."""
    cfg = fp8_cfg(tmp_path, dtype, scales)
    gen = torch.Generator().manual_seed(3)
    with TieredKVCache(cfg) as cache:
        seq = cache.create_sequence(tenant="acme")
        ks, vs = fill(cache, seq, cfg, gen, 12, 50)
        assert {s.group.tier for s in cache.sequence(seq).segments} == {Tier.DEVICE, Tier.HOST, Tier.DISK}
        check_attention(cache, seq, ks, vs, cfg, gen)
        check_attention(cache, seq, ks, vs, cfg, gen, n_q=1)


@pytest.mark.skipif(not TRITON, reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1 (./run test sets it)")
def test_cache_device_pool_on_triton(tmp_path):
    """The device part on the Triton backend (the interpreter on a CPU), the lower tiers on
    the torch path, merged: the same oracle."""
    cfg = fp8_cfg(tmp_path, "float8_e4m3fn", "head", attention_backend="triton")
    gen = torch.Generator().manual_seed(5)
    ks, vs = [], []
    with TieredKVCache(cfg) as cache:
        seq = cache.create_sequence()
        for i in range(8):
            k, v = stored(40, torch.float8_e4m3fn, cfg, gen)
            cache.append(seq, "text" if i % 2 else "vision", k, v)
            ks.append(k)
            vs.append(v)
        cache.flush()
        assert {s.group.tier for s in cache.sequence(seq).segments} >= {Tier.DEVICE, Tier.HOST}
        check_attention(cache, seq, ks, vs, cfg, gen, n_q=1, tol=TOL["triton"])


@pytest.mark.parametrize("dtype", NAMES.values())
def test_warm_restart_reads_fp8_groups_back_and_other_scales_miss(tmp_path, dtype):
    """Groups spilled to disk come back after a restart over the same directory, bit-exact and
    attended against the oracle; a cache whose scales differ finds none of them (its keys
    differ, and the files' recorded layout does not match its spec)."""
    cfg = fp8_cfg(tmp_path, dtype, "layer", device_pages=2, host_pages=0, host_bytes=0, persist_on_close=False)
    tdtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(9)
    data = {}
    with TieredKVCache(cfg) as cache:
        for i in range(4):
            key = cache.content_key("vision", f"w{i}".encode(), tenant="acme")
            data[key] = stored(50, tdtype, cfg, gen)
            cache.put(key, *data[key])
        on_disk = [k for k in data if cache.index.groups[k].tier == Tier.DISK]
        assert len(on_disk) >= 2
    files = sorted((tmp_path / "spill").glob("vision-*.arrow"))
    assert files and all(dtype in f.read_bytes()[:1 << 16].decode("latin-1") for f in files)   # the layout's dtype
    with TieredKVCache(cfg) as again:
        for key in on_disk:
            assert again.contains(key)
            got_k, got_v = again.read_group(key)
            assert got_k.dtype == tdtype
            assert torch.equal(got_k.view(torch.uint8), data[key][0].view(torch.uint8))
            assert torch.equal(got_v.view(torch.uint8), data[key][1].view(torch.uint8))
        seq = again.create_sequence(tenant="acme")
        again.attach(seq, on_disk[0])
        check_attention(again, seq, [data[on_disk[0]][0]], [data[on_disk[0]][1]], cfg, gen)
    other = cfg.model_copy(update={"k_scale": (0.5, 0.5)})
    other = CacheConfig(**{**other.model_dump(), "modalities": {n: ModalitySpec(page_size=s.page_size, share=s.share)
                                                               for n, s in cfg.modalities.items()}})
    with TieredKVCache(other) as rescaled:
        for i, key in enumerate(data):
            assert rescaled.content_key("vision", f"w{i}".encode(), tenant="acme") != key
        for key in on_disk:          # an old key held on to: its file's layout is not this spec's
            with pytest.raises((CorruptDataError, UnknownKeyError)):
                rescaled.read_group(key)
        assert rescaled.stats().counters["disk_corrupt_reads"] >= 1


def test_content_keys_never_shared_across_dtypes_or_scales(tmp_path):
    """The same image bytes, tenant and model under bfloat16, e4m3, e5m2 and e4m3 with other
    scales: four different keys (dtype and scales are part of the payload layout in the key)."""
    def key_for(dtype, scales="tensor"):
        over = {"k_scale": None, "v_scale": None} if dtype == "bfloat16" else {}
        with TieredKVCache(fp8_cfg(tmp_path / dtype / scales, dtype, scales, **over)) as cache:
            return cache.content_key("vision", b"same image", tenant="acme")

    keys = [key_for("bfloat16"), key_for("float8_e4m3fn"), key_for("float8_e5m2"), key_for("float8_e4m3fn", "head")]
    assert len(set(keys)) == 4


def test_bad_payloads_are_refused_and_change_nothing(tmp_path):
    """A bfloat16 payload for fp8 pages, an e5m2 payload for e4m3 pages, NaN in e4m3, Inf in
    e5m2: a DTypeError each, and the cache holds what it held."""
    cfg = fp8_cfg(tmp_path, "float8_e4m3fn", "tensor")
    gen = torch.Generator().manual_seed(1)
    with TieredKVCache(cfg) as cache:
        seq = cache.create_sequence()
        k, v = stored(20, torch.float8_e4m3fn, cfg, gen)
        cache.append(seq, "text", k, v)
        before = cache.stats()
        nan = k.clone()
        nan[1, 7, 1, 3] = float("nan")
        bad = [(k.to(torch.bfloat16), v.to(torch.bfloat16)), (k.to(torch.float8_e5m2), v.to(torch.float8_e5m2)),
               (nan, v)]
        for bk, bv in bad:
            with pytest.raises(DTypeError):
                cache.append(seq, "text", bk, bv)
            key = cache.content_key("vision", b"bad")
            with pytest.raises(DTypeError):
                cache.put(key, bk, bv)
            assert not cache.contains(key)
        assert cache.sequence(seq).length == 20
        assert cache.stats().tiers == before.tiers
    e5 = fp8_cfg(tmp_path / "e5", "float8_e5m2", "tensor")
    with TieredKVCache(e5) as cache:
        k, v = stored(20, torch.float8_e5m2, e5, gen)
        k[0, 0, 0, 0] = float("inf")
        with pytest.raises(DTypeError):
            cache.put(cache.content_key("vision", b"inf"), k, v)


@pytest.mark.parametrize("bad, field", [
    (dict(dtype="bfloat16", k_scale=0.5), "k_scale"),
    (dict(dtype="float8_e4m3fn", k_scale=(0.5,)), "k_scale"),             # one entry for two layers
    (dict(dtype="float8_e4m3fn", v_scale=((0.5,), (0.5, 0.5))), "v_scale"),  # one head for two
    (dict(dtype="float8_e5m2", k_scale=-1.0), "k_scale"),
    (dict(dtype="float8_e5m2", v_scale=float("inf")), "v_scale"),
    (dict(dtype="float8_e4m3", k_scale=1.0), "dtype"),                    # not a torch name
])
def test_config_refuses_bad_dtypes_and_scales(bad, field):
    with pytest.raises(ConfigError, match=field):
        CacheConfig(model="m", num_layers=L, num_kv_heads=H, head_dim=D, device_bytes=1 << 20,
                    modalities={"text": ModalitySpec(page_size=16)}, **bad)


def test_spec_size_math_and_scales():
    """fp8 pages are one byte an element; the scales broadcast to ``[layers][heads]``; all-ones
    scales (vLLM's default) are nothing to apply."""
    cfg = CacheConfig(model="m", num_layers=L, num_kv_heads=H, head_dim=D, device_bytes=1 << 20,
                      dtype="float8_e5m2", k_scale=(0.5, 0.25),
                      modalities={"text": ModalitySpec(page_size=16), "vision": ModalitySpec(page_size=16, dtype="bfloat16")})
    text = cfg.spec("text")
    assert text.page_bytes == L * 2 * 16 * H * D and cfg.spec("vision").page_bytes == 2 * text.page_bytes
    assert text.scale_rows("k") == ((0.5, 0.5), (0.25, 0.25)) and text.scale_rows("v") is None
    assert cfg.spec("vision").k_scale is None and cfg.spec("vision").scale_rows("k") is None
    scales = spec_scales(text, "cpu")
    assert torch.equal(scales.k, torch.tensor([[0.5, 0.5], [0.25, 0.25]])) and torch.equal(scales.v, torch.ones(L, H))
    ones = CacheConfig(model="m", num_layers=L, num_kv_heads=H, head_dim=D, device_bytes=1 << 20,
                       dtype="float8_e4m3fn", modalities={"text": ModalitySpec(page_size=16)})
    assert spec_scales(ones.spec("text"), "cpu") is None


def test_vllm_kv_cache_dtypes_map_to_fp8_pages_and_runtime_scales_are_refused():
    """The connector reads the KV dtype from vLLM: its fp8 cache names (``fp8``, ``fp8_e4m3``,
    ``fp8_e5m2``; the tensors are uint8) map to mmtier's fp8 pages, viewed over the same bytes;
    scales vLLM computes at run time and fp8 formats mmtier has no pages for are refused."""
    from types import SimpleNamespace

    from mmtier.engines.vllm import copy as vllm_copy
    from mmtier.engines.vllm.shape import _fp8_name

    cc = lambda dtype, calc=False: SimpleNamespace(cache_dtype=dtype, calculate_kv_scales=calc)  # noqa: E731
    assert _fp8_name(cc("fp8")) == _fp8_name(cc("fp8_e4m3")) == "float8_e4m3fn"
    assert _fp8_name(cc("fp8_e5m2")) == "float8_e5m2"
    assert _fp8_name(cc("auto")) is None and _fp8_name(cc("bfloat16")) is None
    for bad in (cc("fp8", calc=True), cc("fp8_ds_mla")):
        with pytest.raises(ConfigError, match="dtype"):
            _fp8_name(bad)
    raw = torch.randint(0, 256, (4, 2, 64, 32), dtype=torch.uint8)
    raw[raw & 0x7F == 0x7F] = 0
    view = vllm_copy.as_page_dtype(raw, torch.float8_e4m3fn)
    assert view.dtype == torch.float8_e4m3fn and view.data_ptr() == raw.data_ptr()
    assert torch.equal(view.view(torch.uint8), raw)
    assert vllm_copy.as_page_dtype(raw.float(), torch.float8_e4m3fn).dtype == torch.float32
