"""A sequence's compiled device operands (``CompiledOperands``) are reused across layers and
steps while nothing moved, and compiled again when anything did: the sequence grew, one of its
groups left the device or came back on other pages, or the sequence was released. Every answer
is checked against the float64 oracle, so a stale table (old lengths, old pages now holding
other K/V) fails."""

from __future__ import annotations

import pytest
import torch

from mmtier import TieredKVCache
from mmtier.attention.kernels import build_paged_kv
from mmtier.core.groups import Tier
from mmtier.errors import ShapeError
from tests.cache.test_tiers import D, L, kv, make_cfg
from tests.support.oracle import Logical, oracle_attention, rel_err

HQ = 4


def check(cache, seq, logical, n_q=2):
    """Attention of fresh queries at every layer equals the oracle over what ``logical`` holds."""
    for layer in range(L):
        q = torch.randn(n_q, HQ, D)
        k, v, pos = logical.gathered(layer)
        t = k.shape[0]
        expect, _ = oracle_attention(q, torch.arange(t - n_q, t), k, v, pos)
        out = cache.attention(seq, layer, q)
        assert rel_err(out, expect) < 1e-5


def test_reused_across_layers_and_steps_recompiled_when_the_sequence_grows(tmp_path, backend):
    with TieredKVCache(make_cfg(backend, tmp_path)) as cache:
        seq, logical = cache.create_sequence(), Logical()
        key = cache.content_key("vision", b"img")
        k, v = kv(40)
        cache.put(key, k, v)
        cache.attach(seq, key)
        logical.add(k, v, "img")
        k, v = kv(10)
        cache.append(seq, "text", k, v)
        logical.add(k, v, "text")
        before = cache.planner.compiled.compiles
        check(cache, seq, logical)
        check(cache, seq, logical)                 # a second step: nothing moved
        assert cache.planner.compiled.compiles == before + 1
        k, v = kv(3)                               # grows within the text run's last page
        cache.append(seq, "text", k, v)
        logical.add(k, v, "text")
        check(cache, seq, logical)
        assert cache.planner.compiled.compiles == before + 2
        k, v = kv(20)                              # grows onto a new page
        cache.append(seq, "text", k, v)
        logical.add(k, v, "text")
        check(cache, seq, logical)
        assert cache.planner.compiled.compiles == before + 3


def test_recompiled_when_a_group_leaves_the_device_and_comes_back(tmp_path, backend):
    """Group A is attended, pushed off the device (its pages reused by other groups) and
    brought back on other pages before the next attention: the segments are the same, only
    A's page list changed, and the operands are compiled again and stay exact."""
    # demote: B's and C's puts push A down (auto would write them around a CPU pool)
    with TieredKVCache(make_cfg(backend, tmp_path, device_pages=4, host_pages=8, put_placement="demote")) as cache:
        seq, logical = cache.create_sequence(), Logical()
        key_a = cache.content_key("vision", b"A")
        ka, va = kv(64)
        cache.put(key_a, ka, va)
        cache.attach(seq, key_a)
        logical.add(ka, va, "A")
        k, v = kv(12)                              # a text run stays on the device throughout
        cache.append(seq, "text", k, v)
        logical.add(k, v, "text")
        check(cache, seq, logical)
        group_a = cache.index.groups[key_a]
        old_pages = list(group_a.pages)
        other = cache.create_sequence()
        for name in (b"B", b"C"):                  # 2 pages each: the 4 device pages
            key = cache.content_key("vision", name)
            cache.put(key, *kv(64))
            cache.attach(other, key)
        cache.flush()
        assert group_a.tier != Tier.DEVICE         # B, C sit on its old pages; no attention
        cache.release(other)                       # in between: only A's page list tells
        cache.attach(cache.create_sequence(), key_a)   # a hit on A brings it back up
        cache.flush()
        assert group_a.tier == Tier.DEVICE
        compiles = cache.planner.compiled.compiles
        check(cache, seq, logical)
        assert cache.planner.compiled.compiles == compiles + 1
        assert group_a.pages != old_pages           # the old table would read B or C


def test_release_forgets_the_sequence(tmp_path, backend):
    with TieredKVCache(make_cfg(backend, tmp_path)) as cache:
        seq, logical = cache.create_sequence(), Logical()
        k, v = kv(30)
        cache.append(seq, "text", k, v)
        logical.add(k, v, "text")
        check(cache, seq, logical)
        assert len(cache.planner.compiled) == 1
        cache.release(seq)                          # its private run is freed
        assert len(cache.planner.compiled) == 0
        seq2, logical2 = cache.create_sequence(), Logical()
        k, v = kv(30)                               # the freed pages, written again
        cache.append(seq2, "text", k, v)
        logical2.add(k, v, "text")
        check(cache, seq2, logical2)


def test_a_remembered_operand_check_still_refuses_another_batch_or_head_dim():
    """``PagedKV.validate`` remembers a passed check per ``(batch, head_dim)`` only."""
    kv_pool = torch.randn(3, L, 2, 16, 2, D)
    op = build_paged_kv(kv_pool, 1, [[([2, 0], 5, 20)]])
    op.validate(1, D)
    op.validate(1, D)                              # remembered
    with pytest.raises(ShapeError):
        op.validate(2, D)
    with pytest.raises(ShapeError):
        op.validate(1, D + 1)
    bad = build_paged_kv(kv_pool, L, [[([1], 0, 4)]])     # layer out of range: never remembered
    for _ in range(2):
        with pytest.raises(ShapeError):
            bad.validate(1, D)
