"""mmtier's vLLM KV and encoder-cache connectors in real vLLM engines (vLLM's CPU build) on a
tiny random-weight LLaVA this module builds and saves with its processor, images sent through
vLLM's multimodal inputs. Greedy tokens are compared with a plain engine (no connector) in the
same scenario; cached tokens are vLLM's own count (``RequestOutput.num_cached_tokens``, vLLM's
prefix caching off), and the vision encoder's calls are counted by a forward hook on the
engine's own model (``tests/support/vllm_mm_scenarios.py``, one process per scenario). Why LLaVA and
not Qwen2-VL, and the one torchvision shim: ``tests/support/vllm_mm_models.py``.

Every prompt is 40 words, the image (64 placeholder tokens at positions [40, 104)), 60 words:
164 tokens, vLLM blocks of 32. Needs the engines environment (``./run engines``)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="no vLLM engine here: run ./run engines "
                    "(vLLM's CPU build in .venv-engines); ./run test then runs this file there")

from tests.support import engine_runs  # noqa: E402
from tests.support.vllm_mm_models import IMAGE_TOKENS, build_llava  # noqa: E402
from tests.support.vllm_models import BLOCK  # noqa: E402

PROMPT_LEN, IMAGE_AT = 164, 40


def scenario(name: str, tmp: Path, **args) -> dict:
    return engine_runs.scenario("tests.support.vllm_mm_scenarios", name, tmp, **args)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return str(build_llava(tmp_path_factory.mktemp("models") / "llava"))


@pytest.fixture(scope="module")
def across(llava, tmp_path_factory):
    """One run of the ``across_instances`` scenario (four engines) for the tests that read it."""
    return scenario("across_instances", tmp_path_factory.mktemp("across"), model=llava)


def tokens(rows: list[dict]) -> list[list[int]]:
    return [r["tokens"] for r in rows]


def cached(rows: list[dict]) -> list[int]:
    return [r["cached"] for r in rows]


def encoded(rows: list[dict]) -> list[int]:
    return [r["encoded"] for r in rows]


def test_the_prompts_are_the_geometry_the_counts_below_assume(across):
    for rows in across.values():
        for r in rows:
            assert (r["prompt_len"], r["image_at"], r["image_len"]) == (PROMPT_LEN, IMAGE_AT, IMAGE_TOKENS)
    assert tokens(across["plain"])[0] != tokens(across["plain"])[1]     # the image changes the tokens


@pytest.fixture(scope="module")
def default_executor(llava, tmp_path_factory):
    """One run of the ``default_executor`` scenario (two engines, vLLM's default executor)."""
    return scenario("default_executor", tmp_path_factory.mktemp("mp"), model=llava)


def test_the_kv_connector_hits_a_repeated_image_and_prompt(default_executor, across):
    """vLLM's default executor (scheduler and worker in two processes): the scheduler keys the
    image by the digest of its processed inputs, the worker's cache answers. The plain engine's
    tokens for the same prompts are ``across``'s (in-process executor, same model and settings)."""
    rows = default_executor["kv"]
    full = (PROMPT_LEN - 1) // BLOCK * BLOCK                   # 160: every full block, the image's
    after_image = (IMAGE_AT + IMAGE_TOKENS) // BLOCK * BLOCK   # 96: the tail differs from 104 on
    before_image = IMAGE_AT // BLOCK * BLOCK                   # 32: another image, same text
    # order: A, A again, A with another tail, the same text with image B
    assert cached(rows) == [0, full, after_image, before_image] == [0, 160, 96, 32]
    plain = across["plain"]                                    # A, B, C, D, A, A with another tail
    assert tokens(rows) == [plain[0]["tokens"], plain[0]["tokens"], plain[5]["tokens"], plain[1]["tokens"]]
    assert cached(plain) == [0] * 6
    assert plain[5]["tokens"] != plain[0]["tokens"]


def test_the_encoder_cache_connector_skips_the_vision_encoder_across_instances(across):
    """A second engine instance (its own encoder cache empty) loads A's encoder output from
    mmtier: the vision tower does not run for it, and the tokens are a plain engine's."""
    assert encoded(across["first"]) == [1, 1]                  # A, C: encoded, saved
    assert encoded(across["plain"])[:5] == [1, 1, 1, 1, 1]     # vLLM's own cache let A go
    second = across["ec_second"]
    assert second[0]["encoded"] == 0
    assert second[0]["tokens"] == across["plain"][0]["tokens"]
    assert cached(second) == [0, 0, 0]                         # no KV connector here
    assert cached(across["first"]) == [0, IMAGE_AT // BLOCK * BLOCK]   # (it had one: C after A)


def test_two_images_under_one_client_uuid_never_share_an_encoder_output(across):
    """C was encoded under the uuid ``"u"``; image B under ``"u"`` in the next instance runs the
    encoder and answers B's tokens (the connector keyed on vLLM's identifier, the uuid, and
    served C's output for B: 0 encoder calls, C's tokens); A under another uuid is found by its
    content."""
    b_under_u, a_under_v = across["ec_second"][1], across["ec_second"][2]
    assert b_under_u["encoded"] == 1
    assert b_under_u["tokens"] == across["plain"][1]["tokens"]
    assert b_under_u["tokens"] != across["first"][1]["tokens"]       # not C's
    assert a_under_v["encoded"] == 0
    assert a_under_v["tokens"] == across["plain"][0]["tokens"]


def test_two_images_under_one_client_uuid_never_share_kv(across):
    """C's KV was saved under the uuid ``"u"``; image B under ``"u"`` in the next instance hits
    the text before the image only, and A (saved with no uuid) under another uuid hits every
    full block."""
    b_under_u, a_under_v = across["kv_second"]
    assert b_under_u["cached"] == IMAGE_AT // BLOCK * BLOCK == 32
    assert b_under_u["encoded"] == 1
    assert b_under_u["tokens"] == across["plain"][1]["tokens"]
    assert a_under_v["cached"] == (PROMPT_LEN - 1) // BLOCK * BLOCK == 160
    assert a_under_v["encoded"] == 0                           # the KV hit covers the image
    assert a_under_v["tokens"] == across["plain"][0]["tokens"]


def test_the_encoder_cache_connector_under_the_default_executor_answers_plain_tokens(default_executor, across):
    rows = default_executor["ec"]                              # A, B, C, D, A again
    assert encoded(rows)[:4] == [1, 1, 1, 1]
    assert tokens(rows) == tokens(across["plain"])[:5]


def test_the_encoder_cache_connector_skips_the_encoder_under_the_default_executor(default_executor):
    """The scheduler (engine-core process) asks the worker's cache over the lookup channel."""
    assert encoded(default_executor["ec"])[4] == 0             # A again: vLLM's own cache let it go


def test_both_connectors_given_only_sizes_read_the_llavas_shape_and_share_one_cache(llava, tmp_path):
    from tests.support.vllm_mm_models import EMBED_WIDTH

    r = scenario("sizes_only", tmp_path, model=llava)
    assert r["caches"] == 1                                   # the KV and EC connectors share it
    mods = r["modalities"]
    assert set(mods) == {"text", "vision", "vision_embed"}
    assert mods["vision_embed"][0] == "embedding" and mods["vision_embed"][2] == EMBED_WIDTH
    assert mods["text"][1] == mods["vision"][1] == BLOCK
    rows, plain = r["mmtier"], r["plain"]
    assert tokens(rows) == tokens(plain)
    assert cached(rows)[:2] == [0, (IMAGE_AT + IMAGE_TOKENS) // BLOCK * BLOCK]  # the tail: through the image
    # a second engine: no KV hit (other text first), the vision tower skipped for the image it
    # never saw (a fresh plain engine encodes it)
    assert cached(rows)[2] == 0 and encoded(rows)[2] == 0 and encoded(r["plain_fresh"]) == [1]
    assert tokens(r["plain_fresh"]) == tokens(plain)[2:]
    assert encoded(rows)[0] == 1 and cached(plain) == [0, 0, 0]


def test_each_tenants_encoder_output_is_its_own_across_engines(llava, tmp_path):
    """The same image under two ``cache_salt``s (two tenants) in fresh engines over one mmtier
    cache: each tenant's vision tower runs once and later hits in another engine; the other
    tenant's (and a request without a salt) never gets it: its tower runs. Every answer is the
    first one's (greedy, the same picture and prompt)."""
    r = scenario("tenants", tmp_path, model=llava)
    assert {k: v["encoded"] for k, v in r.items()} == {"a1": 1, "a2": 0, "b1": 1, "b2": 0, "none": 1}
    assert all(v["tokens"] == r["a1"]["tokens"] for v in r.values())
