"""Triton paged attention, merge and write kernels against the float64 oracle.

On a CPU-only machine the kernels run under ``TRITON_INTERPRET=1`` (``./run test`` sets it);
with a GPU they run compiled on CUDA. Every case uses random non-zero inputs; pages and slots
that no segment lists are filled with NaN, so a kernel reading anything it was not given
fails loudly; output buffers the API takes are poisoned with NaN before each run.

The cases that dtypes, head dims and tile edges touch (attention, merge, write) run in two
configurations (the ``tiles`` fixture): the interpreter's own (wide ``BLOCK_N`` tiles, fewest
interpreted ops) and a GPU's (``as_on_gpu()``: the block sizes, warps and stages a compiled
launch takes), so the configuration a GPU compiles is checked against the oracle on a CPU too
(on CUDA both are the GPU's; the first is skipped). In both the dots run on the pool's dtype:
the query is cast to it, the softmax weights P are rounded to it before ``P @ V`` (the
interpreter's bfloat16 dot and rounding are made a GPU's by ``launch_guard``).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import pytest
import torch

from mmtier.attention.kernels import merge_attention_states, paged_attention
from mmtier.attention.kernels.layout import TABLES, HostTables, PagedKV, build_paged_kv
from mmtier.errors import ConfigError, DTypeError, ShapeError
from mmtier.pages.kernels import INDEX_DTYPE, upload_ints, write_kv
from mmtier.pages.kernels.launch import as_on_gpu
from tests.support.oracle import oracle_attention, rel_err

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (./run test sets it)")

if HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1":
    from mmtier.attention.kernels.triton_attention import (
        paged_attention_triton,
        plan_paged_attention,
    )
    from mmtier.attention.kernels.triton_merge import merge_partials
    from mmtier.pages.kernels.triton_write import write_kv_triton

# What a 16-bit dot gives up: P is rounded to the pool's dtype before ``P @ V``, each weight
# off by up to half a unit in its last place (2**-11 fp16, 2**-8 bf16), so out = P @ V / l is
# off by up to that fraction of max|V|; the tolerance is one unit (2**-10, 2**-7) of max|out|
# (measured under the interpreter, which rounds as a GPU does: fp16 <= 2e-4, bf16 <= 1.4e-3).
# Scores are exact products of 16-bit values summed in float32, so lse stays within 1e-4.
# Storing out in a 16-bit dtype rounds it once more (OUT_TOL).
TOL = {torch.float32: 1e-4, torch.float16: 2**-10, torch.bfloat16: 2**-7}
OUT_TOL = {torch.float16: 2**-10 + 2**-11, torch.bfloat16: 2**-7 + 2**-8}
BF16_OUT_TOL = 8e-3  # one bfloat16 ulp: rounding a float32 merge's output costs up to 2**-8


# ---------------------------------------------------------------------------------------------
# random paged cases


@pytest.fixture(params=["interpreter", "gpu"])
def tiles(request):
    """The launch's tile configuration: the interpreter's own, or a GPU's (``as_on_gpu``)."""
    if request.param == "interpreter":
        if HAS_CUDA:
            pytest.skip("on CUDA every launch takes the GPU's configuration")
        yield request.param
        return
    with as_on_gpu():
        yield request.param


@dataclass
class Case:
    q: torch.Tensor
    q_indptr: torch.Tensor
    q_pos: torch.Tensor
    operands: list[PagedKV]
    keys: list[torch.Tensor]  # per batch item: gathered K [T, Hkv, D] over every operand
    values: list[torch.Tensor]
    key_pos: list[torch.Tensor]


