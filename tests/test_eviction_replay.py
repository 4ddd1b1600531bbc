"""The policy replay (``benchmarks.policyreplay``) against the whole cache (``benchmarks.cachereplay``):
the same hits, stores and evictions for every policy, Belady and per-page LRU, on the first
requests of the checked-in heavy-tailed sample at 5% of its distinct bytes (the benchmark
checks 5% and 10% on more requests: ``cache_parity_mismatches``); and the
Mooncake-format importer on lines of that form."""

from __future__ import annotations

import pytest

from benchmarks.cachereplay import bench_config, replay
from benchmarks.chains import ChainTrace, TraceFormatError, from_records, load_jsonl, parse_record
from benchmarks.eviction import PAGE, SAMPLE, pages_for
from benchmarks.policyreplay import replay_policy, trace_keys
from benchmarks.recompute import load_costs
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
    assert (b.hit_tokens, b.puts, b.evictions, b.overflow) == (a.hit_tokens, a.puts, a.evictions, a.overflow)
    assert b.ops > b.puts


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
