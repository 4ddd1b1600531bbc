"""mmtier's vLLM connector in real vLLM engines (vLLM's CPU build): the scheduler, model runner
and KV connector loop of ``vllm.LLM``, on tiny random-weight models this module builds and
saves. Every scenario compares greedy tokens with a plain engine (no connector) under the same
settings and counts cached tokens as vLLM reports them (``RequestOutput.num_cached_tokens``),
with vLLM's own prefix caching off (they all come from mmtier) and on (the plain oracle then has
it too). ``tests/engines/test_vllm_dropin.py`` adds vLLM's prefix cache over a pool too small to keep
what mmtier brings back, and the bit-level oracle. Each scenario runs in a
process of its own (``tests/support/vllm_scenarios.py``), as vLLM's spawned processes want.

Needs the engines environment (``./run engines``); skipped with the reason otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="no vLLM engine here: run ./run engines "
                    "(vLLM's CPU build in .venv-engines); ./run test then runs this file there")

from tests.support import engine_runs  # noqa: E402
from tests.support.vllm_models import BLOCK, build_llama  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"llama": str(build_llama(root / "llama"))}


def scenario(name: str, tmp: Path, **args) -> dict:
    return engine_runs.scenario("tests.support.vllm_scenarios", name, tmp, **args)


# vLLM's own prefix cache off (every cached token is mmtier's) and on (how users serve: every
# engine of the scenario, mmtier's and the plain oracle, has it); the in-process executor runs
# with it off only (its point is the executor). The scenarios over a disk directory (corrupt,
# shared_disk) run with it off: with it on and a roomy pool vLLM's own blocks answer the
# repeats and mmtier's files go unread; tests/engines/test_vllm_dropin.py runs vLLM's prefix cache
# over a pool too small to keep what mmtier brings back, restart from disk included
RUNS = [pytest.param("mp", False, id="mp"), pytest.param("uni", False, id="uni"),
        pytest.param("mp", True, id="mp-prefix-cache")]
PREFIX = [pytest.param(False, id="no-prefix-cache"), pytest.param(True, id="prefix-cache")]


def tokens(rows: list[dict]) -> list[list[int]]:
    return [r["tokens"] for r in rows]


def cached(rows: list[dict]) -> list[int]:
    return [r["cached"] for r in rows]


@pytest.mark.parametrize("executor, prefix_caching", RUNS)
def test_repeats_and_shared_prefixes_hit_and_a_changed_token_hits_up_to_its_block(models, tmp_path, executor,
                                                                                  prefix_caching):
    """``mp`` is vLLM's default (engine core and worker in processes of their own, no Ray):
    the worker's cache answers the scheduler through the lookup channel."""
    r = scenario("hits", tmp_path, model=models["llama"], executor=executor, prefix_caching=prefix_caching)
    # a 301-token prompt: 9 full blocks (288) hit; 230 shared tokens: 7 blocks (224);
    # token 100 changed: the blocks before it (96)
    assert cached(r["mmtier"]) == [0, 288, 7 * BLOCK, 3 * BLOCK]
    # vLLM's own prefix cache (a roomy pool) hits the same tokens; without it, nothing
    assert cached(r["plain"]) == ([0, 288, 7 * BLOCK, 3 * BLOCK] if prefix_caching else [0, 0, 0, 0])
    assert tokens(r["mmtier"]) == tokens(r["plain"])


@pytest.mark.parametrize("executor, prefix_caching", RUNS)
def test_preemption_and_resume_while_mmtier_holds_the_prefixes(models, tmp_path, executor, prefix_caching):
    r = scenario("preemption", tmp_path, model=models["llama"], executor=executor, prefix_caching=prefix_caching)
    assert r["mmtier_preemptions"] > 0 and r["plain_preemptions"] > 0     # vLLM did preempt
    assert tokens(r["plain"]) == tokens(r["roomy"])                        # vLLM alone is exact
    assert tokens(r["mmtier"]) == tokens(r["plain"])
    assert cached(r["mmtier"])[:3] == [288, 288, 288]        # the warmed prompts hit at admission
    if executor == "uni":
        # every token the connector reported as a hit was loaded, resumed requests' included
        # (a resumed request's hit used to be reported and never loaded: its blocks kept
        # whatever they held, and a tiny model's greedy tokens do not always show it)
        counts = r["counts"]
        assert counts["resumed_loads"] > 0
        assert counts["load_tokens"] == counts["hit_tokens"] > 3 * 288


@pytest.mark.parametrize("prefix_caching", PREFIX)
def test_chunked_prefill_of_prompts_longer_than_a_step(models, tmp_path, prefix_caching):
    r = scenario("chunked", tmp_path, model=models["llama"], prefix_caching=prefix_caching)
    assert cached(r["mmtier"]) == [0, 672, 0, 512]           # 700 -> 21 blocks; 520 -> 16 blocks
    assert tokens(r["mmtier"]) == tokens(r["plain"])


@pytest.mark.parametrize("prefix_caching", PREFIX)
def test_bf16_pages(models, tmp_path, prefix_caching):
    r = scenario("bf16", tmp_path, model=models["llama"], prefix_caching=prefix_caching)
    assert cached(r["mmtier"]) == [0, 384]
    assert tokens(r["mmtier"]) == tokens(r["plain"])


def test_a_corrupt_stored_group_is_recomputed_by_vllm_tokens_equal(models, tmp_path):
    r = scenario("corrupt", tmp_path, model=models["llama"])
    assert r["files"] > 1
    assert tokens(r["mmtier"]) == tokens(r["plain"])
    # the bad copy is out of the way (quarantine/ keeps it under its name and a unique suffix)
    assert [q for q in r["quarantined"] if q.startswith(r["victim"] + ".")] != []


@pytest.mark.parametrize("prefix_caching", PREFIX)
def test_two_lora_adapters_on_one_prompt_never_share_kv(models, tmp_path, prefix_caching):
    r = scenario("lora", tmp_path, model=models["llama"], prefix_caching=prefix_caching)
    # order: a, a, b, b, base: each adapter hits only what it saved itself
    assert cached(r["mmtier"]) == [0, 288, 0, 288, 0]
    assert tokens(r["mmtier"]) == tokens(r["plain"])
    assert tokens(r["plain"])[0] != tokens(r["plain"])[2]    # the adapters do change the tokens


def test_two_engine_processes_over_one_disk_directory_share_it_and_keep_each_others_files(models, tmp_path):
    r = scenario("shared_disk", tmp_path, model=models["llama"])
    assert cached(r["a_first"]) == [0, 0, 0]
    assert cached(r["b_first"]) == [288, 288]            # B hits what A spilled to the directory
    assert cached(r["b_again"]) == [288]                 # and again after B's restart
    assert cached(r["a_again"]) == [288]                 # A still has its own groups
    assert set(r["files_after_a"]) <= set(r["files_at_end"]) and r["quarantined"] == []
    assert tokens(r["a_first"]) == tokens(r["plain"])
    assert tokens(r["b_first"]) == tokens(r["plain"])[:2] and tokens(r["b_again"]) == tokens(r["plain"])[:1]


@pytest.mark.ray
def test_two_engine_processes_share_through_the_cluster(models, tmp_path):
    r = scenario("cluster", tmp_path, model=models["llama"])
    assert cached(r["a"]) == [0, 0]
    assert cached(r["b"]) == [288, 288]
    assert tokens(r["a"]) == tokens(r["b"]) == tokens(r["plain"])
