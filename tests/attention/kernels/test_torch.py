"""The torch attention path (``reference`` + ``unmasked``) against the float64 oracle.

The torch path splits an item's pages into those that need no mask (every written token
visible to every query: the fused flash kernel, over full pages in place or gathered, and over
the written slots of partial pages) and those crossing the queries' causal boundary (the
masked loop). These cases mix them on purpose: long runs of consecutive page ids next to
scattered pages in one operand, partial last pages, causal boundaries inside a gather chunk,
several queries at different positions, GQA groups of 4 and 7, 16-bit pools with float32 and
16-bit queries, a non-contiguous pool view, and the fallback when the flash op is missing or
raises.

Every case draws fresh random inputs; unlisted pages and unwritten slots hold NaN, so reading
anything not given fails loudly. The path computes in float32 whatever the input dtypes (it
widens 16-bit pages, never narrows the query), so its float32 output must match the oracle
(run on the same rounded inputs) to float32 accuracy for every dtype pair.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from mmtier.attention.kernels import paged_attention, reference, small, unmasked
from mmtier.attention.kernels.layout import PagedKV, build_paged_kv
from mmtier.pages.kernels import INDEX_DTYPE
from tests.support.oracle import oracle_attention, rel_err

OUT_TOL = 2e-5   # float32 arithmetic over a few thousand keys, relative to max |out|
LSE_TOL = 2e-5


@dataclass
class Seg:
    start: int
    length: int
    kind: str = "run"        # "run": consecutive page ids; "scatter": random free ids


@dataclass
class Item:
    segments: list[Seg]
    q_pos: list[int]


@dataclass
class Case:
    q: torch.Tensor
    q_indptr: torch.Tensor
    q_pos: torch.Tensor
    op: PagedKV
    items: list[Item]


def make_case(items: list[Item], *, size=16, hkv=1, group=4, head_dim=64, layers=3, layer=1,
              pool_dtype=torch.float32, q_dtype=torch.float32, seed=0, strided_pool=False) -> Case:
    """One pool shared by every item. ``run`` segments take consecutive ids from the low end
    of the pool, ``scatter`` segments random ids from the rest (shuffled), so one operand holds
    both; unlisted pages and the unwritten tail of last pages are NaN."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    pages_of = lambda seg: -(-seg.length // size)
    n_run = sum(pages_of(s) for it in items for s in it.segments if s.kind == "run")
    n_scatter = sum(pages_of(s) for it in items for s in it.segments if s.kind == "scatter")
    num_pages = n_run + n_scatter + 5
    shape = (num_pages, layers + 1 if strided_pool else layers, 2, size, hkv, head_dim)
    full = torch.full(shape, math.nan, dtype=pool_dtype)
    # a pool view that is not contiguous (one spare layer sliced off) takes the copying gather
    kv = full[:, 1:] if strided_pool else full
    run_cursor = 2                                    # page 0, 1 stay unused (NaN)
    scatter_ids = list(range(n_run + 2, num_pages))
    rng.shuffle(scatter_ids)
    tables = []
    for it in items:
        table = []
        for seg in it.segments:
            n = pages_of(seg)
            if seg.kind == "run":
                pages = list(range(run_cursor, run_cursor + n))
                run_cursor += n
            else:
                pages = [scatter_ids.pop() for _ in range(n)]
            for j, page in enumerate(pages):
                filled = min(size, seg.length - j * size)
                data = torch.randn((layers, 2, filled, hkv, head_dim), generator=gen)
                kv[page, :, :, :filled] = data.to(pool_dtype)
            table.append((pages, seg.start, seg.length))
        tables.append(table)
    op = build_paged_kv(kv, layer, tables)
    q_pos = [p for it in items for p in it.q_pos]
    q = torch.randn((len(q_pos), hkv * group, head_dim), generator=gen).to(q_dtype)
    q_indptr = [0]
    for it in items:
        q_indptr.append(q_indptr[-1] + len(it.q_pos))
    idx = lambda x: torch.tensor(x, dtype=INDEX_DTYPE)
    return Case(q, idx(q_indptr), idx(q_pos), op, items)


