"""mmtier turned on the way a vLLM user turns it on, with vLLM itself as the oracle: no connector
for a miss, vLLM's own prefix cache for a hit, in float32 and bfloat16; the connector given only
sizes; vLLM's prefix cache on with a block pool smaller than the working set. Real engines
(vLLM's CPU build) in processes of their own (``tests/support/vllm_dropin_scenarios.py``).

Needs the engines environment (``./run engines``); skipped with the reason otherwise."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="no vLLM engine here: run ./run engines "
                    "(vLLM's CPU build in .venv-engines); ./run test then runs this file there")

from tests.support import engine_runs  # noqa: E402
from tests.support.vllm_models import BLOCK, build_llama  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_llama(tmp_path_factory.mktemp("models") / "llama"))


def scenario(name: str, tmp: Path, **args) -> dict:
    return engine_runs.scenario("tests.support.vllm_dropin_scenarios", name, tmp, **args)


def tokens(rows):
    return [r["tokens"] for r in rows]


def cached(rows):
    return [r["cached"] for r in rows]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_is_the_oracle_miss_equals_no_connector_hit_equals_its_own_prefix_cache(model, tmp_path, dtype):
    r = scenario("oracle", tmp_path, model=model, dtype=dtype)
    full = r["full_blocks"] * BLOCK
    plain, own, mine = r["plain"][0], r["prefix_cache"], r["mmtier"]
    assert cached(own) == [0, full] and cached(mine) == [0, full]
    # mmtier adds nothing to what vLLM computes with a connector in its loop: a miss is the run
    # of an engine whose connector does nothing, to the last bit of every logprob ...
    noop = r["noop"][0]
    assert mine[0]["logprobs"] == noop["logprobs"] and mine[0]["tokens"] == noop["tokens"]
    # ... and, where vLLM's connector path leaves its numerics alone (every CPU and dtype seen
    # here), the plain engine's; vLLM's CPU backend chose the same kernels
    if noop["logprobs"] != plain["logprobs"]:
        warnings.warn(f"vLLM with a do-nothing KV connector computes otherwise than without one ({dtype}): "
                      "mmtier's miss is held to the do-nothing connector's bits", stacklevel=1)
    else:
        assert mine[0]["logprobs"] == plain["logprobs"] and mine[0]["tokens"] == plain["tokens"]
    assert r["mmtier_isa"] == r["plain_isa"] == r["prefix_cache_isa"]
    # a hit is vLLM's own prefix-cache hit, to the last bit (the same KV, the same suffix computation)
    assert mine[1]["logprobs"] == own[1]["logprobs"] and mine[1]["tokens"] == own[1]["tokens"]
    assert own[0]["logprobs"] == plain["logprobs"]
    # the KV mmtier stored, and the KV it loaded into other blocks of vLLM's, is bit-equal to
    # the KV vLLM computed for those blocks
    assert r["kv_nonzero"]
    assert r["stored_bit_equal"]
    assert r["loaded_blocks_differ_from_first"] and r["loaded_bit_equal"]


def test_an_engine_with_mmtier_computes_on_the_threads_of_the_same_engine_without_it(tmp_path):
    """vLLM's CPU build keeps a core back for any KV connector (its mp executor, 'auto' binding):
    an engine with a connector computed on another number of OpenMP threads than without, and
    bf16 sums in another order (the first issue-34 report: another answer with nothing loaded,
    on an Intel Xeon). With mmtier's connector the worker binds as the plain engine's does
    (``mmtier.engines.vllm.threads``); a connector that does nothing shows what vLLM alone
    does. A tiny Gemma 3 in bf16, vLLM's default executor and its prefix cache on."""
    r = scenario("threads", tmp_path)
    assert r["mmtier_threads"] == r["plain_threads"]
    if len(os.sched_getaffinity(0)) >= 2:              # with one CPU vLLM has no core to keep back
        assert r["noop_threads"]["threads"] != r["plain_threads"]["threads"]     # vLLM's own binding
    mine, plain = r["mmtier"], r["plain"]
    assert mine["cached"] == 0 and mine["tokens"] == plain["tokens"] and mine["logprobs"] == plain["logprobs"]
    # the repeat from mmtier (vLLM's own cache reset) is vLLM's own prefix-cache hit, bit for bit
    hit, own = r["mmtier_hit"], r["plain_hit"]
    assert hit["cached"] == own["cached"] > 0
    assert hit["tokens"] == own["tokens"] and hit["logprobs"] == own["logprobs"]


def test_a_connector_given_only_sizes_starts_and_hits_and_a_wrong_shape_is_refused(model, tmp_path):
    r = scenario("sizes_only", tmp_path, model=model)
    assert cached(r["flat"]) == [0, 0, 0, 288] and r["files"] > 0
    assert cached(r["flat_restart"]) == [288]                   # from the disk tier after a restart
    assert cached(r["bare"]) == [0, 288]                        # no extra config at all
    want = tokens(r["plain"])
    assert tokens(r["flat"]) == [want[0], want[1], want[2], want[0]]
    assert tokens(r["flat_restart"]) == [want[1]] and tokens(r["bare"]) == [want[0], want[0]]
    assert r["wrong_shape"] is not None
    assert "ConfigError" in r["wrong_shape"] and "num_kv_heads" in r["wrong_shape"]
    assert "4" in r["wrong_shape"] and "2" in r["wrong_shape"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllms_prefix_cache_on_with_a_small_pool_what_vllm_lost_comes_from_mmtier(model, tmp_path, dtype):
    r = scenario("evicted", tmp_path, model=model, dtype=dtype)
    mine, plain = r["mmtier"], r["plain"]
    assert tokens(mine) == tokens(plain)
    # A again after four fillers: vLLM's own cache lost it (the plain engine recomputes it) ...
    assert cached(plain)[5] == 0
    # ... and mmtier brings back exactly what vLLM lost: every hit is local or external, the
    # external part is the rest of the full blocks
    assert cached(mine)[5] == 288 and mine[5]["local"] + mine[5]["external"] == 288
    assert mine[5]["external"] == 288 - mine[5]["local"] > 0
    assert cached(mine)[6] == 224 == mine[6]["local"] + mine[6]["external"]
    for row in mine[:5]:
        assert row["external"] == 0                              # nothing to bring back yet
    assert all(p["external"] == 0 for p in plain)