def make_case(*, dtype=torch.float32, head_dim=64, num_kv_heads=2, group=2,
              page_sizes=(16,), seqs, layers=2, layer=1, seed=0, spare_pages=3,
              poison=float("nan")) -> Case:
    """``seqs``: per batch item ``(segments, q_positions)`` where segments are
    ``(pool, start, length)``. Pages come from a shuffled free list per pool, so sequences'
    pages interleave; unlisted pages and the tail slots of last pages hold ``poison``."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [0] * len(page_sizes)
    for segments, _ in seqs:
        for pool, _, length in segments:
            need[pool] += -(-length // page_sizes[pool])
    pools, free = [], []
    for i, size in enumerate(page_sizes):
        n = need[i] + spare_pages
        pools.append(torch.full((n, layers, 2, size, num_kv_heads, head_dim), poison, dtype=dtype))
        ids = list(range(n))
        rng.shuffle(ids)
        free.append(ids)
    tables = [[[] for _ in seqs] for _ in page_sizes]
    keys, values, key_pos, qs, q_pos, q_indptr = [], [], [], [], [], [0]
    for b, (segments, positions) in enumerate(seqs):
        ks, vs, ps = [], [], []
        for pool, start, length in segments:
            size = page_sizes[pool]
            pages = [free[pool].pop() for _ in range(-(-length // size))]
            for j, page in enumerate(pages):
                n = min(size, length - j * size)
                data = torch.randn((layers, 2, n, num_kv_heads, head_dim), generator=gen)
                pools[pool][page, :, :, :n] = data.to(dtype)
            if pages:
                kv = pools[pool][pages, layer]  # [n_pages, 2, size, H, D]
                ks.append(kv[:, 0].reshape(-1, num_kv_heads, head_dim)[:length])
                vs.append(kv[:, 1].reshape(-1, num_kv_heads, head_dim)[:length])
                ps.append(torch.arange(start, start + length))
            tables[pool][b].append((pages, start, length))
        empty = torch.zeros((0, num_kv_heads, head_dim), dtype=dtype)
        keys.append(torch.cat(ks) if ks else empty)
        values.append(torch.cat(vs) if vs else empty)
        key_pos.append(torch.cat(ps) if ps else torch.zeros(0, dtype=torch.long))
        q_pos.extend(positions)
        q_indptr.append(len(q_pos))
        qs.append(torch.randn((len(positions), num_kv_heads * group, head_dim), generator=gen))
    q = torch.cat(qs).to(dtype).to(DEVICE)
    operands = [build_paged_kv(pool.to(DEVICE), layer, tables[i]) for i, pool in enumerate(pools)]
    idx = lambda x: torch.tensor(x, dtype=INDEX_DTYPE, device=DEVICE)
    return Case(q, idx(q_indptr), idx(q_pos), operands, keys, values, key_pos)


def expected(case: Case, causal: bool = True, scale: float | None = None):
    outs, lses = [], []
    bounds = case.q_indptr.tolist()
    for b in range(len(bounds) - 1):
        q = case.q[bounds[b]:bounds[b + 1]].cpu()
        pos = case.q_pos[bounds[b]:bounds[b + 1]].cpu()
        o, s = oracle_attention(q, pos, case.keys[b], case.values[b], case.key_pos[b], causal, scale)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs), torch.cat(lses)


def check(out, lse, ref_out, ref_lse, dtype, *, out_tol=None):
    out, lse = out.cpu(), lse.cpu()
    assert lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "rows that see no key must have lse -inf"
    assert (lse[empty] < 0).all()
    assert (out[empty] == 0).all(), "rows that see no key must have out 0"
    tol = out_tol or TOL[dtype]
    if (~empty).any():
        assert rel_err(out, ref_out) <= tol, rel_err(out, ref_out)
        err = (lse[~empty].double() - ref_lse[~empty]).abs().max().item()
        assert err <= max(1e-4, tol), err


def run_case(case: Case, dtype, *, causal=True, num_splits=None, scale=None):
    """Check the kernel's float32 output at the dtype's tolerance, and (for 16-bit inputs) its
    output in the input dtype too."""
    ref_out, ref_lse = expected(case, causal, scale)
    out, lse = paged_attention_triton(case.q, case.q_indptr, case.q_pos, case.operands,
                                      causal=causal, scale=scale, num_splits=num_splits,
                                      out_dtype=torch.float32)
    check(out, lse, ref_out, ref_lse, dtype)
    if dtype != torch.float32:
        out, lse = paged_attention_triton(case.q, case.q_indptr, case.q_pos, case.operands,
                                          causal=causal, scale=scale, num_splits=num_splits)
        assert out.dtype == dtype
        check(out, lse, ref_out, ref_lse, dtype, out_tol=OUT_TOL[dtype])


def decode_seqs(lengths, pools=1, n_q=1, base=0):
    """Per batch item: about three consecutive segments cycling over ``pools``, starting at
    ``base + 7 * i``; the last ``n_q`` positions are the queries."""
    seqs = []
    for i, length in enumerate(lengths):
        start = base + 7 * i
        chunk = max(1, -(-length // 3))
        segments = [((s + i) % pools, start + off, min(chunk, length - off))
                    for s, off in enumerate(range(0, length, chunk))]
        end = start + length
        seqs.append((segments, list(range(end - n_q, end))))
    return seqs


# ---------------------------------------------------------------------------------------------
# attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 112, 128, 256])
def test_dtypes_and_head_dims(dtype, head_dim, tiles):
    seqs = decode_seqs([70, 45], pools=2, n_q=3, base=5)
    case = make_case(dtype=dtype, head_dim=head_dim, page_sizes=(16, 32), seqs=seqs, seed=head_dim)
    run_case(case, dtype)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("mode", ["decode", "prefill", "chunked_prefill"])
def test_gqa_and_query_modes(group, mode, tiles):
    if mode == "decode":
        seqs = decode_seqs([150, 33, 80], pools=3, n_q=1)
    elif mode == "prefill":  # the whole sequence queries itself, from position 0
        seqs = [([(0, 0, 20), (1, 20, 70), (2, 90, 10)], list(range(100))),
                ([(2, 0, 40)], list(range(40)))]
    else:  # a chunk of queries in the middle: earlier chunks cached, later keys not visible
        seqs = [([(0, 0, 50), (1, 50, 64), (2, 114, 30)], list(range(100, 130))),
                ([(1, 10, 40), (0, 50, 17)], list(range(52, 60)))]
    case = make_case(num_kv_heads=2, group=group, page_sizes=(16, 64, 256), seqs=seqs,
                     seed=group)
    run_case(case, torch.float32)


@pytest.mark.parametrize("num_kv_heads,group,head_dim,dtype", [
    (4, 7, 128, torch.bfloat16),   # Qwen2.5-VL-7B: 28 query heads over 4 KV heads
    (2, 5, 64, torch.float32),
    (2, 6, 64, torch.float16),
    (4, 7, 80, torch.float32),     # head dim 80 (not a power of two) at GQA 7
    (4, 7, 80, torch.float16),
])
@pytest.mark.parametrize("mode", ["decode", "chunked_prefill"])
def test_preset_gqa_ratios(num_kv_heads, group, head_dim, dtype, mode, tiles):
    """Query-head groups that are not powers of two: a query tile holds ``BLOCK_M // G`` whole
    queries, so its last rows are padding that must never be read, written or mixed in."""
    if mode == "decode":
        seqs = decode_seqs([90, 37], pools=2, n_q=1, base=2)
    else:            # a chunk of queries whose tiles straddle the causal boundary
        seqs = [([(0, 0, 20), (1, 20, 30)], list(range(44, 50))),
                ([(1, 0, 21)], list(range(18, 21)))]
    case = make_case(dtype=dtype, head_dim=head_dim, num_kv_heads=num_kv_heads, group=group,
                     page_sizes=(16, 32), seqs=seqs, seed=group * head_dim)
    run_case(case, dtype, num_splits=3 if mode == "decode" else None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_query_over_16bit_pool_is_cast(dtype, tiles):
    """A float32 query over a 16-bit pool is rounded to the pool's dtype (the dots run on
    16-bit tiles): the result is the one of the rounded query, bit for bit, and within the
    16-bit tolerance of the oracle over that rounded query."""
    seqs = decode_seqs([90, 37], pools=2, n_q=2, base=3)
    case = make_case(dtype=dtype, head_dim=96, page_sizes=(16, 32), seqs=seqs, group=4, seed=13)
    gen = torch.Generator().manual_seed(14)
    q32 = torch.randn(case.q.shape, generator=gen).to(DEVICE)
    assert not torch.equal(q32, q32.to(dtype).float())      # the rounding is visible
    rounded = Case(q32.to(dtype), case.q_indptr, case.q_pos, case.operands, case.keys,
                   case.values, case.key_pos)
    for num_splits in (1, 3):
        got = paged_attention_triton(q32, case.q_indptr, case.q_pos, case.operands,
                                     out_dtype=torch.float32, num_splits=num_splits)
        want = paged_attention_triton(rounded.q, case.q_indptr, case.q_pos, case.operands,
                                      out_dtype=torch.float32, num_splits=num_splits)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        check(*got, *expected(rounded), dtype)


def test_gpu_configuration_reaches_the_launch(monkeypatch):
    """Inside ``as_on_gpu()`` the launch passes a GPU's options (warps, stages) and block
    sizes, outside it (on the CPU) the interpreter's; both agree with the oracle."""
    from mmtier.attention.kernels import triton_attention as ta

    seen, real = [], ta._kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs)
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(ta, "_kernel", Spy())
    case = make_case(dtype=torch.float16, head_dim=128, seqs=decode_seqs([80], n_q=1), seed=2)
    ref = expected(case)
    with as_on_gpu():
        out = paged_attention_triton(case.q, case.q_indptr, case.q_pos, case.operands,
                                     out_dtype=torch.float32, num_splits=1)
    check(*out, *ref, torch.float16)
    gpu = seen.pop()
    assert gpu["num_warps"] >= 4 and gpu["BLOCK_N"] < ta.INTERPRET_BLOCK_N
    out = paged_attention_triton(case.q, case.q_indptr, case.q_pos, case.operands,
                                 out_dtype=torch.float32, num_splits=1)
    check(*out, *ref, torch.float16)
    own = seen.pop()
    assert own == gpu if HAS_CUDA else ("num_warps" not in own and own["BLOCK_N"] == ta.INTERPRET_BLOCK_N)


