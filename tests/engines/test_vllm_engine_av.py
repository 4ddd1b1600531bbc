"""mmtier's vLLM KV and encoder-cache connectors in real vLLM engines (vLLM's CPU build) on
audio and video: a tiny random-weight Qwen2-Audio and Qwen2-VL built and saved with their
processors (``mmtier.serve.tiny_audio``, ``tiny_video``), clips and frames sent through vLLM's
multimodal inputs. Both connectors are given sizes only and read the model's shape from vLLM
(``audio`` / ``audio_embed`` pools for Qwen2-Audio; Qwen2-VL's video goes to its ``vision`` /
``vision_embed`` pools). Greedy tokens are compared with a plain engine
(no connector); cached tokens are vLLM's own count (its prefix caching off); the audio
tower's calls are counted by a forward hook on the engine's own model
(``tests/support/vllm_av_scenarios.py``, one process per scenario, engines one after the other over one
disk directory).

Audio-language models (vLLM 0.32's CPU build, transformers 5.19, no torchvision):

- **Qwen2-Audio ran** (this file): decoder-only, a Whisper-style tower, its processor numpy
  only, vLLM's module imports as it is; built tiny first, it needed no shim.
- Qwen2.5-Omni's thinker: vLLM's module does not import here (its processor imports
  torchvision); the plugin's Qwen2-VL video processor is a start, not tried further.
- Whisper: vLLM runs it as an encoder-decoder model, whose audio is the encoder's input and not
  placeholder positions of the decoder's prompt, so there is no audio item for the connectors
  to key; not tried.
- Ultravox: vLLM's module imports, but transformers 5.19 has no Ultravox processor (it is the
  checkpoint's own code, ``trust_remote_code``, which nothing here provides); not built.
- Voxtral, Phi-4-multimodal, Gemma 3n: vLLM's modules import; not tried (Qwen2-Audio ran first).

Video is the tiny Qwen2-VL (``mmtier.serve.tiny_video``) through mmtier's vLLM plugin, which
gives it a torchvision-free video processor (``test_vllms_qwen2_vl_imports_only_through_the_plugin``).

Every prompt is 40 words, the item's start token, the item (a clip of a second: 25 placeholder
tokens at [41, 66); a video of 16 frames: 32 at [41, 73)), its end token, 60 words: 127 or 134
tokens, vLLM blocks of 32. Needs the engines
environment (``./run engines``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="no vLLM engine here: run ./run engines "
                    "(vLLM's CPU build in .venv-engines); ./run test then runs this file there")

from mmtier.serve.tiny_audio import TOKENS_PER_SECOND, build_qwen2_audio  # noqa: E402
from mmtier.serve.tiny_models import BLOCK, HIDDEN  # noqa: E402
from mmtier.serve.tiny_video import TEMPORAL, TOKENS_PER_FRAME_PAIR, ensure_tiny_qwen2_vl  # noqa: E402
from tests.support import engine_runs  # noqa: E402
from tests.support.engine_runs import column  # noqa: E402

# medium -> the prompt's length, where the item's placeholder tokens start, how many, and the
# mmtier pools the connectors read from vLLM for it (video: Qwen2-VL's vision pools)
GEOMETRY = {"audio": (127, 41, TOKENS_PER_SECOND, "audio", "audio_embed"),
            "video": (134, 41, 16 // TEMPORAL * TOKENS_PER_FRAME_PAIR, "vision", "vision_embed")}
MEDIA = sorted(GEOMETRY)


def blocks(medium: str) -> tuple[int, int, int]:
    """Tokens a KV hit covers for A again (every full block), A with another tail (through the
    item and its end token) and another item after the same text (the text before it)."""
    n, at, length, _, _ = GEOMETRY[medium]
    return (n - 1) // BLOCK * BLOCK, (at + length + 1) // BLOCK * BLOCK, at // BLOCK * BLOCK


def tokens(rows: list[dict]) -> list[list[int]]:
    return column(rows, "tokens")


def cached(rows: list[dict]) -> list[int]:
    return column(rows, "cached")


def encoded(rows: list[dict]) -> list[int]:
    return column(rows, "encoded")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One run of the ``audio_and_video`` scenario (three engines a medium) for the tests."""
    models = tmp_path_factory.mktemp("models")
    audio = build_qwen2_audio(models / "qwen2-audio")
    video = ensure_tiny_qwen2_vl(models)
    return engine_runs.scenario("tests.support.vllm_av_scenarios", "audio_and_video", Path(tmp_path_factory.mktemp("av")),
                                audio=str(audio), video=str(video))


