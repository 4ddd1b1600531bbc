"""The Serve app's request side without Ray: media checks (Pillow, PyAV, ``wave``), the
protocol's status codes for bad media, and the ``model`` section of its config. Videos are real
MP4 / WebM / QuickTime bytes encoded here by PyAV."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

pytest.importorskip("PIL", reason="the hf extra (Pillow) is not installed")

from mmtier.errors import BadMediaError, ConfigError  # noqa: E402
from mmtier.serve.config import Limits, ServeAppConfig  # noqa: E402
from mmtier.serve.media import TooLargeMedia, check_image, check_video, check_wav  # noqa: E402
from mmtier.serve.protocol import HTTPError, parse_turn  # noqa: E402

from .media_samples import float_wav, image, video, wav  # noqa: E402

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


def _body(*items) -> bytes:
    content = [{"type": "text", "text": i} if isinstance(i, str)
               else {"type": i[0], "data": base64.b64encode(i[1]).decode(), **(i[2] if len(i) > 2 else {})}
               for i in items]
    return json.dumps({"content": content, "max_new_tokens": 2}).encode()


def test_parse_turn_decodes_media_once_and_counts_their_tokens():
    png, clip = image(7, (32, 16)), wav(7, 0.5)
    seen = []
    turn = parse_turn(_body("look ", ("image", png, {"media_type": "image/png"}), ("audio", clip),
                            ("video", MP4, {"media_type": "video/mp4"})),
                      LIMITS, lambda item: seen.append(item.type) or 10)
    assert [m.info.media_type for m in turn.media] == ["image/png", "audio/wav", "video/mp4"]
    assert turn.media[0].info.width == 32 and turn.media[1].info.frames == 8000 and turn.media[2].info.header.frames == 8
    assert seen == ["image", "audio", "video"]
    with pytest.raises(HTTPError) as err:                 # 5 + 2 + 10 + 10 tokens over a limit of 20
        parse_turn(_body("look ", ("image", png), ("audio", clip)),
                   Limits(**{**LIMITS.model_dump(), "max_turn_tokens": 20}), lambda item: 10)
    assert err.value.status == 413


@pytest.mark.parametrize("item,status,kind", [
    (("image", image(8, (16, 16))[:60]), 400, "bad_media"),
    (("image", image(8, (8, 8), "GIF")), 415, "unsupported_media_type"),
    (("image", image(8, (65, 64))), 413, "too_large"),
    (("image", image(8), {"media_type": "image/gif"}), 415, "unsupported_media_type"),
    (("image", image(8), {"media_type": "image/jpeg"}), 415, "unsupported_media_type"),   # bytes are PNG
    (("image", image(8), {"mime": "image/png"}), 400, "bad_request"),
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
        parse_turn(_body("x", item), LIMITS, lambda i: 1)
    assert (err.value.status, err.value.kind) == (status, kind), err.value.message
    assert "content[1]" in err.value.message


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
    ("reference_with_path", "need kind 'hf'"),
    ("path_alone", "go together"),
])
def test_model_path_must_be_a_local_weights_directory(tmp_path, case, message):
    model = {
        "missing": {"path": str(tmp_path / "nowhere")},
        "hub_id": {"path": "Qwen/Qwen2-VL-2B-Instruct"},
        "no_config": {"path": str(_weights_dir(tmp_path, config=False))},
        "no_weights": {"audio_path": str(_weights_dir(tmp_path, weights=False))},
        "path_alone": {"path": str(_weights_dir(tmp_path))},
        "reference_with_path": {"kind": "reference", "path": str(_weights_dir(tmp_path))},
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


def test_router_fails_a_new_conversation_over_to_another_node():
    from mmtier.serve.routing import Router

    router = Router(["a", "b", "c"])
    router.inflight.update({"a": 0, "b": 2, "c": 1})
    route = router.failover("a", {"a": 10})
    assert (route.node, route.rule, route.scores) == ("c", "failover", {"a": 10})
    assert Router(["a"]).failover("a", {}) is None


def test_a_model_that_takes_no_video_answers_415_and_the_hf_frontend_counts_video_tokens():
    """The reference model has no video encoder: a video item is a 415 before anything is
    routed. The chat model's frontend counts a video's tokens from its header (frames sampled at
    2 fps, 16 tokens a temporal patch of 112x112 frames) and keys its segments' tower outputs."""
    from mmtier.serve.engines import ReferenceEngine
    from mmtier.serve.hf_engine import HFFrontend

    reference = ReferenceEngine(0)
    with pytest.raises(HTTPError) as err:
        parse_turn(_body("x", ("video", MP4)), LIMITS, lambda item: reference.media_tokens(item.type, item.data))
    assert (err.value.status, err.value.kind) == (415, "unsupported_media_type")
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    frontend = HFFrontend.load(ServeAppConfig.parse({}).model)
    clip = video(5, frames=16, size=(112, 112), fps=4)          # 4 s: 8 frames, 4 temporal patches
    assert frontend.media_tokens("video", clip) == 4 * 16 + 2

    class Keys:                                                 # content_key's arguments, recorded
        def content_key(self, modality, data, **kw):
            return (modality, kw["params"]["segment"])

    assert frontend.routing_keys(Keys(), "acme", "video", clip) == [("video_embed", "0-2/4"), ("video_embed", "2-4/4")]
