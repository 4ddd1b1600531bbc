"""mmtier's decode saves in real vLLM engines (vLLM's CPU build, the default multiprocessing
executor): a conversation's next turn, whose prompt repeats the previous prompt and answer token
ids, finds the answer's whole blocks in mmtier (vLLM's own prefix cache off in the mmtier engine:
every cached token is mmtier's), and its greedy tokens and log-probabilities are bit-equal to a
plain engine's hitting the same tokens in vLLM's own prefix cache; a restarted engine finds them
on disk; with ``mmtier_save_decode: false`` the hit stops at the previous prompt, as it did
before decode saves; where the next prompt's ids part from the generated ones (a chat template
re-tokenized the answer), the hit stops at the last whole group before them, never past. Scenarios: ``tests/support/vllm_decode_scenarios.py``.

Needs the engines environment (``./run engines``); skipped with the reason otherwise."""

from __future__ import annotations

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
    return engine_runs.scenario("tests.support.vllm_decode_scenarios", name, tmp, **args)


def same(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


@pytest.mark.parametrize("dtype, restart", [pytest.param("float32", True, id="fp32"),
                                            pytest.param("bfloat16", False, id="bf16")])
def test_the_next_turn_finds_the_previous_answer_and_equals_vllms_own_prefix_cache_hit(model, tmp_path, dtype,
                                                                                         restart):
    r = scenario("turns", tmp_path, model=model, dtype=dtype, restart=restart)
    for mine, plain in zip(r["mmtier"], r["plain"], strict=True):
        first, second = mine
        # 300 prompt tokens + 150 generated: the KV of all but the last token, 14 whole blocks
        # (a whole chunk of the answer saved as it filled, the last part when it finished)
        assert second["previous"] == 448 and second["cached"] == second["previous"]
        assert plain[1]["cached"] == 448                    # vLLM's own cache hits the same tokens
        assert same(first, plain[0]) and same(second, plain[1])
    # decode saves and the hits on them are counted apart from the prompt's
    assert r["phases"].get("puts|decode", 0) == 4 and r["phases"].get("hits|decode", 0) >= 4
    assert r["phases"].get("puts|prompt", 0) > 0
    # the next prompt's ids part from the answer's at 300 + answer index: the hit ends at the last
    # group wholly before (the prompt's 9 whole blocks; the answer's first chunk ends at 384),
    # vLLM's own block by block; tokens equal plain vLLM's, bit-equal where both hit as far
    for name, (at, hit, own) in {"first": (300, 288, 288), "replaced": (400, 384, 384),
                                 "merged": (439, 384, 416)}.items():
        mine, plain = r["parted"][name], r["parted_plain"][name]
        assert mine["cached"] == hit <= at and plain["cached"] == own, (name, mine["cached"], plain["cached"])
        assert mine["tokens"] == plain["tokens"], name
        assert hit != own or mine["logprobs"] == plain["logprobs"], name
    if restart:
        # a fresh engine over the same disk directory: the answer's groups survived
        assert r["restarted"]["cached"] == 448 == r["restarted_plain"]["cached"]
        assert same(r["restarted"], r["restarted_plain"])
        # decode saves off: the next turn's hit stops at the previous prompt's 9 whole blocks
        off, oracle = r["off"], r["off_plain"]
        assert [x["cached"] for x in off] == [0, 9 * BLOCK] and oracle[1]["cached"] == 448
        assert all(same(a, b) for a, b in zip(off, oracle, strict=True))


def _fp8_runs() -> bool:
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


@pytest.mark.parametrize("shape", [
    pytest.param("fp8", id="fp8", marks=pytest.mark.skipif(
        not _fp8_runs(), reason="vLLM's CPU build runs an fp8 KV cache only on x86 with AVX-512 or AMX")),
    pytest.param("uni", id="in-process"), pytest.param("tp2", id="tp2"), pytest.param("lora", id="lora")])
def test_every_engine_shape_saves_the_answer_and_hits_it_as_vllms_own_cache_does(model, tmp_path, shape):
    r = scenario("shapes", tmp_path, model=model, shape=shape)
    (first, second), (plain_first, plain_second) = r["mmtier"], r["plain"]
    # the second turn repeats 300 prompt tokens and the 150-token answer: 448 tokens of whole
    # blocks, every one found (the answer's 5 blocks from decode saves), as vLLM's own cache does
    assert second["previous"] == 448 and second["cached"] == 448 == plain_second["cached"]
    assert same(first, plain_first) and same(second, plain_second)
    assert r["phases"].get("puts|decode", 0) >= 1 and r["phases"].get("hits|decode", 0) >= 1, r["phases"]
    if shape == "lora":
        # the same tokens under another adapter: nothing of adapter a's answer (or prompt) is found
        other, other_plain = r["other_adapter"], r["other_adapter_plain"]
        assert other["cached"] == 0 == other_plain["cached"]
        assert other["tokens"] == other_plain["tokens"]
