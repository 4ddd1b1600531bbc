"""The policy replay (``benchmarks.eviction.policyreplay``) against the whole cache
(``benchmarks.eviction.cachereplay``): the same hits, stores and evictions for every policy, Belady
and per-page LRU, on the first requests of the checked-in heavy-tailed sample at 5% of its distinct
bytes (the benchmark checks 5% and 10% on more requests: ``cache_parity_mismatches``); the policy
replay against an independent replay of the published form (``benchmarks.eviction.blockreplay``: one
group per hash id, capacity in blocks), request by request, with the cache's keys and with its own;
pools of exactly the asked size (a chain larger than the pool runs uncached past what fits); and the
Mooncake-format importer on lines of that form."""

from __future__ import annotations

import pytest

from benchmarks.eviction.blockreplay import block_replay, capacity_for
from benchmarks.eviction.cachereplay import bench_config, replay
from benchmarks.eviction.chains import (
    ChainTrace,
    TraceFormatError,
    from_records,
    load_jsonl,
    parse_record,
)
from benchmarks.eviction.eviction import PAGE, SAMPLE, pages_for
from benchmarks.eviction.heavytail import HeavyTailConfig, generate
from benchmarks.eviction.policyreplay import replay_policy, trace_keys
from benchmarks.eviction.recompute import load_costs
from mmtier.config import CacheConfig
from mmtier.eviction import POLICIES

COSTS = load_costs()


@pytest.fixture(scope="module")
def short() -> ChainTrace:
    t = load_jsonl(SAMPLE, name="sample")
    return ChainTrace(t.name, t.items, t.requests[:60])


@pytest.mark.parametrize("policy", [*POLICIES, "belady", "page_lru"])
def test_policy_replay_equals_the_cache(short, policy):
    pages, _ = pages_for(short, 0.05)
    keys = trace_keys(short, bench_config(short, pages, PAGE, "lru", COSTS))
    a = replay(short, policy, pages, COSTS, PAGE)
    b = replay_policy(short, policy, pages, COSTS, PAGE, keys)
    assert a.evictions > 0                       # the pools were full: eviction decided the hits
    assert ((b.hit_tokens, b.hit_blocks, b.puts, b.evictions, b.uncached)
            == (a.hit_tokens, a.hit_blocks, a.puts, a.evictions, a.uncached))
    assert b.hit_blocks_by_request == a.hit_blocks_by_request
    assert b.ops > b.puts


@pytest.fixture(scope="module")
def text_records() -> list[dict]:
    """A prefix-hash trace in the published form, text only (each hash id one block)."""
    recs = generate(HeavyTailConfig(seed=3, requests=160, duration_s=288.0, p_image=0.0, p_audio=0.0))
    assert any(r["input_length"] % 512 for r in recs)           # partial last blocks
    return recs


@pytest.mark.parametrize("frac", [0.05, 0.1])
def test_independent_block_replay_agrees_request_by_request(text_records, frac):
    trace = from_records(text_records, 512, "text")
    cap = capacity_for(text_records, frac)
    uid_of = {}
    for rec, r in zip(text_records, trace.requests, strict=True):
        uid_of.update(zip(rec["hash_ids"], r.chain, strict=True))
    keys = trace_keys(trace, bench_config(trace, {"text": cap}, 512, "lru", COSTS))
    for policy in POLICIES:
        a = block_replay(text_records, policy, cap, key_of=lambda h: keys[uid_of[h]])
        b = replay_policy(trace, policy, {"text": cap}, COSTS, 512, keys)
        assert a.evictions == b.evictions > 0, policy
        assert a.per_request == b.hit_blocks_by_request, policy
        assert (a.hit_blocks, a.hit_tokens, a.uncached) == (b.hit_blocks, b.hit_tokens, b.uncached), policy
        assert a.avoided_fraction == pytest.approx(b.avoided_fraction), policy
    # with its own keys (digests of the hash ids): the policies that read no hash agree too
    for policy in ("lru", "s3fifo", "arc", "adaptive_slru"):
        a = block_replay(text_records, policy, cap)
        b = replay_policy(trace, policy, {"text": cap}, COSTS, 512, keys)
        assert a.per_request == b.hit_blocks_by_request, policy


def test_pools_hold_exactly_their_size_and_a_long_chain_runs_uncached():
    lines = [{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 3]},
             {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
             {"timestamp": 2, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 3]}]
    trace = from_records(lines, 512, "long")
    for res in (replay(trace, "lru", {"text": 2}, COSTS, 512),
                replay_policy(trace, "lru", {"text": 2}, COSTS, 512)):
        # request 0 holds blocks 1, 2 (the pool's two pages): block 3 is not stored; request 1
        # hits both; request 2 again stores no block 3
        assert res.hit_blocks_by_request == [0, 2, 2]
        assert (res.uncached, res.overflow, res.evictions) == (2, 2, 0)
        assert res.block_hit_ratio == 4 / 8 and res.hit_ratio == 2048 / (1500 + 1024 + 1500)
    got = block_replay(lines, "lru", 2)
    assert got.per_request == [0, 2, 2] and got.uncached == 2


def test_mooncake_lines_chain_their_blocks():
    lines = ['{"timestamp": 0, "input_length": 1100, "output_length": 6, "hash_ids": [0, 1, 2]}',
             '{"timestamp": 40, "input_length": 600, "output_length": 3, "hash_ids": [0, 7]}']
    t = from_records([parse_record(s, i + 1, 512) for i, s in enumerate(lines)], 512, "mc")
    a, b = t.requests
    assert [t.items[u].tokens for u in a.chain] == [512, 512, 76]
    assert b.chain[0] == a.chain[0] and t.items[b.chain[1]].parent == a.chain[0]
    assert b.time == 0.04
    with pytest.raises(TraceFormatError, match="hash_ids"):
        parse_record('{"timestamp": 0, "input_length": 1100, "output_length": 6, "hash_ids": [0, 1]}', 3, 512)


@pytest.mark.parametrize("frac", [0.05, 0.1])
def test_independent_replay_agrees_on_the_conversation_trace(frac):
    """Mooncake's conversation trace (checked in): the project's replay and the independent one,
    request by request, for the default policy at the capacities of the lift (the benchmark checks
    every policy: ``independent_replay_mismatches``)."""
    from benchmarks.eviction.blockreplay import read_records
    from benchmarks.eviction.eviction import CONV, CONVERSATION

    records = read_records(CONVERSATION)
    trace = from_records(records, 512, CONV)
    cap = capacity_for(records, frac)
    uid_of = {}
    for rec, r in zip(records, trace.requests, strict=True):
        uid_of.update(zip(rec["hash_ids"], r.chain, strict=True))
    keys = trace_keys(trace, bench_config(trace, {"text": cap}, 512, "lru", COSTS))
    for policy in (CacheConfig.model_fields["eviction_policy"].default,):
        a = block_replay(records, policy, cap, key_of=lambda h: keys[uid_of[h]])
        b = replay_policy(trace, policy, {"text": cap}, COSTS, 512, keys)
        assert a.evictions == b.evictions > 0, policy
        assert a.per_request == b.hit_blocks_by_request, policy
        assert (a.hit_blocks, a.hit_tokens, a.uncached) == (b.hit_blocks, b.hit_tokens, b.uncached), policy