@pytest.mark.parametrize("num_splits", [2, 5, 64])
def test_split_kv_forced(num_splits):
    seqs = decode_seqs([300, 20, 0], pools=2, n_q=2)
    case = make_case(group=4, page_sizes=(16, 32), seqs=seqs, seed=num_splits)
    plan = plan_paged_attention(case.q, case.q_indptr, case.operands, num_splits=num_splits)
    assert plan.operands[0].num_splits > 1 and plan.num_parts > 2
    run_case(case, torch.float32, num_splits=num_splits)


def test_split_kv_fp16_single_pool_direct_and_split_agree(tiles):
    seqs = decode_seqs([400], n_q=1)
    case = make_case(dtype=torch.float16, group=4, page_sizes=(32,), seqs=seqs, seed=3)
    run_case(case, torch.float16, num_splits=1)
    run_case(case, torch.float16, num_splits=6)


def test_empty_and_one_token_segments(tiles):
    seqs = [
        ([(0, 0, 1), (1, 1, 0), (0, 1, 17), (1, 18, 1)], [18, 5, 0]),  # q at 0 sees key 0 only
        ([], [3]),                                                   # no segment at all
        ([(1, 0, 0)], [9]),                                          # only an empty segment
        ([(0, 10, 5)], [2, 12]),                                     # q at 2 sees nothing
    ]
    case = make_case(page_sizes=(16, 64), seqs=seqs, group=2, seed=11)
    run_case(case, torch.float32)
    run_case(case, torch.float32, num_splits=3)


