"""mmtier's vLLM KV and encoder-cache connectors in real vLLM engines (vLLM's CPU build) on
audio: a tiny random-weight Qwen2-Audio built and saved with its processor
(``mmtier.serve.tiny_audio``), clips sent through vLLM's multimodal inputs. Both connectors
are given sizes only and read the model's shape from vLLM (an ``audio`` KV pool and an
``audio_embed`` pool beside the text pool). Greedy tokens are compared with a plain engine
(no connector); cached tokens are vLLM's own count (its prefix caching off); the audio
tower's calls are counted by a forward hook on the engine's own model
(``tests/vllm_av_scenarios.py``, one process per scenario, engines one after the other over one
disk directory).

Audio-language models tried in vLLM 0.32's CPU build here (transformers 5.19, no torchvision):

- **Qwen2-Audio ran** (this file): decoder-only, a Whisper-style tower, its processor numpy only.
- Ultravox: vLLM's processor wraps a Whisper feature extractor in a custom ``UltravoxProcessor``
  loaded with ``trust_remote_code`` from the checkpoint's own Python files, which no hub here
  provides; not built.
- Whisper: an encoder-decoder model; its audio is the encoder's input, not placeholder positions
  of a decoder prompt, so neither connector has an item to key (vLLM's KV connectors and
  encoder-decoder models do not meet).
- Voxtral, Phi-4-multimodal, Gemma 3n, Qwen2.5-Omni's thinker: their processors need
  ``mistral_common`` (Voxtral), ``trust_remote_code`` files (Phi-4-mm), or a video / image
  processor that imports torchvision (Gemma 3n's, Qwen2.5-Omni's); not tried further once
  Qwen2-Audio ran.

Every prompt is 40 words, ``<|audio_bos|>``, the clip (25 placeholder tokens for a second, at
[41, 66)), ``<|audio_eos|>``, 60 words: 127 tokens, vLLM blocks of 32. Needs the engines
environment (``./run engines``)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="no vLLM engine here: run ./run engines "
                    "(vLLM's CPU build in .venv-engines); ./run test then runs this file there")

from mmtier.serve.tiny_audio import TOKENS_PER_SECOND, build_qwen2_audio  # noqa: E402
from mmtier.serve.tiny_models import BLOCK, HIDDEN  # noqa: E402
from tests import engine_runs  # noqa: E402
from tests.engine_runs import column  # noqa: E402

PROMPT_LEN, AUDIO_AT = 127, 41
FULL = (PROMPT_LEN - 1) // BLOCK * BLOCK                        # 96: every full block
THROUGH_AUDIO = (AUDIO_AT + TOKENS_PER_SECOND + 1) // BLOCK * BLOCK   # 64: the tail differs after
BEFORE_AUDIO = AUDIO_AT // BLOCK * BLOCK                        # 32: another clip, same text


def tokens(rows: list[dict]) -> list[list[int]]:
    return column(rows, "tokens")


def cached(rows: list[dict]) -> list[int]:
    return column(rows, "cached")


def encoded(rows: list[dict]) -> list[int]:
    return column(rows, "encoded")


@pytest.fixture(scope="module")
def audio(tmp_path_factory) -> dict:
    """One run of the ``audio`` scenario (three engines) for the tests that read it."""
    model = build_qwen2_audio(tmp_path_factory.mktemp("models") / "qwen2-audio")
    return engine_runs.scenario("tests.vllm_av_scenarios", "audio", Path(tmp_path_factory.mktemp("audio")),
                                model=str(model))


def test_the_prompts_are_the_geometry_the_counts_below_assume(audio):
    for rows in (audio["first"], audio["second"], audio["plain"]):
        for r in rows:
            assert (r["prompt_len"], r["at"], r["len"]) == (PROMPT_LEN, AUDIO_AT, TOKENS_PER_SECOND)
    a, a_tail, c, b, a_other = tokens(audio["plain"])
    assert len({tuple(a), tuple(b), tuple(c)}) == 3           # the clip changes the tokens
    assert a_tail != a and a_other != a                        # and so does the text


def test_the_connectors_read_the_audio_pools_from_vllm_and_share_one_cache(audio):
    assert audio["caches"] == 1
    mods = audio["modalities"]
    assert set(mods) == {"text", "audio", "audio_embed"}
    assert mods["audio"][:2] == ["kv", BLOCK]
    assert mods["audio_embed"][0] == "embedding" and mods["audio_embed"][2] == HIDDEN


def test_the_kv_connector_hits_a_repeated_clip_chained_to_its_prefix(audio):
    """A, A again (every full block), A with another tail (through the clip), C after the same
    text (the text before the clip only: the clip's group is keyed by its content)."""
    rows, plain = audio["first"], audio["plain"]
    assert cached(rows) == [0, FULL, THROUGH_AUDIO, BEFORE_AUDIO] == [0, 96, 64, 32]
    assert tokens(rows) == [plain[0]["tokens"], plain[0]["tokens"], plain[1]["tokens"], plain[2]["tokens"]]
    assert cached(plain) == [0] * 5


def test_the_encoder_cache_connector_skips_the_audio_tower_in_another_engine(audio):
    """The second engine starts with vLLM's caches empty and never saw A: A after other text has
    no KV hit, and the audio tower does not run for it (its output came from mmtier's disk
    tier); the first engine and the plain one encoded A, B and C."""
    assert encoded(audio["first"])[0] == 1 and encoded(audio["first"])[3] == 1
    a_other = audio["second"][1]
    assert a_other["cached"] == 0
    assert a_other["encoded"] == 0
    assert a_other["tokens"] == audio["plain"][4]["tokens"]
    assert encoded(audio["plain"])[0] == 1 and encoded(audio["plain"])[2:4] == [1, 1]


def test_a_client_uuid_never_shares_a_clips_kv_or_encoder_output(audio):
    """C was saved under the uuid ``"u"``; clip B under ``"u"`` in the next engine hits the text
    before the clip only and runs the audio tower (B's tokens, not C's); A under ``"v"`` hits
    every full block by its content."""
    b_under_u, _, a_under_v = audio["second"]
    plain = audio["plain"]
    assert b_under_u["cached"] == BEFORE_AUDIO
    assert b_under_u["encoded"] == 1
    assert b_under_u["tokens"] == plain[3]["tokens"] != plain[2]["tokens"]
    assert a_under_v["cached"] == FULL and a_under_v["encoded"] == 0
    assert a_under_v["tokens"] == plain[0]["tokens"]
