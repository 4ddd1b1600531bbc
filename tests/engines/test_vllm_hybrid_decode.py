"""Decode saves for hybrid models, vLLM's hybrid allocator on (vLLM's CPU build): a two-turn chat
whose second prompt is the first prompt + its answer + a new message, vLLM's own cache reset
between the turns, finds the previous answer's whole blocks in mmtier, and its greedy tokens and
logprobs (bf16) are bit-equal to vLLM's own prefix-cache hit on the same tokens:

- the tiny Gemma 3 (5 sliding-window layers of 64 tokens : 1 full): each generated chunk is
  saved as it fills, every layer read through its own group's table, before the sliding window
  lets any of it go;
- the tiny Qwen3-Next (3 Gated DeltaNet : 1 full attention): with each decode group the
  recurrent state at its end, read where vLLM still holds it (a chunk flushed the step after it
  filled) or from the worker's copy of it (an answer that ends a block later: vLLM freed it).

One engine per model (``tests/support/vllm_hybrid_decode_scenarios.py``). Needs the engines
environment (``./run engines``); skipped with the reason otherwise."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="no vLLM engine here: run ./run engines "
                    "(vLLM's CPU build in .venv-engines); ./run test then runs this file there")

from tests.support import engine_runs  # noqa: E402


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
def test_the_next_turn_finds_the_previous_answer_as_vllms_own_prefix_cache_does(family, tmp_path):
    r = engine_runs.scenario("tests.support.vllm_hybrid_decode_scenarios", "chat", tmp_path, family=family)
    assert r["save_decode"] is True, r["hybrid"]
    bs = r["block_size"]
    for conv in r["conversations"]:
        (own_first, own), (first, mine) = conv["oracle"], conv["mmtier"]
        # the whole blocks of turn 1's prompt and answer, past the prompt's (a decode group's)
        previous = conv["previous"]
        assert previous == (300 + conv["answer"] - 1) // bs * bs > 300
        # vLLM's own cache hits them all (mmtier loaded nothing: its keys are another salt's)
        assert own["cached"] == previous and own["from_mmtier"] == 0, conv["answer"]
        # vLLM's cache reset: every one of them from mmtier (no more: the new message is not held).
        # Qwen3-Next's 190-token answer ends 9 tokens past a block: its last state is the worker's
        # copy (with none taken, seen while building this: the hit stopped a block short, 384)
        assert mine["cached"] == previous == mine["from_mmtier"], (conv["answer"], mine["cached"], previous)
        assert first["tokens"] == own_first["tokens"] and first["cached"] == 0
        assert mine["tokens"] == own["tokens"] and mine["logprobs"] == own["logprobs"], conv["answer"]
    assert r["decode_saves"]["groups"] > 0