def test_cross_attention_subset_noncausal(tiles):
    """Block-sparse cross-attention: only chosen groups' segments are passed, causal=False;
    pages of the groups left out are NaN, so reading any of them would show."""
    seqs = [([(0, 0, 30), (1, 30, 64), (0, 94, 16), (1, 110, 40)], [150, 151]),
            ([(1, 0, 100), (0, 100, 8)], [108])]
    full = make_case(page_sizes=(16, 64), seqs=seqs, group=4, seed=5)
    chosen = {0: [1, 3], 1: [0]}  # batch item -> indices of the segments it attends to
    operands = []
    for op in full.operands:
        tables = []
        for b in range(2):
            s0, s1 = op.seg_indptr[b].item(), op.seg_indptr[b + 1].item()
            segs = []
            for s in range(s0, s1):
                p0, p1 = op.seg_page_indptr[s].item(), op.seg_page_indptr[s + 1].item()
                segs.append((op.page_ids[p0:p1].tolist(), op.seg_start[s].item(), op.seg_len[s].item()))
            tables.append(segs)
        operands.append(tables)
    # keep only chosen segments (in position order across pools) and NaN-out the others' pages
    kept = [[[], []], [[], []]]
    for b, (segs, _) in enumerate(seqs):
        order = {(pool, start): i for i, (pool, start, _) in enumerate(segs)}
        for pool in range(2):
            for pages, start, length in operands[pool][b]:
                if order[(pool, start)] in chosen[b]:
                    kept[pool][b].append((pages, start, length))
                else:
                    full.operands[pool].kv[pages] = float("nan")
    ops = [build_paged_kv(full.operands[p].kv, 1, kept[p]) for p in range(2)]
    keys, values, pos = [], [], []
    for b in range(2):
        ks, vs, ps = [], [], []
        for pool in range(2):
            for pages, start, length in kept[pool][b]:
                kv = full.operands[pool].kv[pages, 1].cpu()
                ks.append(kv[:, 0].reshape(-1, 2, 64)[:length])
                vs.append(kv[:, 1].reshape(-1, 2, 64)[:length])
                ps.append(torch.arange(start, start + length))
        keys.append(torch.cat(ks))
        values.append(torch.cat(vs))
        pos.append(torch.cat(ps))
    case = Case(full.q, full.q_indptr, full.q_pos, ops, keys, values, pos)
    run_case(case, torch.float32, causal=False)
    run_case(case, torch.float32, causal=False, num_splits=4, scale=0.3)


def test_many_pages_shuffled_across_sequences():
    seqs = decode_seqs([260, 190, 330, 5], pools=3, n_q=2, base=1000)
    case = make_case(page_sizes=(16, 32, 64), seqs=seqs, group=2, seed=21, spare_pages=20)
    run_case(case, torch.float32)
    run_case(case, torch.float32, num_splits=4)