def expected(case: Case, causal=True, scale=None):
    """Float64 oracle over the pages each item lists, read back from the pool."""
    outs, lses = [], []
    bounds = case.q_indptr.tolist()
    page_lists = case.op.page_ids.tolist()
    seg_ptr = case.op.seg_page_indptr.tolist()
    seg = 0
    for b, it in enumerate(case.items):
        ks, vs, ps = [], [], []
        for s in it.segments:
            pages = page_lists[seg_ptr[seg]:seg_ptr[seg + 1]]
            seg += 1
            kv = case.op.kv[pages, case.op.layer]              # [n, 2, P, Hkv, D]
            ks.append(kv[:, 0].flatten(0, 1)[:s.length])
            vs.append(kv[:, 1].flatten(0, 1)[:s.length])
            ps.append(torch.arange(s.start, s.start + s.length))
        q = case.q[bounds[b]:bounds[b + 1]]
        o, lse = oracle_attention(q, case.q_pos[bounds[b]:bounds[b + 1]], torch.cat(ks),
                                  torch.cat(vs), torch.cat(ps), causal, scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def run_and_check(case: Case, *, causal=True, scale=None):
    ref_out, ref_lse = expected(case, causal, scale)
    out, lse = paged_attention(case.q, case.q_indptr, case.q_pos, [case.op], causal=causal,
                               scale=scale, backend="torch", out_dtype=torch.float32)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "rows that see no key must have lse -inf"
    assert (lse[empty] < 0).all() and (out[empty] == 0).all()
    if (~empty).any():
        assert rel_err(out, ref_out) <= OUT_TOL, rel_err(out, ref_out)
        err = (lse[~empty].double() - ref_lse[~empty]).abs().max().item()
        assert err <= LSE_TOL, err
    default, _ = paged_attention(case.q, case.q_indptr, case.q_pos, [case.op], causal=causal,
                                 scale=scale, backend="torch")
    assert default.dtype == case.q.dtype
    return out, lse


@pytest.fixture
def calls(monkeypatch):
    """Counts calls of the flash op (unmasked pages) and of the masked loop (the rest); the
    small case's single pass (``test_kernels_small``) is off, so the general path runs."""
    monkeypatch.setattr(small, "SMALL_TOKENS", 0)
    counts = {"flash": 0, "masked": 0}
    flash, masked = unmasked.FLASH_OP, reference._masked_attention

    def counted_flash(*a, **k):
        counts["flash"] += 1
        return flash(*a, **k)

    def counted_masked(*a, **k):
        counts["masked"] += 1
        return masked(*a, **k)

    monkeypatch.setattr(unmasked, "FLASH_OP", counted_flash)
    monkeypatch.setattr(reference, "_masked_attention", counted_masked)
    return counts


def mixed_items(n_q=1):
    """Item 0: a long run, scattered pages, a partial last page, a short run; decode (or the
    last ``n_q`` positions). Item 1: scattered, then a run ending in a partial page."""
    a = [Seg(0, 1200), Seg(1200, 333, "scatter"), Seg(1533, 250), Seg(1783, 71, "scatter")]
    b = [Seg(5, 400, "scatter"), Seg(405, 517)]
    return [Item(a, list(range(1854 - n_q, 1854))), Item(b, list(range(922 - n_q, 922)))]


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("gather_bytes", [64 << 10, unmasked.GATHER_BYTES])
def test_runs_and_scattered_pages_in_one_operand(calls, monkeypatch, gather_bytes, in_place):
    """Small chunks cut runs and scattered stretches into many chunks (consecutive and not,
    a ragged last one); the default size takes them in a few. Consecutive chunks are read in
    place (pages as the kernel's batch) or copied, depending on the page size."""
    monkeypatch.setattr(unmasked, "GATHER_BYTES", gather_bytes)
    monkeypatch.setattr(unmasked, "IN_PLACE_MIN", 0 if in_place else 1 << 30)
    run_and_check(make_case(mixed_items(), seed=1))
    assert calls["flash"] > 0 and calls["masked"] == 0       # decode: nothing needs a mask
    run_and_check(make_case(mixed_items(n_q=5), seed=2))
    assert calls["masked"] > 0


@pytest.mark.parametrize("group,hkv", [(4, 1), (7, 1), (4, 2), (7, 3)])
def test_gqa_groups(calls, group, hkv):
    run_and_check(make_case(mixed_items(), group=group, hkv=hkv, seed=2 + group + hkv))
    assert calls["flash"] > 0


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("pool_dtype,q_dtype", [
    (torch.float32, torch.float32),
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
])
def test_dtypes_and_head_dims(calls, pool_dtype, q_dtype, head_dim):
    """16-bit pages are widened, a float32 query is never narrowed: float32 accuracy in all."""
    case = make_case(mixed_items(), pool_dtype=pool_dtype, q_dtype=q_dtype, head_dim=head_dim,
                     seed=head_dim)
    run_and_check(case)
    assert calls["flash"] > 0


@pytest.mark.parametrize("q_dtype,size,strided", [
    (torch.bfloat16, 16, False), (torch.bfloat16, 64, True), (torch.float32, 64, False), (torch.float32, 16, True),
])
def test_bf16_pages_widened_in_blocks(calls, monkeypatch, q_dtype, size, strided):
    """The blocked path over bfloat16 pages at Qwen2.5-VL's head dim (128) and GQA group (7):
    chunks that are runs of consecutive pages are widened to float32 by one strided copy each
    (``_copy_run``, into a buffer poisoned with NaN first), scattered chunks are gathered and
    widened, and every partial state merges to float32 accuracy against the float64 oracle.
    Fresh random inputs each run (the seed is in the message)."""
    seed = random.SystemRandom().randrange(1 << 30)
    widened, copy_run = [], unmasked._copy_run

    def poisoned(op, first, n, out):
        out.fill_(math.nan)
        widened.append(n)
        return copy_run(op, first, n, out)

    monkeypatch.setattr(unmasked, "_copy_run", poisoned)
    monkeypatch.setattr(unmasked, "GATHER_BYTES", 1 << 20)     # several chunks per run
    case = make_case(mixed_items(), size=size, hkv=2, group=7, head_dim=128, pool_dtype=torch.bfloat16,
                     q_dtype=q_dtype, seed=seed, strided_pool=strided)
    try:
        run_and_check(case)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from e
    assert len(widened) > 1 and calls["flash"] > len(widened) and calls["masked"] == 0


def test_several_queries_causal_boundary_inside_a_chunk(calls, monkeypatch):
    """Queries at scattered positions: pages below the first query need no mask, pages
    between the first and the last query are masked per query, pages past the last are
    never read."""
    monkeypatch.setattr(unmasked, "GATHER_BYTES", 256 << 10)
    segs = [Seg(0, 900), Seg(900, 300, "scatter"), Seg(1200, 700)]
    items = [Item(segs, [613, 700, 701, 1300, 1555, 1899])]
    run_and_check(make_case(items, group=4, hkv=2, seed=7))
    assert calls["flash"] > 0 and calls["masked"] > 0


def test_queries_on_page_boundaries_and_before_every_key(calls):
    """Item 0 decodes at the last slot of a full page (only full pages); item 1's first
    query precedes every key (lse -inf, out 0) while its second sees some."""
    items = [Item([Seg(0, 512), Seg(512, 256, "scatter")], [767]),
             Item([Seg(100, 64, "scatter"), Seg(164, 160)], [50, 230])]
    run_and_check(make_case(items, seed=8))
    assert calls["flash"] > 0


def test_many_short_segments(calls, monkeypatch):
    """Dozens of partly written pages (one per short segment, NaN past the written slots)
    gathered token by token over several chunks, next to a few full pages."""
    monkeypatch.setattr(unmasked, "GATHER_BYTES", 64 << 10)
    segs = [Seg(9 * i, 1 + i % 9, "scatter" if i % 3 else "run") for i in range(40)] + [Seg(360, 100)]
    run_and_check(make_case([Item(segs, [459]), Item(segs[:5], [44, 45])], seed=15))
    assert calls["flash"] > 0


def test_noncausal_cross_attention_with_partial_pages(calls):
    items = [Item([Seg(0, 577), Seg(1000, 333, "scatter")], [3, 4000]),
             Item([Seg(0, 64, "scatter"), Seg(64, 1500)], [0])]
    case = make_case(items, group=7, seed=9)
    run_and_check(case, causal=False)
    run_and_check(case, causal=False, scale=0.3)
    assert calls["flash"] > 0


@pytest.mark.parametrize("size", [16, 64])
def test_non_contiguous_pool_view(calls, size):
    """A pool view that is not contiguous takes the copying gather (no row view), or is read
    in place (64-token pages)."""
    run_and_check(make_case(mixed_items(n_q=3), size=size, hkv=2, strided_pool=True, seed=10))
    assert calls["flash"] > 0


@pytest.mark.parametrize("threads", [1, 3, 7])
def test_parts_per_chunk(monkeypatch, threads):
    """The gathered chunk is cut into as many key sequences as threads (a divisor of its
    tokens): any count merges to the same exact result."""
    monkeypatch.setattr(unmasked.torch, "get_num_threads", lambda: threads)
    run_and_check(make_case(mixed_items(n_q=2), seed=11 + threads))


def test_two_pools_of_different_page_sizes():
    """Two operands (text pages of 16, vision pages of 64), merged across operands."""
    gen_items = mixed_items()
    a = make_case(gen_items, size=16, seed=12)
    b = make_case(gen_items, size=64, seed=13)
    b = Case(a.q, a.q_indptr, a.q_pos, b.op, b.items)
    out, lse = paged_attention(a.q, a.q_indptr, a.q_pos, [a.op, b.op], backend="torch",
                               out_dtype=torch.float32)
    (oa, la), (ob, lb) = expected(a), expected(b)
    m = torch.maximum(la, lb)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    ref_out = (oa * wa[..., None] + ob * wb[..., None]) / (wa + wb)[..., None]
    assert rel_err(out, ref_out) <= OUT_TOL
    assert (lse.double() - (m + torch.log(wa + wb))).abs().max() <= LSE_TOL


@pytest.mark.parametrize("how", ["missing", "raises"])
def test_fallback_when_flash_op_is_missing_or_raises(monkeypatch, how):
    """Without the private op the masked loop serves every page, with the same results."""
    tried = []

    def broken(*a, **k):
        tried.append(1)
        raise RuntimeError("unsupported")

    monkeypatch.setattr(unmasked, "FLASH_OP", None if how == "missing" else broken)
    case = make_case(mixed_items(n_q=2), group=7, pool_dtype=torch.bfloat16, seed=14)
    run_and_check(case)
    assert bool(tried) == (how == "raises")
