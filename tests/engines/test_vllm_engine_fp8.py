"""mmtier's vLLM connector in a real vLLM engine with an fp8 KV cache (vLLM's CPU build runs
``kv_cache_dtype="fp8"``, e4m3, where the head size is a multiple of 32 and the CPU has AVX-512
or AMX): the connector reads the cache's dtype from vLLM, its pages are fp8 too, and what it
brings back is what the engine computed, so a repeat hits every full block and answers with
the same tokens as a plain engine with the same fp8 cache. The scenario runs in a process of
its own (``tests/support/vllm_fp8_scenarios.py``).

Needs the engines environment (``./run engines``); skipped with the reason otherwise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm", reason="no vLLM engine here: run ./run engines "
                    "(vLLM's CPU build in .venv-engines); ./run test then runs this file there")

from tests.support import engine_runs  # noqa: E402
from tests.support.vllm_models import BLOCK, build_llama  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU build runs an fp8 KV cache only on x86 with AVX-512 or AMX")


def test_fp8_kv_cache_repeat_hits_every_block_with_plain_fp8_tokens(tmp_path):
    model = str(build_llama(tmp_path / "llama"))
    r = engine_runs.scenario("tests.support.vllm_fp8_scenarios", "fp8", tmp_path, model=model)
    assert [x["cached"] for x in r["mmtier"]] == [0, 400 // BLOCK * BLOCK]
    assert [x["cached"] for x in r["plain"]] == [0, 0]
    assert [x["tokens"] for x in r["mmtier"]] == [x["tokens"] for x in r["plain"]]
    assert r["mmtier"][0]["tokens"] == r["mmtier"][1]["tokens"]
