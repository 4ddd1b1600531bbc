"""Hybrid models through mmtier's vLLM connector with vLLM's hybrid allocator on (the connector
implements ``SupportsHMA``), on vLLM's CPU build (``tests/support/vllm_hybrid_scenarios.py``):

- a tiny Gemma 3 (sliding-window layers of 64 tokens, full-attention layers): a prompt vLLM's
  own prefix cache lost is a hit from mmtier (its sliding layers loaded with the last window
  only), under preemption, after a restart from disk, and with a corrupt group (the request is
  recomputed); greedy tokens equal a plain engine's, which has the hybrid allocator on too;
- a tiny Qwen3-Next (Gated DeltaNet + full attention): a hit restores the attention KV and the
  recurrent state (logprobs equal vLLM's own), through a restart; a corrupt state is a miss;
  without prefix caching the connector is refused with the reason.

Needs the engines environment (``./run engines``); skipped with the reason otherwise."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="no vLLM engine here: run ./run engines "
                    "(vLLM's CPU build in .venv-engines); ./run test then runs this file there")

from tests.support import engine_runs  # noqa: E402
from tests.support.engine_runs import column  # noqa: E402


def scenario(name: str, tmp_path) -> dict:
    return engine_runs.scenario("tests.support.vllm_hybrid_scenarios", name, tmp_path)


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


def test_a_qwen3_next_hit_restores_the_attention_kv_and_the_recurrent_state(tmp_path):
    """Its Gated DeltaNet layers keep a state, not KV per position: mmtier stores the state
    where a prefill step ends (vLLM's 'align' mode, prefix caching on) as groups of their own,
    and a hit ends only where one is held. Logprobs equal bit for bit: a state restored at half
    its values moves them (seen while building this), though not this tiny model's tokens."""
    r = scenario("qwen3_next", tmp_path)
    assert r["hybrid_on"] is True
    bs = r["block_size"]                      # vLLM aligns its blocks with the state's page (96 here)
    hit = (300 - 1) // bs * bs                # the last step boundary before the last token
    miss, after_reset = r["mmtier"]
    plain_miss, plain_hit = r["plain"]
    assert miss["cached"] == 0 and after_reset["cached"] == hit > 0
    assert plain_hit["cached"] == hit         # vLLM's own prefix cache hits as far
    for row in (miss, after_reset, plain_hit, *r["restart"], *r["corrupt"]):
        assert row["tokens"] == plain_miss["tokens"]
        assert row["logprobs"] == plain_miss["logprobs"]
    # the conv and the recurrent state, a file each per saved state (the prompt's, the batch's)
    assert r["state_files"].count("state0") == r["state_files"].count("state1") >= 1
    # a batch vLLM preempts in (resumed requests hit mmtier's KV and state): the same tokens as
    # a plain engine's until, at most, a position where the plain engine's two best logprobs
    # nearly tie (bf16: vLLM recomputes a preempted request in other splits; seen: an exact
    # tie), logprobs within 0.1 up to and at it (a state restored wrong moves them further)
    assert r["preemptions"] > 0 and r["plain_preemptions"] > 0
    equal = 0
    for mine, plain in zip(r["batch"], r["plain_batch"]):
        d = next((i for i, (a, b) in enumerate(zip(mine["tokens"], plain["tokens"])) if a != b), None)
        if d is None:
            equal += 1
            continue
        first, second = plain["top2"][d]
        assert first - second < 0.05, (d, plain["top2"][d], mine["top2"][d])
        assert abs(mine["top2"][d][0] - first) < 0.1, (d, plain["top2"][d], mine["top2"][d])
        assert all(abs(a[0] - b[0]) < 0.1 for a, b in zip(mine["top2"][:d], plain["top2"][:d]))
    # how many stay equal to the end is chance (CI saw 3 of 5, here 4 and 5): a divergence after
    # a near tie carries on, and this random-weight model's top two are often within 0.05
    assert equal >= 1
    assert r["restart"][0]["cached"] == hit               # restarted over the disk directory
    # every stored recurrent state flipped on disk: the state is not loaded, nothing is hit
    # without it (vLLM recomputes the prompt), the file is quarantined
    assert r["corrupt"][0]["cached"] == 0 and r["quarantined"] == ["state1"]   # the prompt's, read
    # without prefix caching vLLM keeps no state per block: refused with the reason
    off = r["off"]
    assert off["refused"] is True and off["type"] == "ConfigError"
    assert "mamba_cache_mode 'none'" in off["message"] and "prefix caching on" in off["message"]


def test_each_group_reads_its_own_table_and_a_let_go_block_is_no_slot():
    from mmtier.engines.vllm.hybrid import KVGroups, chunk_blocks_within, group_slots

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
