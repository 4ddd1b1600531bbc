"""Attention straight over fp8 pages (``mmtier.native.fp8_attention``): against the float64
oracle on the dequantized values, on the vector and the portable code, split over threads, at
the shapes its loops specialise (query rows 1-8, head dims whose chunks do not divide evenly,
pages not a multiple of its token block); a special byte (e4m3fn's NaN, e5m2's infinity) gives
a NaN state for its KV head alone; shapes it does not take return ``None``; and a decode over
more tokens than the small path takes runs through it, tiers and scales included."""

from __future__ import annotations

import pytest
import torch

from mmtier import TieredKVCache
from mmtier.native import fp8_attention
from tests.support.oracle import rel_err

pytestmark = pytest.mark.skipif(not fp8_attention.available(),
                                reason="no C compiler here: the native fp8 attention is not built "
                                       "(the torch path runs instead; covered by test_fp8_pages)")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def pool(gen, n, layers, size, hkv, d, dtype):
    """A pool of ``n`` pages of random normal K/V (x2: some large, many small values) in fp8."""
    return (torch.randn(n, layers, 2, size, hkv, d, generator=gen) * 2).to(dtype)


def oracle(q, kv, layer, ids, scale):
    """float64 ``(out [Hkv, R, D], lse [Hkv, R])`` over every token of pages ``ids``."""
    hkv, d = kv.shape[4], kv.shape[5]
    k = kv[ids, layer, 0].double().reshape(-1, hkv, d).transpose(0, 1)
    v = kv[ids, layer, 1].double().reshape(-1, hkv, d).transpose(0, 1)
    s = torch.einsum("hrd,htd->hrt", q.double(), k) * scale
    return torch.einsum("hrt,htd->hrd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("rows,hkv,d,size,threads", [
    (1, 4, 128, 16, 1), (2, 2, 64, 32, 2), (3, 1, 72, 48, 1), (4, 4, 128, 16, 3), (5, 2, 40, 16, 2),
    (6, 1, 128, 64, 1), (7, 4, 128, 16, 2), (8, 2, 24, 32, 1)])
def test_against_the_float64_oracle(scalar, dtype, rows, hkv, d, size, threads):
    gen = torch.Generator().manual_seed(rows * 100 + d + size)
    kv = pool(gen, 80, 3, size, hkv, d, dtype)
    ids = torch.randperm(80, generator=gen)[:70]          # threads take 16 pages at a time
    q = torch.randn(hkv, rows, d, generator=gen)
    scale = d ** -0.5
    got = fp8_attention.attend(q, kv, 1, ids, scale, threads=threads, scalar=scalar)
    assert got is not None
    out, lse = oracle(q, kv, 1, ids, scale)
    assert rel_err(got[0], out) <= 1e-5                   # float32 sums over 1,120 keys
    assert (got[1].double() - lse).abs().max().item() <= 5e-5


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("dtype,special", [(torch.float8_e4m3fn, 0x7F), (torch.float8_e4m3fn, 0xFF),
                                           (torch.float8_e5m2, 0x7C), (torch.float8_e5m2, 0xFE)])
@pytest.mark.parametrize("where", [0, 1])
def test_a_special_byte_gives_its_heads_state_nan_and_no_other(scalar, dtype, special, where):
    gen = torch.Generator().manual_seed(5)
    kv = pool(gen, 40, 2, 16, 3, 64, dtype)
    kv.view(torch.uint8)[34, 0, where, 9, 1, 17] = special        # K or V of head 1 in page 34
    q = torch.randn(3, 4, 64, generator=gen)
    ids = torch.tensor([0, 2, *range(4, 40)])
    got = fp8_attention.attend(q, kv, 0, ids, 0.125, threads=2, scalar=scalar)
    assert got[0][1].isnan().all() and got[1][1].isnan().all()
    clean = [0, 2]
    out, lse = oracle(q, kv, 0, ids, 0.125)
    assert rel_err(got[0][clean], out[clean]) <= 1e-5 and not got[0][clean].isnan().any()


def test_shapes_it_does_not_take_are_left_to_the_caller():
    kv = torch.zeros(2, 1, 2, 16, 1, 64, dtype=torch.float8_e4m3fn)
    ids = torch.tensor([0, 1])
    assert fp8_attention.attend(torch.randn(1, 9, 64), kv, 0, ids, 1.0) is None          # 9 rows
    odd = torch.zeros(2, 1, 2, 16, 1, 60, dtype=torch.float8_e4m3fn)
    assert fp8_attention.attend(torch.randn(1, 2, 60), odd, 0, ids, 1.0) is None         # head dim 60
    assert fp8_attention.attend(torch.randn(1, 2, 64), kv.float(), 0, ids, 1.0) is None  # not fp8
    assert fp8_attention.attend(torch.randn(1, 2, 64), kv, 0, ids[:0], 1.0) is None      # no pages


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_a_long_decode_across_tiers_runs_through_it_against_the_oracle(tmp_path, dtype, monkeypatch):
    """12,000 tokens (past the small path) in text and images over a device pool, the host and
    the disk, scales per layer and head: one query's attention per layer equals the oracle's on
    the dequantized values, and the native kernel computed it (counted, the real call made)."""
    from tests.attention.kernels.test_fp8_pages import check_attention, fill, fp8_cfg
    calls = []
    real = fp8_attention.attend

    def counted(*args, **kw):
        got = real(*args, **kw)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(fp8_attention, "attend", counted)
    cfg = fp8_cfg(tmp_path, dtype, "head", device_pages=100, host_pages=100)
    gen = torch.Generator().manual_seed(17)
    with TieredKVCache(cfg) as cache:
        seq = cache.create_sequence(tenant="acme")
        ks, vs = fill(cache, seq, cfg, gen, 8, 1500)
        assert len({s.group.tier for s in cache.sequence(seq).segments}) == 3
        check_attention(cache, seq, ks, vs, cfg, gen, n_q=1)
    assert calls and all(calls)