def test_vllms_qwen2_vl_imports_only_through_the_plugin():
    """vLLM's own plugin loader installs the Qwen2-VL shim: its module imports and the tiny
    model's processor (with mmtier's video processor) loads; without the plugin the import
    fails on torchvision here."""
    probe = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
             "import vllm.model_executor.models.qwen2_vl; "
             "from mmtier.serve.tiny_video import ensure_tiny_qwen2_vl; import sys, tempfile; "
             "from transformers import AutoProcessor; "
             "p = AutoProcessor.from_pretrained(ensure_tiny_qwen2_vl(tempfile.mkdtemp())); "
             "print('VIDEO', type(p.video_processor).__name__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    if "Qwen2VLVideoProcessorPil" not in out.stdout and "torchvision" not in out.stderr:
        pytest.skip("torchvision imports here: the shim has nothing to do")
    assert "VIDEO Qwen2VLVideoProcessorPil" in out.stdout
    bare = subprocess.run([sys.executable, "-c", "import vllm.model_executor.models.qwen2_vl"],
                          capture_output=True, text=True, timeout=300)
    assert bare.returncode != 0 and "torchvision" in bare.stderr


@pytest.mark.parametrize("medium", MEDIA)
def test_the_prompts_are_the_geometry_the_counts_below_assume(runs, medium):
    n, at, length, _, _ = GEOMETRY[medium]
    for part in ("first", "second", "plain"):
        for r in runs[medium][part]:
            assert (r["prompt_len"], r["at"], r["len"]) == (n, at, length)
    a, a_tail, c, b, a_other = tokens(runs[medium]["plain"])
    assert a != b and a != c                                   # the item changes the tokens
    assert a_tail != a and a_other != a                        # and so does the text
    if medium == "audio":                                      # (vLLM's Qwen2-VL answers B and C alike)
        assert b != c


@pytest.mark.parametrize("medium", MEDIA)
def test_the_connectors_read_the_pools_from_vllm_and_share_one_cache(runs, medium):
    _, _, _, kv, embed = GEOMETRY[medium]
    assert runs[medium]["caches"] == 1
    mods = runs[medium]["modalities"]
    assert set(mods) == {"text", kv, embed}
    assert mods[kv][:2] == ["kv", BLOCK]
    assert mods[embed][0] == "embedding" and mods[embed][2] == HIDDEN


@pytest.mark.parametrize("medium", MEDIA)
def test_the_kv_connector_hits_a_repeated_item_chained_to_its_prefix(runs, medium):
    """A, A again (every full block), A with another tail (through the item), C after the same
    text (the text before the item only: the item's group is keyed by its content)."""
    rows, plain = runs[medium]["first"], runs[medium]["plain"]
    full, through, before = blocks(medium)
    assert cached(rows)[:4] == [0, full, through, before]
    assert before < through < full
    assert tokens(rows)[:4] == [plain[0]["tokens"], plain[0]["tokens"], plain[1]["tokens"], plain[2]["tokens"]]
    assert cached(plain) == [0] * 5


@pytest.mark.parametrize("medium", MEDIA)
def test_a_repeat_of_an_item_that_shares_a_partial_block_of_text_with_another(runs, medium):
    """C again: its prompt shares A's words up to the item, which starts mid-block, so the text
    group before it was stored by A's request and C's by its own. The hit covers every full
    block, and the answer must be C's (it was not while the connector read vLLM's CPU blocks as
    K|V along the last axis: tests/engines/test_vllm_cpu_layout.py)."""
    c_again = runs[medium]["first"][4]
    assert c_again["cached"] == blocks(medium)[0]
    assert c_again["tokens"] == runs[medium]["plain"][2]["tokens"]


@pytest.mark.parametrize("medium", MEDIA)
def test_the_encoder_cache_connector_skips_the_tower_in_another_engine(runs, medium):
    """The second engine starts with vLLM's caches empty and never saw A: A after other text has
    no KV hit, and the encoder tower does not run for it (its output came from mmtier's disk
    tier); the first engine and the plain one encoded A, B and C."""
    run = runs[medium]
    assert encoded(run["first"])[0] == 1 and encoded(run["first"])[3] == 1
    a_other = run["second"][1]
    assert a_other["cached"] == 0
    assert a_other["encoded"] == 0
    assert a_other["tokens"] == run["plain"][4]["tokens"]
    assert encoded(run["plain"])[0] == 1 and encoded(run["plain"])[2:4] == [1, 1]


@pytest.mark.parametrize("medium", MEDIA)
def test_a_client_uuid_never_shares_an_items_kv_or_encoder_output(runs, medium):
    """C was saved under the uuid ``"u"``; B under ``"u"`` in the next engine hits the text
    before the item only and runs the tower (B's tokens, not C's); A under ``"v"`` hits every
    full block by its content."""
    b_under_u, _, a_under_v = runs[medium]["second"]
    plain = runs[medium]["plain"]
    full, _, before = blocks(medium)
    assert b_under_u["cached"] == before
    assert b_under_u["encoded"] == 1
    assert b_under_u["tokens"] == plain[3]["tokens"]
    if medium == "audio":                                      # not C's (alike for the video model)
        assert b_under_u["tokens"] != plain[2]["tokens"]
    assert a_under_v["cached"] == full and a_under_v["encoded"] == 0
    assert a_under_v["tokens"] == plain[0]["tokens"]