def test_plan_reuse_across_layers():
    seqs = decode_seqs([90, 40], pools=2, n_q=1)
    case = make_case(page_sizes=(16, 64), seqs=seqs, seed=8, layer=0)
    plan = plan_paged_attention(case.q, case.q_indptr, case.operands, num_splits=2)
    for layer in (0, 1):
        ops = [PagedKV(op.kv, layer, op.seg_indptr, op.seg_page_indptr, op.seg_start,
                       op.seg_len, op.page_ids) for op in case.operands]
        got = paged_attention_triton(case.q, case.q_indptr, case.q_pos, ops, plan=plan)
        want = paged_attention_triton(case.q, case.q_indptr, case.q_pos, ops, num_splits=2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _on_meta(op: PagedKV) -> PagedKV:
    """The operand with its pool and device tables on the meta device (no values to read)."""
    return PagedKV(op.kv.to("meta"), op.layer, *(getattr(op, n).to("meta") for n in TABLES), host=op.host)


def test_plan_from_host_tables_never_reads_the_device():
    """With host copies of every table, planning reads nothing on the device: the same call
    with the pools and device tables on the meta device (whose values cannot be read) plans
    exactly like the real one, and like planning from the device tables (one sync) would."""
    case = make_case(seqs=decode_seqs([70, 45, 0], pools=2, n_q=3), page_sizes=(16, 32), group=2,
                     seed=4)
    host_q = case.q_indptr.cpu()
    assert all(op.host is not None for op in case.operands)      # build_paged_kv keeps them
    synced = plan_paged_attention(case.q, case.q_indptr, case.operands, num_splits=2)
    hosted = plan_paged_attention(case.q, case.q_indptr, case.operands, num_splits=2,
                                  host_q_indptr=host_q)
    meta_ops = [_on_meta(op) for op in case.operands]
    meta = plan_paged_attention(case.q.to("meta"), case.q_indptr.to("meta"), meta_ops, num_splits=2,
                                host_q_indptr=host_q)
    for plan in (hosted, meta):
        assert (plan.block_m, plan.group, plan.max_q, plan.num_parts) == \
            (synced.block_m, synced.group, synced.max_q, synced.num_parts)
        for a, b in zip(plan.operands, synced.operands):
            assert (a.num_splits, a.pages_per_split, a.part_base) == (b.num_splits, b.pages_per_split, b.part_base)
    for a, b in zip(hosted.operands, synced.operands):
        for name in ("page_pos", "page_len", "batch_page"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(hosted.work_b, synced.work_b) and torch.equal(hosted.work_qb, synced.work_qb)
    out, lse = paged_attention_triton(case.q, case.q_indptr, case.q_pos, case.operands,
                                      out_dtype=torch.float32, host_q_indptr=host_q)
    check(out, lse, *expected(case), torch.float32)
    with pytest.raises(NotImplementedError):      # without host copies the plan reads the device
        plan_paged_attention(case.q.to("meta"), case.q_indptr.to("meta"), meta_ops, num_splits=2)
    bad = case.operands[0]                        # host tables are validated like device ones
    ids = bad.host.page_ids.clone()
    ids[0] = bad.kv.shape[0]
    forged = PagedKV(bad.kv, bad.layer, bad.seg_indptr, bad.seg_page_indptr, bad.seg_start,
                     bad.seg_len, bad.page_ids, host=HostTables(bad.host.seg_indptr, bad.host.seg_page_indptr,
                                                                bad.host.seg_start, bad.host.seg_len, ids))
    with pytest.raises(ShapeError):
        plan_paged_attention(case.q, case.q_indptr, [forged], host_q_indptr=host_q)


def test_upload_ints_keeps_values_and_aligns_each_table():
    """Host-built tables reach the device with their values and shapes, each 16-byte aligned
    (Triton specializes on pointer alignment); on the CPU they are the tensors themselves."""
    gen = torch.Generator().manual_seed(6)
    tables = [torch.randint(-50, 50, (n,), generator=gen, dtype=torch.int32) for n in (3, 0, 5, 1, 8)]
    tables.append(torch.randint(0, 9, (2, 3), generator=gen, dtype=torch.int32))
    got = upload_ints(tables, torch.device(DEVICE))
    for t, g in zip(tables, got):
        assert g.device.type == DEVICE and g.shape == t.shape and torch.equal(g.cpu(), t)
        assert g.data_ptr() % 16 == 0 or g.numel() == 0 or DEVICE == "cpu"
        if DEVICE == "cpu":
            assert g is t


def test_no_operands_and_no_queries():
    q = torch.randn(3, 4, 64, device=DEVICE)
    idx = lambda x: torch.tensor(x, dtype=INDEX_DTYPE, device=DEVICE)
    out, lse = paged_attention_triton(q, idx([0, 3]), idx([0, 1, 2]), [])
    assert (out == 0).all() and torch.isinf(lse).all()
    seqs = decode_seqs([20], n_q=1)
    case = make_case(seqs=seqs)
    out, lse = paged_attention_triton(case.q[:0], idx([0, 0]), idx([]), case.operands)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_torch_and_triton_backends_agree():
    seqs = decode_seqs([120, 64], pools=2, n_q=4, base=3)
    # the torch path multiplies whole pages, so tails must be finite here
    case = make_case(page_sizes=(16, 64), seqs=seqs, group=4, seed=9, poison=1e4)
    ops = case.operands
    if DEVICE == "cuda":  # the torch path on the CPU, the Triton path on the GPU
        cpu_ops = [PagedKV(op.kv.cpu(), op.layer, op.seg_indptr.cpu(), op.seg_page_indptr.cpu(),
                           op.seg_start.cpu(), op.seg_len.cpu(), op.page_ids.cpu()) for op in ops]
        a = paged_attention(case.q.cpu(), case.q_indptr.cpu(), case.q_pos.cpu(), cpu_ops,
                            backend="torch")
    else:
        a = paged_attention(case.q, case.q_indptr, case.q_pos, ops, backend="torch")
    b = paged_attention(case.q, case.q_indptr, case.q_pos, ops, backend="triton")
    assert rel_err(b[0].cpu(), a[0]) <= 1e-4
    assert (b[1].cpu() - a[1]).abs().max() <= 1e-4
    auto = paged_attention(case.q, case.q_indptr, case.q_pos, ops)
    assert auto[0].device == case.q.device


def test_int64_addressing_beyond_2gib():
    """Page ids whose element offset (not only byte offset) exceeds 2**31, where int32 address
    arithmetic would wrap: a ~4.4 GB fp16 pool from ``torch.empty`` (only the pages used here
    are ever touched), written by write_kv and read by attention at its far end."""
    layers, size, heads, dim = 1, 256, 4, 128  # fp16: 256 Ki elements (512 KiB) per page
    page_elems = layers * 2 * size * heads * dim
    num_pages = (2**31 + (32 << 20)) // page_elems + 1
    kv = torch.empty((num_pages, layers, 2, size, heads, dim), dtype=torch.float16, device=DEVICE)
    far = [num_pages - 1, num_pages - 3, 5]  # the first two lie past 2**31 elements
    assert far[0] * page_elems > 2**31 and far[1] * page_elems > 2**31
    for p in far:
        kv[p] = float("nan")
    n = 2 * size + 40
    gen = torch.Generator().manual_seed(1)
    k = torch.randn((layers, n, heads, dim), generator=gen).half().to(DEVICE)
    v = torch.randn((layers, n, heads, dim), generator=gen).half().to(DEVICE)
    tok = torch.arange(n)
    page_ids = torch.tensor(far, dtype=INDEX_DTYPE)[tok // size].to(DEVICE)
    offsets = (tok % size).to(INDEX_DTYPE).to(DEVICE)
    write_kv_triton(kv, k, v, page_ids, offsets)
    for i in (0, size - 1, size, n - 1):
        p, o = page_ids[i].item(), offsets[i].item()
        assert torch.equal(kv[p, 0, 0, o], k[0, i]) and torch.equal(kv[p, 0, 1, o], v[0, i])
    op = build_paged_kv(kv, 0, [[(far, 100, n)]])
    q = torch.randn((2, heads * 2, dim), generator=gen).half().to(DEVICE)
    idx = lambda x: torch.tensor(x, dtype=INDEX_DTYPE, device=DEVICE)
    q_pos = idx([100 + n - 1, 100 + size])
    out, lse = paged_attention_triton(q, idx([0, 2]), q_pos, [op], out_dtype=torch.float32,
                                      num_splits=2)
    ref_out, ref_lse = oracle_attention(q.cpu(), q_pos.cpu(), k[0].cpu(), v[0].cpu(),
                                        torch.arange(100, 100 + n), True)
    check(out, lse, ref_out, ref_lse, torch.float16)
    del kv


# ---------------------------------------------------------------------------------------------
# merge


def _oracle_merge(outs, lses):
    lse = torch.stack([s.double() for s in lses])
    m = lse.amax(0)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)
    total = w.sum(0)
    out = sum(o.double().nan_to_num() * wi[..., None] for o, wi in zip(outs, w))
    out = out / total.clamp_min(1e-300)[..., None]
    return out, torch.where(total > 0, m_safe + torch.log(total), torch.full_like(total, -math.inf))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 5, 70])
