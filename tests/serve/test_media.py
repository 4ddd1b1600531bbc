"""The Serve app's request side without Ray: media checks (Pillow, PyAV, ``wave``), the OpenAI
chat request's parsing (messages as turns, data URLs, ``input_audio``) and its OpenAI-shaped
errors for bad bodies and bad media, and the ``model`` section of its config. Videos are real
MP4 / WebM / QuickTime bytes encoded here by PyAV."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("PIL", reason="the hf extra (Pillow) is not installed")

from mmtier.errors import BadMediaError, ConfigError  # noqa: E402
from mmtier.serve.config import Limits, ServeAppConfig  # noqa: E402
from mmtier.serve.media import TooLargeMedia, check_image, check_video, check_wav  # noqa: E402
from mmtier.serve.protocol import HTTPError, parse_chat  # noqa: E402
from tests.support.media_samples import float_wav, image, part, video, wav  # noqa: E402

LIMITS = Limits(max_media_bytes=64 << 10, max_image_pixels=64 * 64, max_audio_seconds=2.0,
                max_video_seconds=3.0, max_video_frames=20, max_video_pixels=48 * 48)
MP4 = video(1, frames=8, size=(32, 24), fps=4)


def test_images_decode_to_their_type_and_size():
    png, jpeg = image(1, (40, 24)), image(2, (16, 48), "JPEG")
    assert check_image(png, 1 << 20) == check_image(png, 40 * 24)
    info = check_image(png, 1 << 20)
    assert (info.media_type, info.width, info.height) == ("image/png", 40, 24)
    info = check_image(jpeg, 1 << 20)
    assert (info.media_type, info.width, info.height) == ("image/jpeg", 16, 48)


@pytest.mark.parametrize("case", ["truncated_png", "truncated_jpeg", "not_an_image", "gif", "too_many_pixels"])
def test_bad_images_are_typed(case):
    png = image(3, (64, 64))
    data, want, unsupported = {
        "truncated_png": (png[: len(png) // 2], BadMediaError, False),
        "truncated_jpeg": (image(4, (64, 64), "JPEG")[:300], BadMediaError, False),
        "not_an_image": (b"\x00\x01not an image at all" * 8, BadMediaError, False),
        "gif": (image(5, (8, 8), "GIF"), BadMediaError, True),
        "too_many_pixels": (image(6, (65, 64)), TooLargeMedia, False),
    }[case]
    with pytest.raises(want) as err:
        check_image(data, 64 * 64)
    assert err.value.unsupported is unsupported and str(err.value)


def test_wav_decodes_to_rate_channels_frames():
    info = check_wav(wav(1, 0.25, 16000, channels=2), 1.0)
    assert (info.media_type, info.rate, info.channels, info.frames) == ("audio/wav", 16000, 2, 4000)
    assert info.seconds == pytest.approx(0.25)


@pytest.mark.parametrize("case", ["truncated", "header_only", "not_riff", "float", "too_long", "png"])
def test_bad_wavs_are_typed(case):
    good = wav(2, 0.5)
    data, want, unsupported = {
        "truncated": (good[: len(good) - 101], BadMediaError, False),
        "header_only": (good[:30], BadMediaError, False),
        "not_riff": (b"RIFX" + good[4:], BadMediaError, False),
        "float": (float_wav(), BadMediaError, True),
        "too_long": (wav(3, 2.5), TooLargeMedia, False),
        "png": (image(1), BadMediaError, False),
    }[case]
    with pytest.raises(want) as err:
        check_wav(data, 2.0)
    assert err.value.unsupported is unsupported and str(err.value)


def test_videos_decode_to_their_type_size_and_frames():
    info = check_video(MP4, 3.0, 20, 48 * 48)
    h = info.header
    assert (info.media_type, h.codec, h.width, h.height, h.frames, h.fps) == ("video/mp4", "mpeg4", 32, 24, 8, 4.0)
    assert h.seconds == pytest.approx(2.0)
    h264 = check_video(video(2, frames=6, codec="libx264"), 3.0, 20, 48 * 48).header
    assert (h264.codec, h264.frames) == ("h264", 6)


@pytest.mark.parametrize("case", ["truncated", "corrupt_frames", "not_a_video", "webm", "quicktime", "gif",
                                  "too_long", "too_many_frames", "too_many_pixels"])
def test_bad_videos_are_typed(case):
    corrupt = bytearray(MP4)
    mdat = corrupt.index(b"mdat") + 64
    corrupt[mdat:mdat + 400] = bytes(400)                  # frames zeroed, the header intact
    data, want, unsupported = {
        "truncated": (MP4[: len(MP4) // 2], BadMediaError, False),
        "corrupt_frames": (bytes(corrupt), BadMediaError, False),
        "not_a_video": (b"\x00\x00\x00\x18ftypisom" + bytes(100), BadMediaError, False),
        "webm": (video(3, frames=4, fmt="webm"), BadMediaError, True),
        "quicktime": (video(3, frames=4, fmt="mov"), BadMediaError, True),
        "gif": (image(3, (8, 8), "GIF"), BadMediaError, True),
        "too_long": (video(4, frames=14, fps=4), TooLargeMedia, False),             # 3.5 s
        "too_many_frames": (video(4, frames=21, fps=30), TooLargeMedia, False),
        "too_many_pixels": (video(4, frames=4, size=(64, 48)), TooLargeMedia, False),
    }[case]
    with pytest.raises(want) as err:
        check_video(data, 3.0, 20, 48 * 48)
    assert err.value.unsupported is unsupported and str(err.value)


MODEL = "mmtier-chat"
def _body(*items, history=(), **fields) -> bytes:
    messages = []
    for turn, answer in history:
        messages += [{"role": "user", "content": [part(i) for i in turn]}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": [part(i) for i in items]})
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 2, **fields}).encode()


def test_parse_chat_decodes_media_once_and_counts_their_tokens():
    png, clip = image(7, (32, 16)), wav(7, 0.5)
    seen = []
    chat = parse_chat(_body("look ", ("image", png, {"media_type": "image/png"}), ("audio", clip),
                            ("video", MP4, {"media_type": "video/mp4"})),
                      LIMITS, MODEL, lambda item: seen.append(item.type) or 10)
    assert [m.info.media_type for m in chat.media] == ["image/png", "audio/wav", "video/mp4"]
    assert chat.media[0].info.width == 32 and chat.media[1].info.frames == 8000 and chat.media[2].info.header.frames == 8
    assert seen == ["image", "audio", "video"] and chat.max_new_tokens == 2 and not chat.stream
    with pytest.raises(HTTPError) as err:                 # 5 + 2 + 10 + 10 tokens over a limit of 20
        parse_chat(_body("look ", ("image", png), ("audio", clip)),
                   Limits(**{**LIMITS.model_dump(), "max_request_tokens": 20}), MODEL, lambda item: 10)
    assert (err.value.status, err.value.code) == (413, "too_large")


def test_parse_chat_takes_the_whole_conversation():
    """System text opens the first turn; consecutive user messages are one turn; each earlier
    turn keeps its answer's text; the history's media are decoded and counted too (its text and
    answers count toward the request's tokens)."""
    png = image(9, (32, 16))
    body = json.dumps({"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "messages": [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": [part("see "), part(("image", png))]},
        {"role": "user", "content": "now"},
        {"role": "assistant", "content": [{"type": "text", "text": "it is "}, {"type": "text", "text": "red"}]},
        {"role": "user", "content": "and?"}]}).encode()
    chat = parse_chat(body, LIMITS, MODEL, lambda item: 7)
    (turn, answer), = chat.history
    assert [getattr(i, "text", None) for i in turn] == ["Be brief. ", "see ", None, "now"] and answer == "it is red"
    assert [i.text for i in chat.content] == ["and?"] and [m.type for m in chat.media] == ["image"]
    assert chat.stream and chat.include_usage and chat.max_new_tokens == LIMITS.default_new_tokens
    small = Limits(**{**LIMITS.model_dump(), "max_request_tokens": 10 + 4 + 7 + 3 + 9 + 4 + LIMITS.default_new_tokens})
    parse_chat(body, small, MODEL, lambda item: 7)            # exactly at the limit
    with pytest.raises(HTTPError) as err:
        parse_chat(body, Limits(**{**small.model_dump(), "max_request_tokens": small.max_request_tokens - 1}),
                   MODEL, lambda item: 7)
    assert err.value.status == 413


