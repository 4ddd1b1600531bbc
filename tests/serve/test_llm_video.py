"""Video through the OpenAI-compatible serving path: Ray Serve LLM (mmtier's ingress) over a real
vLLM engine (its CPU build) carrying both mmtier connectors on the tiny random-weight Qwen2-VL
(``configs/serve-llm-cpu-video.yaml``; its video processor is mmtier's torchvision-free one,
bound in by mmtier's vLLM plugin), driven over loopback by the real ``openai`` client (``httpx``
for raw and bad requests). Videos are chat ``video_url`` parts as vLLM's server takes them, a
``data:video/mp4;base64,...`` URL, which vLLM decodes with its OpenCV loader; vLLM's own prefix
caching is off, so every cached token in ``usage`` comes from mmtier. Greedy answers of a repeat
are compared with the first, computed with nothing cached.

Runs in the engines environment (``./run engines``); elsewhere it is skipped with the reason."""

from __future__ import annotations

import base64

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

from mmtier.serve.tiny_models import BLOCK, text  # noqa: E402
from mmtier.serve.tiny_video import TEMPORAL, TOKENS_PER_FRAME_PAIR, frames  # noqa: E402
from tests.serve.test_llm import cached  # noqa: E402
from tests.support import media_samples  # noqa: E402
from tests.support.serve_llm_app import full_blocks, refused  # noqa: E402

pytestmark = pytest.mark.ray
MODEL = "tiny-qwen2-vl"
KEY = "sk-local-acme"
GREEDY = dict(max_tokens=8, temperature=0.0)
FRAMES = 16                                # 8 temporal patches of 2 frames: 32 placeholder tokens
VIDEO_TOKENS = FRAMES // TEMPORAL * TOKENS_PER_FRAME_PAIR


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    yield from serve_llm_app.served("serve-llm-cpu-video.yaml", tmp_path_factory, "serve-llm-video")


def client(app) -> openai.OpenAI:
    return serve_llm_app.client(app, KEY)


def video(seed: int, n: int = FRAMES, fps: int = 4) -> bytes:
    """The tiny model's frames (``tiny_video.frames``: one colour a patch) as an H.264 MP4."""
    return media_samples.encode_video(list(frames(seed, n)), fps, codec="libx264")


def video_part(data: bytes, media_type: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": f"data:{media_type};base64,{base64.b64encode(data).decode()}"}}


def messages(part: dict, words: str) -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": words}]}]


def test_a_repeated_video_is_served_from_mmtier_with_the_same_answer(app):
    c = client(app)
    msgs = messages(video_part(video(11)), text(11, 60))
    first = c.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    again = c.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    n = first.usage.prompt_tokens
    assert n > 60 + VIDEO_TOKENS                         # the words and the video's 32 tokens
    assert first.usage.prompt_tokens_details.model_dump().get("multimodal_tokens") == {"video": VIDEO_TOKENS}
    assert cached(first.usage) == 0
    assert cached(again.usage) == full_blocks(n) >= 64
    assert again.choices[0].message.content == first.choices[0].message.content
    assert first.usage.completion_tokens == 8


def test_another_video_under_the_same_text_is_not_a_hit(app):
    """The video's group is keyed by its processed frames: another video at the same position
    before the same words misses from the video on (nothing before it fills a block)."""
    c = client(app)
    words = text(21, 60)
    a = c.chat.completions.create(model=MODEL, messages=messages(video_part(video(21)), words), **GREEDY)
    b = c.chat.completions.create(model=MODEL, messages=messages(video_part(video(22)), words), **GREEDY)
    assert cached(a.usage) == 0 and cached(b.usage) == 0
    assert a.usage.prompt_tokens == b.usage.prompt_tokens > BLOCK


BAD_WORDS = text(32, 40)
URL = "messages[0].content[0].video_url.url"


def _bad_videos() -> list[tuple[str, dict, str, str]]:
    """(name, content part, code, param) of videos the ingress refuses (the limits are the
    config's: 20 s, 160 frames, 640 x 480)."""
    mp4 = video(31)
    png = media_samples.image(31)
    webm = media_samples.video(31, frames=4, size=(56, 56), fmt="webm")
    large = media_samples.encode_video([np.zeros((496, 656, 3), np.uint8)] * 2, 4)
    bad = [
        ("truncated MP4", video_part(mp4[: len(mp4) // 2]), "invalid_video"),
        ("MP4 declared WebM", video_part(mp4, "video/webm"), "invalid_video_format"),
        ("WebM declared MP4", video_part(webm), "invalid_video_format"),
        ("PNG declared MP4", video_part(png), "invalid_video"),
        ("over 160 frames", video_part(video(33, n=162, fps=30)), "video_too_large"),
        ("over 20 s", video_part(video(34, n=22, fps=1)), "video_too_large"),
        ("over 640 x 480", video_part(large), "video_too_large"),
        ("broken base64", {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA!!!"}},
         "invalid_base64"),
        ("remote URL", {"type": "video_url", "video_url": {"url": "http://127.0.0.1:9/v.mp4"}}, "invalid_video_url"),
    ]
    typeless = {"video_url": video_part(mp4)["video_url"]}           # vLLM reads it as a video by its key
    return [(name, part, code, URL) for name, part, code in bad] + \
        [("MP4 in a part without a type", typeless, "missing_required_parameter", "messages[0].content[0].type")]


def test_bad_videos_get_openai_shaped_400s_never_a_500(app):
    for name, part, code, param in _bad_videos():
        err = refused(app, KEY, {"model": MODEL, "messages": messages(part, BAD_WORDS), "max_tokens": 4}, name)
        assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error"), (name, err)
    c = client(app)
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model=MODEL, messages=messages(_bad_videos()[0][1], "w1"), max_tokens=4)
    assert bad.value.code == "invalid_video"
    # refused before the engine, nothing stored: the whole MP4 refused under the wrong type and
    # in a part without a type (vLLM's loader would have decoded both), sent right with the same
    # words, is new to the cache
    ok = c.chat.completions.create(model=MODEL, messages=messages(video_part(video(31)), BAD_WORDS), max_tokens=2)
    assert ok.usage.completion_tokens == 2 and full_blocks(ok.usage.prompt_tokens) >= 64
    assert cached(ok.usage) == 0


def test_two_tenants_each_encode_a_video_once_and_never_get_the_others_output(app):
    """The same video from two API keys: each tenant's vision tower runs once on it, never the
    other's output from mmtier or vLLM's own encoder cache; repeats hit
    (``serve_llm_app.two_tenants``)."""
    msgs = messages(video_part(video(13)), text(13, 60))
    serve_llm_app.assert_tenants_apart(serve_llm_app.two_tenants(
        app, MODEL, (KEY, "sk-local-globex"), msgs, "vision_embed"))