def test_merge_states(dtype, n, tiles):
    gen = torch.Generator().manual_seed(n)
    t, h, d = 9, 4, 80
    outs = [torch.randn((t, h, d), generator=gen).to(dtype) for _ in range(n)]
    lses = [torch.randn((t, h), generator=gen) * 4 for _ in range(n)]
    for i in range(n):  # empty partials: lse -inf (their out is NaN to prove it is not read)
        lses[i][i % t, :] = -math.inf
        outs[i][i % t, :] = float("nan")
    for i in range(n):  # a row empty in every partial
        lses[i][t - 1, 1] = -math.inf
        outs[i][t - 1, 1] = float("nan")
    ref_out, ref_lse = _oracle_merge(outs, lses)
    dev = [o.to(DEVICE) for o in outs], [s.to(DEVICE) for s in lses]
    out, lse = merge_attention_states(*dev, backend="triton", out_dtype=torch.float32)
    check(out, lse, ref_out, ref_lse, dtype, out_tol=1e-5 if dtype == torch.float32 else 1e-3)
    assert out[t - 1, 1].abs().max() == 0 and lse[t - 1, 1] == -math.inf
    # the in-place form with poisoned output buffers
    out_buf = torch.full((t, h, d), float("nan"), dtype=dtype, device=DEVICE)
    lse_buf = torch.full((t, h), float("nan"), device=DEVICE)
    merge_partials(torch.stack(dev[0]), torch.stack(dev[1]), out_buf, lse_buf)
    check(out_buf, lse_buf, ref_out, ref_lse, dtype,
          out_tol={torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: BF16_OUT_TOL}[dtype])


