"""mmtier's vLLM connector in tensor-parallel engines (vLLM's CPU build, mp executor, a worker
per rank): each worker saves and loads its own shard of every group under its shard's key, the
scheduler reports a hit only for the groups every worker holds, and a group one worker fails
to load is recomputed by vLLM on all of them. Tokens are compared with a plain engine of the
same settings (``tests/support/vllm_parallel_scenarios.py``, one process per scenario).

Needs the engines environment (``./run engines``); skipped with the reason otherwise."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="no vLLM engine here: run ./run engines "
                    "(vLLM's CPU build in .venv-engines); ./run test then runs this file there")

from tests.support import engine_runs  # noqa: E402
from tests.support.vllm_mm_models import build_llava  # noqa: E402
from tests.support.vllm_models import BLOCK, build_llama  # noqa: E402


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    model = str(build_llama(tmp_path_factory.mktemp("models") / "llama"))
    return engine_runs.scenario("tests.support.vllm_parallel_scenarios", "tp2", tmp_path_factory.mktemp("tp2"),
                                model=model)


def tokens(rows: list[dict]) -> list[list[int]]:
    return [r["tokens"] for r in rows]


def cached(rows: list[dict]) -> list[int]:
    return [r["cached"] for r in rows]


def test_tensor_parallel_repeats_and_shared_prefixes_hit_tokens_equal(tp2):
    # a 301-token prompt: 9 full blocks hit; 230 shared tokens: 7 blocks; token 100 changed: 3
    assert cached(tp2["mmtier"]) == [0, 9 * BLOCK, 7 * BLOCK, 3 * BLOCK]
    assert cached(tp2["plain"]) == [0, 0, 0, 0]
    assert tokens(tp2["mmtier"]) == tokens(tp2["plain"])


def test_each_worker_stores_its_own_shard_under_its_shards_key(tp2):
    assert tp2["shard_files"] == [9, 9]          # every block of the prompt, on both workers
    assert tp2["unsharded_files"] == 0           # nothing under the group's own key


def test_tensor_parallel_preemption_and_resume_tokens_equal(tp2):
    assert tp2["mmtier_preemptions"] > 0 and tp2["plain_preemptions"] > 0
    assert tokens(tp2["mmtier_batch"]) == tokens(tp2["plain_batch"])


def test_a_group_one_worker_cannot_load_is_recomputed_and_the_hit_is_what_every_worker_holds(tp2):
    restart = tp2["restart"]
    assert tokens(restart) == [tokens(tp2["plain"])[0], tokens(tp2["plain"])[2]]
    # the flipped file is out of the way, under its name and a unique suffix
    assert [q for q in tp2["quarantined"] if q.startswith(tp2["victim"] + ".")] != []
    # after it: worker 1 holds the shared prefix's first 4 groups, worker 0 all 7
    assert cached(restart)[1] == 4 * BLOCK


def test_the_encoder_cache_connector_at_tp2_skips_the_tower_on_every_rank(tmp_path_factory):
    """Encoder outputs are whole on every rank (vLLM computes them on each): each rank's cache
    keeps the item under its own key, and a repeat skips the vision tower on both."""
    model = str(build_llava(tmp_path_factory.mktemp("models") / "llava"))
    r = engine_runs.scenario("tests.support.vllm_parallel_scenarios", "tp2_ec", tmp_path_factory.mktemp("tp2-ec"),
                             model=model)
    # images A, B, C, D, A: the tower runs once per rank for each new image, on neither for A again
    assert [row["encoded"] for row in r["ec"]] == [2, 2, 2, 2, 0]
    assert [row["encoded"] for row in r["plain"]] == [2, 2, 2, 2, 2]
    assert tokens(r["ec"]) == tokens(r["plain"])
