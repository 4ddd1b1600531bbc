"""Hybrid models through mmtier's vLLM connector with vLLM's hybrid allocator on (the connector
implements ``SupportsHMA``), on vLLM's CPU build (``tests/vllm_hybrid_scenarios.py``):

- a tiny Gemma 3 (sliding-window layers of 64 tokens, full-attention layers): a prompt vLLM's
  own prefix cache lost is a hit from mmtier (its sliding layers loaded with the last window
  only), under preemption, after a restart from disk, and with a corrupt group (the request is
  recomputed); greedy tokens equal a plain engine's, which has the hybrid allocator on too;
- a tiny Qwen3-Next (Gated DeltaNet + full attention): refused at start-up with the reason.

Needs the engines environment (``./run engines``); skipped with the reason otherwise."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="no vLLM engine here: run ./run engines "
                    "(vLLM's CPU build in .venv-engines); ./run test then runs this file there")

from tests import engine_runs  # noqa: E402
from tests.engine_runs import column  # noqa: E402


def scenario(name: str, tmp_path) -> dict:
    return engine_runs.scenario("tests.vllm_hybrid_scenarios", name, tmp_path)


def test_a_gemma3_with_the_hybrid_allocator_on_hits_restarts_and_recomputes_a_corrupt_group(tmp_path):
    r = scenario("gemma3", tmp_path)
    # vLLM kept its hybrid allocator on, with mmtier's connector as without it
    assert r["hybrid_on"] is True and r["plain_hybrid_on"] is True
    # a prompt, four fillers that push it out of vLLM's 56-block pool, the prompt again: every
    # full block but the last token's (9 x 32) from mmtier; vLLM alone recomputes it
    assert column(r["first"], "cached") == [0, 0, 0, 0, 0, 288]
    assert column(r["plain"], "cached") == [0, 0, 0, 0, 0, 0]
    assert column(r["first"], "tokens") == column(r["plain"], "tokens")
    # a batch vLLM preempts in (both engines): the same tokens
    assert r["preemptions"] > 0 and r["plain_preemptions"] > 0
    assert column(r["batch"], "tokens") == column(r["plain_batch"], "tokens")
    # a restarted engine over the same disk directory: the hit, the same tokens
    assert column(r["restart"], "cached") == [288]
    assert column(r["restart"], "tokens") == [r["plain"][0]["tokens"]]
    # the prompt's 5th group flipped on disk: its load fails, vLLM recomputes the request (the
    # groups before it hit again on the retry), the file is quarantined, the same tokens
    assert column(r["corrupt"], "cached") == [128]
    assert column(r["corrupt"], "tokens") == [r["plain"][0]["tokens"]]
    assert len(r["quarantined"]) == 1 and r["quarantined"][0].startswith(r["victim"])


def test_a_qwen3_next_is_refused_at_startup_with_the_reason(tmp_path):
    """Its Gated DeltaNet layers keep a recurrent state, which mmtier does not store: a
    ConfigError that says so (was: vLLM's 'Failed to promote local KV cache specs')."""
    r = scenario("qwen3_next", tmp_path)
    assert r["refused"] is True and r["type"] == "ConfigError"
    assert "recurrent state" in r["message"] and "MambaSpec" in r["message"]


def test_each_group_reads_its_own_table_and_a_let_go_block_is_no_slot():
    from mmtier.integrations.vllm_hybrid import KVGroups, chunk_blocks_within, group_slots

    # full attention holds blocks 5, 6, 7; the sliding group let its first block go (null, 0)
    # and holds 9, 4 after it
    got = group_slots([[5, 6, 7], [0, 9, 4]], 30, 70, 32)
    pos = list(range(30, 70))
    assert got[0].tolist() == [[5, 6, 7][p // 32] * 32 + p % 32 for p in pos]
    assert got[1].tolist() == [-1 if p < 32 else [0, 9, 4][p // 32] * 32 + p % 32 for p in pos]
    # past a table's end: no slot either (a group with fewer blocks)
    assert group_slots([[3]], 20, 40, 32)[0].tolist() == [3 * 32 + p for p in range(20, 32)] + [-1] * 8
    # text chunks stay within the smallest sliding window (in blocks), at least one block
    groups = KVGroups({"a": 0, "b": 1}, (None, 128))
    assert chunk_blocks_within(groups, 32, 16) == 4
    assert chunk_blocks_within(KVGroups({"a": 0, "b": 1}, (None, 16)), 32, 16) == 1
    assert chunk_blocks_within(KVGroups({"a": 0, "b": 1}, (None, None)), 32, 16) == 16