def test_merge_backends_agree():
    gen = torch.Generator().manual_seed(4)
    outs = [torch.randn((5, 2, 64), generator=gen) for _ in range(3)]
    lses = [torch.randn((5, 2), generator=gen) for _ in range(3)]
    lses[1][2] = -math.inf
    outs[1][2] = 0.0
    a = merge_attention_states(outs, lses, backend="torch")
    b = merge_attention_states([o.to(DEVICE) for o in outs], [s.to(DEVICE) for s in lses],
                               backend="triton")
    assert (a[0] - b[0].cpu()).abs().max() <= 1e-5
    assert torch.allclose(a[1], b[1].cpu(), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# write


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_write_kv(dtype, head_dim, tiles):
    gen = torch.Generator().manual_seed(head_dim)
    pages, layers, size, heads = 7, 3, 16, 2
    kv = torch.full((pages, layers, 2, size, heads, head_dim), float("nan"), dtype=dtype)
    n = 37
    slots = torch.randperm(pages * size, generator=gen)[:n]  # distinct slots, shuffled pages
    page_ids, offsets = (slots // size).to(INDEX_DTYPE), (slots % size).to(INDEX_DTYPE)
    k = torch.randn((layers, n, heads, head_dim), generator=gen).to(dtype)
    v = torch.randn((layers, n, heads, head_dim), generator=gen).to(dtype)
    want = kv.clone()
    want[page_ids.long(), :, 0, offsets.long()] = k.transpose(0, 1)
    want[page_ids.long(), :, 1, offsets.long()] = v.transpose(0, 1)
    got = kv.to(DEVICE)
    write_kv(got, k.to(DEVICE), v.to(DEVICE), page_ids.to(DEVICE), offsets.to(DEVICE),
             backend="triton")
    assert torch.equal(got.cpu().nan_to_num(7.0), want.nan_to_num(7.0))  # untouched slots stay
    ref = kv.clone()
    write_kv(ref, k, v, page_ids, offsets, backend="torch")
    assert torch.equal(got.cpu().nan_to_num(7.0), ref.nan_to_num(7.0))


def test_write_kv_strided_sources_and_cast():
    gen = torch.Generator().manual_seed(2)
    kv = torch.full((4, 2, 2, 32, 2, 96), float("nan"), dtype=torch.float16, device=DEVICE)
    big = torch.randn((2, 10, 2, 2, 96), generator=gen).to(DEVICE)  # k, v as strided views
    k, v = big[:, :, 0], big[:, :, 1]
    page_ids = torch.tensor([3, 3, 0, 1, 2, 2, 0, 1, 3, 0], dtype=INDEX_DTYPE, device=DEVICE)
    offsets = torch.tensor([0, 31, 5, 6, 7, 8, 9, 10, 11, 12], dtype=INDEX_DTYPE, device=DEVICE)
    write_kv_triton(kv, k, v, page_ids, offsets)
    for i in range(10):
        p, o = page_ids[i].item(), offsets[i].item()
        assert torch.equal(kv[p, :, 0, o], k[:, i].half())
        assert torch.equal(kv[p, :, 1, o], v[:, i].half())


# ---------------------------------------------------------------------------------------------
# bad input raises typed errors (and writes nothing)


def _small_case():
    return make_case(seqs=decode_seqs([40, 20], n_q=1), group=2, seed=1)


def test_bad_index_dtypes_raise():
    case = _small_case()
    op = case.operands[0]
    bad = PagedKV(op.kv, op.layer, op.seg_indptr.long(), op.seg_page_indptr, op.seg_start,
                  op.seg_len, op.page_ids)
    with pytest.raises(DTypeError):
        paged_attention(case.q, case.q_indptr, case.q_pos, [bad], backend="triton")
    with pytest.raises(DTypeError):
        paged_attention(case.q, case.q_indptr.long(), case.q_pos, case.operands, backend="triton")
    with pytest.raises(DTypeError):
        paged_attention(case.q, case.q_indptr, case.q_pos.long(), case.operands, backend="triton")
    with pytest.raises(DTypeError):
        paged_attention(case.q.to(torch.int32), case.q_indptr, case.q_pos, case.operands,
                        backend="triton")


def test_bad_shapes_raise():
    case = _small_case()
    op = case.operands[0]
    with pytest.raises(ShapeError):  # head-dim mismatch
        paged_attention(case.q[..., :32], case.q_indptr, case.q_pos, [op], backend="triton")
    with pytest.raises(ShapeError):  # layer out of range
        paged_attention(case.q, case.q_indptr, case.q_pos,
                        [PagedKV(op.kv, 2, op.seg_indptr, op.seg_page_indptr, op.seg_start,
                                 op.seg_len, op.page_ids)], backend="triton")
    with pytest.raises(ShapeError):  # query heads not a multiple of KV heads
        paged_attention(case.q[:, :3], case.q_indptr, case.q_pos, [op], backend="triton")
    with pytest.raises(ShapeError):  # page id outside the pool
        ids = op.page_ids.clone()
        ids[0] = op.kv.shape[0]
        paged_attention(case.q, case.q_indptr, case.q_pos,
                        [PagedKV(op.kv, 1, op.seg_indptr, op.seg_page_indptr, op.seg_start,
                                 op.seg_len, ids)], backend="triton")
    with pytest.raises(ShapeError):  # q_indptr does not cover the queries
        bad = case.q_indptr.clone()
        bad[-1] -= 1
        paged_attention(case.q, bad, case.q_pos, [op], backend="triton")
    with pytest.raises(ConfigError):
        paged_attention(case.q, case.q_indptr, case.q_pos, [op], backend="cuda")


def test_bad_writes_raise_and_write_nothing():
    kv = torch.randn((3, 2, 2, 16, 2, 64), device=DEVICE)
    before = kv.clone()
    k = torch.randn((2, 4, 2, 64), device=DEVICE)
    ids = torch.tensor([0, 1, 2, 0], dtype=INDEX_DTYPE, device=DEVICE)
    offs = torch.tensor([0, 1, 2, 3], dtype=INDEX_DTYPE, device=DEVICE)
    with pytest.raises(DTypeError):
        write_kv(kv, k, k, ids.long(), offs, backend="triton")
    with pytest.raises(ShapeError):
        write_kv(kv, k, k, ids.clamp_min(3), offs, backend="triton")
    with pytest.raises(ShapeError):
        write_kv(kv, k, k, ids, offs + 13, backend="triton")
    with pytest.raises(ShapeError):
        write_kv(kv, k[..., :32], k[..., :32], ids, offs, backend="triton")
    with pytest.raises(ShapeError):
        write_kv(kv, k[:1], k[:1], ids, offs, backend="triton")
    assert torch.equal(kv, before)


# ---------------------------------------------------------------------------------------------
# the package without triton (every variant compiling for sm_80 / sm_90 / sm_100 is
# benchmarks/kernels/kernel_compile.py's check: ./run kernels-compile)


def test_kernels_package_imports_without_triton_or_ray():
    """``import mmtier.attention.kernels`` (with ``mmtier.pages.kernels``) and the torch path work where triton cannot be imported, and
    never pull in Ray; ``backend="triton"`` then raises a typed error."""
    import subprocess
    import sys
    from pathlib import Path

    code = r'''
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("triton", "ray"):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import torch
import mmtier.attention.kernels as k
from mmtier.errors import ConfigError
assert not k.triton_available()
kv = torch.randn(4, 1, 2, 16, 2, 64)
op = k.build_paged_kv(kv, 0, [[([2, 0], 0, 20)]])
i32 = lambda x: torch.tensor(x, dtype=torch.int32)
out, lse = k.paged_attention(torch.randn(1, 4, 64), i32([0, 1]), i32([19]), [op])
assert out.shape == (1, 4, 64) and torch.isfinite(lse).all()
try:
    k.paged_attention(torch.randn(1, 4, 64), i32([0, 1]), i32([19]), [op], backend="triton")
except ConfigError:
    pass
else:
    raise AssertionError("backend='triton' without triton must raise ConfigError")
assert not any(m.split(".")[0] in ("triton", "ray") for m in sys.modules)
print("ok")
'''
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(root)]))}
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-4000:]
