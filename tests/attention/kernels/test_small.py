"""The torch path's small case (``mmtier.attention.kernels.small``): one batch item over few
pages, every operand in one masked softmax. Checked against the float64 oracle with fresh random
pages, unwritten slots and unlisted pages NaN (``make_case``), across operands of different page
sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmtier.attention.kernels import paged_attention, reference, small
from tests.attention.kernels.test_torch import LSE_TOL, OUT_TOL, Item, Seg, make_case, run_and_check
from tests.support.oracle import oracle_attention, rel_err


@pytest.fixture
def taken(monkeypatch):
    """How often the small case answered (not ``None``)."""
    counts = {"small": 0}
    real = reference.small_attention

    def counted(*a, **k):
        r = real(*a, **k)
        counts["small"] += r is not None
        return r

    monkeypatch.setattr(reference, "small_attention", counted)
    return counts


def _oracle_over(q_case, cases):
    """The float64 oracle of ``q_case``'s queries (causal) over every segment of the first item
    of each ``(case, operand)``, read from the operand's pages at its layer."""
    ks, vs, ps = [], [], []
    for case, op in cases:
        pages = op.page_ids.tolist()
        ptr = op.seg_page_indptr.tolist()
        for i, s in enumerate(case.items[0].segments):
            kv = op.kv[pages[ptr[i]:ptr[i + 1]], op.layer]
            ks.append(kv[:, 0].flatten(0, 1)[:s.length])
            vs.append(kv[:, 1].flatten(0, 1)[:s.length])
            ps.append(torch.arange(s.start, s.start + s.length))
    return oracle_attention(q_case.q, q_case.q_pos, torch.cat(ks), torch.cat(vs), torch.cat(ps), True, None)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_pos", [[1310], [700, 701, 1300], [5]])
def test_one_item_matches_the_oracle(taken, causal, q_pos):
    segs = [Seg(0, 300), Seg(300, 77, "scatter"), Seg(377, 900), Seg(1277, 40, "scatter")]
    case = make_case([Item(segs, q_pos)], group=2, hkv=2, seed=len(q_pos) + causal)
    run_and_check(case, causal=causal)
    assert taken["small"] >= 1


def test_operands_of_different_page_sizes_merge_exactly(taken):
    """Two pools (page sizes 16 and 8) of one sequence: one pass equals the oracle over both."""
    a = make_case([Item([Seg(0, 130), Seg(130, 20, "scatter")], [300])], size=16, hkv=2, group=2, seed=1)
    b = make_case([Item([Seg(150, 100, "scatter"), Seg(250, 51)], [300])], size=8, hkv=2, group=2, seed=2)
    out, lse = paged_attention(a.q, a.q_indptr, a.q_pos, [a.op, b.op], causal=True, backend="torch",
                               out_dtype=torch.float32)
    assert taken["small"] == 1
    ref_out, ref_lse = _oracle_over(a, [(a, a.op), (b, b.op)])
    assert rel_err(out, ref_out) <= OUT_TOL
    assert (lse.double() - ref_lse).abs().max().item() <= LSE_TOL


def test_large_or_batched_cases_take_the_general_path(taken):
    big = make_case([Item([Seg(0, small.SMALL_TOKENS + 16)], [small.SMALL_TOKENS + 15])], seed=3)
    run_and_check(big)
    two = make_case([Item([Seg(0, 40)], [39]), Item([Seg(0, 20)], [19])], seed=4)
    run_and_check(two)
    assert taken["small"] == 0


def test_pools_of_one_arena_are_gathered_together(taken):
    """Two pools carved from one storage (as the cache's arena is): the one-gather path over
    both equals the oracle, at every layer."""
    a = make_case([Item([Seg(0, 130), Seg(130, 20, "scatter")], [300])], size=16, hkv=2, group=2, seed=5)
    b = make_case([Item([Seg(150, 100, "scatter"), Seg(250, 51)], [300])], size=8, hkv=2, group=2, seed=6)
    row = a.op.num_kv_heads * a.op.head_dim
    arena = torch.full((a.op.kv.numel() + 3 * row + b.op.kv.numel(),), float("nan"))
    kv_a = arena[:a.op.kv.numel()].view(a.op.kv.shape)
    kv_b = arena[a.op.kv.numel() + 3 * row:].view(b.op.kv.shape)     # a gap of three token rows
    kv_a.copy_(a.op.kv)
    kv_b.copy_(b.op.kv)
    for layer in range(a.op.kv.shape[1]):
        ops = [dataclasses.replace(a.op, kv=kv_a, layer=layer), dataclasses.replace(b.op, kv=kv_b, layer=layer)]
        out, lse = paged_attention(a.q, a.q_indptr, a.q_pos, ops, causal=True, backend="torch",
                                   out_dtype=torch.float32)
        ref_out, ref_lse = _oracle_over(a, [(a, ops[0]), (b, ops[1])])
        assert rel_err(out, ref_out) <= OUT_TOL
        assert (lse.double() - ref_lse).abs().max().item() <= LSE_TOL
    assert taken["small"] == a.op.kv.shape[1]
    assert small._slots([ops[0], ops[1]], torch.device("cpu")).rows is not None


@pytest.mark.parametrize("group", [1, 3])
def test_a_prefill_chunk_takes_the_causal_square_and_matches_the_oracle(taken, monkeypatch, group):
    """Queries that are exactly the last keys, in order (a prefill chunk): the fused kernel over
    the causal square and the unmasked past, merged by log-sum-exp; and a query set with a gap in
    its keys keeps the masked softmax."""
    squares = []
    real = small._flash_square
    monkeypatch.setattr(small, "_flash_square", lambda *a, **k: squares.append(real(*a, **k)) or squares[-1])
    segs = [Seg(0, 300), Seg(300, 77, "scatter"), Seg(377, 40)]
    case = make_case([Item(segs, list(range(377, 417)))], group=group, hkv=2, seed=7 + group)
    run_and_check(case, causal=True)
    whole = make_case([Item([Seg(0, 33, "scatter")], list(range(33)))], group=group, hkv=2, seed=9)   # no past
    run_and_check(whole, causal=True)
    n = len(squares)
    assert n >= 2 and all(s is not None for s in squares)
    gap = make_case([Item(segs, [380, 381, 390])], group=group, hkv=2, seed=11)
    run_and_check(gap, causal=True)
    assert len(squares) == n and taken["small"] > n


def test_a_prefill_chunk_over_two_pools_takes_the_causal_square(taken, monkeypatch):
    """A chunk over an image then a text span (one forward over the two runs a turn lacks): its
    keys sit in two operands, out of position order; put in order, they are the causal square,
    and the result equals the float64 oracle."""
    squares = []
    real = small._flash_square
    monkeypatch.setattr(small, "_flash_square", lambda *a, **k: squares.append(real(*a, **k)) or squares[-1])
    chunk = list(range(230, 290))
    a = make_case([Item([Seg(0, 130), Seg(260, 30)], chunk)], size=16, hkv=2, group=2, seed=21)   # text
    b = make_case([Item([Seg(130, 100, "scatter"), Seg(230, 30)], chunk)], size=8, hkv=2, group=2, seed=22)
    out, lse = paged_attention(a.q, a.q_indptr, a.q_pos, [a.op, b.op], causal=True, backend="torch",
                               out_dtype=torch.float32)
    assert taken["small"] == 1 and len(squares) == 1 and squares[0] is not None
    ref_out, ref_lse = _oracle_over(a, [(a, a.op), (b, b.op)])
    assert rel_err(out, ref_out) <= OUT_TOL
    assert (lse.double() - ref_lse).abs().max().item() <= LSE_TOL
