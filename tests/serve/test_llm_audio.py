"""Audio through the OpenAI-compatible serving path: Ray Serve LLM (mmtier's ingress) over a real
vLLM engine (its CPU build) carrying both mmtier connectors on the tiny random-weight
Qwen2-Audio (``configs/serve-llm-cpu-audio.yaml``), driven over loopback by the real ``openai``
client (``httpx`` for raw and bad requests). Clips are chat ``input_audio`` parts, base64 WAV
(16-bit PCM) or MP3; vLLM's own prefix caching is off, so every cached token in ``usage`` comes
from mmtier. Greedy answers of a repeat are compared with the first, computed with nothing cached.

Runs in the engines environment (``./run engines``); elsewhere it is skipped with the reason."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest

try:
    import vllm  # noqa: F401, I001  (first: ray.serve.llm's own message would suggest ray[llm])
    import openai
    import ray.serve.llm  # noqa: F401
    from tests.support import serve_llm_app
except ImportError as exc:                 # the base environment has no vLLM / Ray Serve LLM
    pytest.skip(f"needs the engines environment (vLLM, ray.serve.llm, openai, httpx; ./run engines): {exc}",
                allow_module_level=True)

from mmtier.serve.tiny_audio import SAMPLE_RATE, clip  # noqa: E402
from mmtier.serve.tiny_models import BLOCK, text  # noqa: E402
from tests.serve.test_llm import cached  # noqa: E402
from tests.support.serve_llm_app import full_blocks, refused  # noqa: E402

pytestmark = pytest.mark.ray
MODEL = "tiny-qwen2-audio"
KEY = "sk-local-acme"
GREEDY = dict(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    yield from serve_llm_app.served("serve-llm-cpu-audio.yaml", tmp_path_factory, "serve-llm-audio")


def client(app) -> openai.OpenAI:
    return serve_llm_app.client(app, KEY)


def wav_bytes(samples: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def mp3_bytes(samples: np.ndarray) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp3") as out:
        stream = out.add_stream("libmp3lame", rate=SAMPLE_RATE)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(samples[None].astype(np.float32), format="flt", layout="mono")
        frame.sample_rate = SAMPLE_RATE
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


def audio_part(data: bytes, fmt: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def messages(part: dict, words: str) -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": words}]}]


# every chat prompt with a clip starts 'Audio 1: <|audio_bos|>', a partial block of text the wav
# clip's request stored: the mp3 clip's repeat reads it (tests/engines/test_vllm_cpu_layout.py)
@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_a_repeated_clip_is_served_from_mmtier_with_the_same_answer(app, fmt):
    c = client(app)
    encode = wav_bytes if fmt == "wav" else mp3_bytes
    seed = 11 if fmt == "wav" else 12
    msgs = messages(audio_part(encode(clip(seed)), fmt), text(seed, 60))
    first = c.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    again = c.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    n = first.usage.prompt_tokens
    assert n > 60 + 25                                   # the words and the clip's 25 tokens
    assert cached(first.usage) == 0
    assert cached(again.usage) == full_blocks(n) >= 64
    assert again.choices[0].message.content == first.choices[0].message.content
    assert first.usage.completion_tokens == 8


def test_another_clip_under_the_same_text_is_not_a_hit(app):
    """The clip's group is keyed by its processed inputs: another clip at the same position
    after the same words misses from the clip on (nothing before it fills a block)."""
    c = client(app)
    words = text(21, 60)
    a = c.chat.completions.create(model=MODEL, messages=messages(audio_part(wav_bytes(clip(21)), "wav"), words),
                                  **GREEDY)
    b = c.chat.completions.create(model=MODEL, messages=messages(audio_part(wav_bytes(clip(22)), "wav"), words),
                                  **GREEDY)
    assert cached(a.usage) == 0 and cached(b.usage) == 0
    assert a.usage.prompt_tokens == b.usage.prompt_tokens > BLOCK


BAD_WORDS = text(32, 40)


def _bad_audio() -> list[tuple[str, dict, str, str]]:
    """(name, content part, code, param) of clips the ingress refuses."""
    wav, mp3 = wav_bytes(clip(31)), mp3_bytes(clip(31))
    png = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
    data = "messages[0].content[0].input_audio.data"
    return [
        ("truncated WAV", audio_part(wav[: len(wav) // 2], "wav"), "invalid_value", data),
        ("truncated MP3", audio_part(mp3[: len(mp3) // 2], "mp3"), "invalid_value", data),
        ("MP3 declared WAV", audio_part(mp3, "wav"), "invalid_value", data),
        ("WAV declared MP3", audio_part(wav, "mp3"), "invalid_value", data),
        ("PNG declared WAV", audio_part(png, "wav"), "invalid_value", data),
        ("FLAC", audio_part(wav, "flac"), "invalid_value", "messages[0].content[0].input_audio.format"),
        ("over 30 s", audio_part(wav_bytes(np.zeros(31 * SAMPLE_RATE)), "wav"), "audio_too_long", data),
        ("broken base64", {"type": "input_audio", "input_audio": {"data": "UklGR!!!", "format": "wav"}},
         "invalid_base64", data),
    ]


def test_bad_audio_gets_openai_shaped_400s_never_a_500(app):
    for name, part, code, param in _bad_audio():
        err = refused(app, KEY, {"model": MODEL, "messages": messages(part, BAD_WORDS), "max_tokens": 4}, name)
        assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error"), (name, err)
    c = client(app)
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model=MODEL, messages=messages(_bad_audio()[0][1], "w1"), max_tokens=4)
    assert bad.value.code == "invalid_value"
    # refused before the engine, nothing stored: the whole clip refused under the wrong format,
    # sent right with the same words, is new to the cache (vLLM itself would have decoded it)
    wav = wav_bytes(clip(31))
    ok = c.chat.completions.create(model=MODEL, messages=messages(audio_part(wav, "wav"), BAD_WORDS), max_tokens=2)
    assert ok.usage.completion_tokens == 2 and full_blocks(ok.usage.prompt_tokens) >= 64
    assert cached(ok.usage) == 0


def test_two_tenants_each_encode_a_clip_once_and_never_get_the_others_output(app):
    """The same clip from two API keys: each tenant's audio tower runs once, never the other's
    output from mmtier or vLLM's own encoder cache; repeats hit (``serve_llm_app.two_tenants``)."""
    msgs = messages(audio_part(wav_bytes(clip(13)), "wav"), text(13, 60))
    serve_llm_app.assert_tenants_apart(serve_llm_app.two_tenants(
        app, MODEL, (KEY, "sk-local-globex"), msgs, "audio_embed"))