def _messages(*messages, **fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": list(messages), **fields}).encode()


USER = {"role": "user", "content": "hi"}
BAD_BODIES = {
    "no_model": (json.dumps({"messages": [USER]}).encode(), 400, "bad_request", "model"),
    "other_model": (json.dumps({"model": "gpt-4o", "messages": [USER]}).encode(), 404, "model_not_found", "model"),
    "no_messages": (_messages(), 400, "bad_request", "messages"),
    "ends_with_assistant": (_messages(USER, {"role": "assistant", "content": "yo"}), 400, "bad_request", "messages"),
    "assistant_first": (_messages({"role": "assistant", "content": "yo"}, USER), 400, "bad_request", "messages[0]"),
    "empty_answer": (_messages(USER, {"role": "assistant", "content": ""}, USER), 400, "bad_request",
                     "messages[1].content"),
    "tool_role": (_messages(USER, {"role": "tool", "content": "x"}), 400, "bad_request", "messages[1]"),
    "late_system": (_messages(USER, {"role": "system", "content": "x"}), 400, "bad_request", "messages[1]"),
    "image_in_answer": (_messages(USER, {"role": "assistant", "content": [part(("image", image(1)))]}, USER),
                        400, "unknown_content_type", "messages[1].content[0]"),
    "http_url": (_messages({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}), 400, "unsupported_url",
        "messages[0].content[0]"),
    "gif_url": (_messages({"role": "user", "content": [part(("image", image(1), {"media_type": "image/gif"}))]}),
                415, "unsupported_media_type", "messages[0].content[0]"),
    "not_base64_url": (_messages({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png,abc"}}]}), 400, "bad_base64",
        "messages[0].content[0]"),
    "temperature": (_messages(USER, temperature=0.7), 400, "bad_request", "temperature"),
    "n": (_messages(USER, n=2), 400, "bad_request", "n"),
    "tools": (_messages(USER, tools=[]), 400, "bad_request", "tools"),
    "tenant": (_messages(USER, tenant="globex"), 400, "tenant_in_body", "tenant"),
    "zero_tokens": (_messages(USER, max_tokens=0), 400, "bad_request", "max_tokens"),
    "both_limits": (_messages(USER, max_tokens=2, max_completion_tokens=2), 400, "bad_request", "max_tokens"),
    "stream_options_alone": (_messages(USER, stream_options={"include_usage": True}), 400, "bad_request",
                             "stream_options"),
    "stream_not_bool": (_messages(USER, stream="yes"), 400, "bad_request", "stream"),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_chat_bodies_are_openai_errors(case):
    body, status, code, param = BAD_BODIES[case]
    with pytest.raises(HTTPError) as err:
        parse_chat(body, LIMITS, MODEL, lambda i: 1)
    assert (err.value.status, err.value.code, err.value.param) == (status, code, param), err.value.message
    shaped = err.value.body()["error"]
    assert set(shaped) == {"message", "type", "param", "code"} and shaped["message"]
    assert shaped["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


@pytest.mark.parametrize("item,status,kind", [
    (("image", image(8, (16, 16))[:60]), 400, "bad_media"),
    (("image", image(8, (8, 8), "GIF")), 415, "unsupported_media_type"),
    (("image", image(8, (65, 64))), 413, "too_large"),
    (("image", image(8), {"media_type": "image/gif"}), 415, "unsupported_media_type"),
    (("image", image(8), {"media_type": "image/jpeg"}), 415, "unsupported_media_type"),   # bytes are PNG
    (("image", image(8), {"mime": "image/png"}), 400, "bad_request"),         # a field image_url lacks
    (("audio", float_wav()), 415, "unsupported_media_type"),
    (("audio", wav(8, 0.5)[:-7]), 400, "bad_media"),
    (("audio", wav(8, 2.5)), 413, "too_large"),
    (("audio", image(8)), 400, "bad_media"),
    (("audio", wav(8), {"media_type": "audio/mpeg"}), 415, "unsupported_media_type"),
    (("video", MP4[:200]), 400, "bad_media"),
    (("video", video(9, frames=4, fmt="webm")), 415, "unsupported_media_type"),
    (("video", video(9, frames=4, fmt="mov")), 415, "unsupported_media_type"),
    (("video", video(9, frames=4, size=(64, 48))), 413, "too_large"),
    (("video", video(9, frames=16, fps=4)), 413, "too_large"),
    (("video", MP4, {"media_type": "video/webm"}), 415, "unsupported_media_type"),
    (("video", image(8)), 400, "bad_media"),
    (("image", MP4), 400, "bad_media"),
])
def test_bad_media_answers(item, status, kind):
    with pytest.raises(HTTPError) as err:
        parse_chat(_body("x", item), LIMITS, MODEL, lambda i: 1)
    assert (err.value.status, err.value.code) == (status, kind), err.value.message
    assert err.value.param == "messages[0].content[1]" and "messages[0].content[1]" in err.value.message
    with pytest.raises(HTTPError) as err:                   # the same item in the history
        parse_chat(_body("x", history=[(["y", item], "ok")]), LIMITS, MODEL, lambda i: 1)
    assert (err.value.status, err.value.code, err.value.param) == (status, kind, "messages[0].content[1]")


def _weights_dir(tmp_path: Path, config: bool = True, weights: bool = True) -> Path:
    d = tmp_path / f"model-{int(config)}{int(weights)}"
    d.mkdir(exist_ok=True)
    if config:
        (d / "config.json").write_text("{}")
    if weights:
        (d / "model.safetensors").write_bytes(b"\0" * 8)
    return d


@pytest.mark.parametrize("case,message", [
    ("missing", "not a local directory"),
    ("hub_id", "hub id"),
    ("no_config", "no config.json"),
    ("no_weights", "need a download"),
    ("path_alone", "go together"),
])
def test_model_path_must_be_a_local_weights_directory(tmp_path, case, message):
    model = {
        "missing": {"path": str(tmp_path / "nowhere")},
        "hub_id": {"path": "Qwen/Qwen2-VL-2B-Instruct"},
        "no_config": {"path": str(_weights_dir(tmp_path, config=False))},
        "no_weights": {"audio_path": str(_weights_dir(tmp_path, weights=False))},
        "path_alone": {"path": str(_weights_dir(tmp_path))},
    }[case]
    with pytest.raises(ConfigError) as err:
        ServeAppConfig.parse({"model": model})
    assert message in str(err.value) and any(f.startswith("model") for f in err.value.fields)


def test_model_path_resolves_to_an_absolute_directory(tmp_path, monkeypatch):
    d = _weights_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = ServeAppConfig.parse({"model": {"path": d.name, "audio_path": str(d), "seed": 3}})
    assert cfg.model.path == str(d.resolve()) and cfg.model.kind == "hf"
    assert ServeAppConfig.parse(cfg.model_dump(mode="json")).model == cfg.model     # workers re-parse
    with pytest.raises(ConfigError) as err:
        ServeAppConfig.parse({"model": {"kind": "llama"}})
    assert err.value.fields == ("model.kind",)


def test_router_fails_a_request_over_to_another_node():
    from mmtier.serve.routing import Router

    router = Router(["a", "b", "c"])
    router.inflight.update({"a": 0, "b": 2, "c": 1})
    route = router.failover("a", {"a": 10})
    assert (route.node, route.rule, route.scores) == ("c", "failover", {"a": 10})
    assert Router(["a"]).failover("a", {}) is None


def test_a_model_that_takes_no_video_answers_415_and_the_hf_frontend_counts_video_tokens():
    """A model with no video encoder (its frontend's ``media_tokens`` says so) makes a video
    item a 415 before anything is routed. The chat model's frontend counts a video's tokens from its header (frames sampled at
    2 fps, 16 tokens a temporal patch of 112x112 frames) and keys its segments' tower outputs."""
    from mmtier.serve.chat_model import HFFrontend

    def no_video(item):                     # the media_tokens of a model that takes text and images
        if item.type == "video":
            raise BadMediaError("this model takes no video items", unsupported=True)
        return 1

    with pytest.raises(HTTPError) as err:
        parse_chat(_body("x", ("video", MP4)), LIMITS, MODEL, no_video)
    assert (err.value.status, err.value.code) == (415, "unsupported_media_type")
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    frontend = HFFrontend.load(ServeAppConfig.parse({}).model)
    clip = video(5, frames=16, size=(112, 112), fps=4)          # 4 s: 8 frames, 4 temporal patches
    assert frontend.media_tokens("video", clip) == 4 * 16 + 2

    class Keys:                                                 # content_key's arguments, recorded
        def content_key(self, modality, data, **kw):
            return (modality, kw["params"]["segment"])

    assert frontend.routing_keys(Keys(), "acme", "video", clip) == [("video_embed", "0-2/4"), ("video_embed", "2-4/4")]


def test_streamed_pieces_join_to_the_answer_and_cut_at_whole_characters():
    """The SSE deltas of an answer: one per token that completes a character (a character of
    several UTF-8 bytes goes out with its last byte), joined: the whole text."""
    import random

    from mmtier.chat.media import ids_text, text_ids
    from mmtier.serve.completions import chunks, pieces

    for seed in range(200):
        rng = random.Random(seed)
        ids = [rng.randrange(4, 260) for _ in range(rng.randrange(1, 16))] + text_ids("\u20ac")
        text = ids_text(ids)
        got = pieces(text, ids)
        assert "".join(got) == text and len(got) <= len(ids)
        assert all(p.encode() for p in got)          # valid text: no piece splits a character
    assert pieces("a\u20acb", text_ids("a\u20acb")) == ["a", "\u20ac", "b"]
    answer = {"tokens": text_ids("a\u20ac"), "text": "a\u20ac", "prompt_tokens": 9, "cached_tokens": 4}
    lines = list(chunks("chatcmpl-x", MODEL, answer, 4, True, {"node": "n"}))
    assert lines[-1] == b"data: [DONE]\n\n"
    events = [json.loads(line[len(b"data: "):]) for line in lines[:-1]]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == "a\u20ac"
    assert events[-1]["choices"] == [] and events[-1]["usage"] == {
        "prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 4}}
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-2]["mmtier"] == {"node": "n"}


def test_mmtier_start_leaves_a_gpu_to_its_engine_unless_told_otherwise():
    """The serving layout (``gpu_pools: engines``, the default) puts no model-less pool on a GPU
    node (the engine that runs there holds its pool); ``actors`` gives each GPU a pool actor;
    a node without a GPU gets a CPU pool either way."""
    from mmtier.cluster.launch import device_pools
    from mmtier.cluster.settings import ClusterSettings

    gpu_node = {"NodeID": "n1", "Resources": {"CPU": 8.0, "GPU": 2.0}}
    cpu_node = {"NodeID": "n2", "Resources": {"CPU": 8.0}}
    serving = ClusterSettings()
    assert serving.gpu_pools == "engines" and device_pools(gpu_node, serving) == []
    assert device_pools(cpu_node, serving) == [("mmtier-pool:n2:cpu0", "cpu", {})]
    actors = ClusterSettings(gpu_pools="actors")
    assert [(n, d, r) for n, d, r in device_pools(gpu_node, actors)] == [
        ("mmtier-pool:n1:gpu0", "cuda", {"num_gpus": 1}), ("mmtier-pool:n1:gpu1", "cuda", {"num_gpus": 1})]
    assert device_pools(cpu_node, actors) == device_pools(cpu_node, serving)
    with pytest.raises(ValueError):
        ClusterSettings(gpu_pools="both")
