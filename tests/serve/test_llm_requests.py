"""The OpenAI ingress's request checks and tenant salts (``mmtier.serve.llm_requests``,
``mmtier.serve.llm_tenants``): pure code, no Ray or vLLM; the served path is
``tests/serve/test_llm.py``'s."""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json

import pytest

from mmtier.errors import ConfigError
from mmtier.serve.llm_requests import (
    RequestError,
    RequestLimits,
    check_messages,
    parse_body,
    refuse_client_salt,
    tenant_media_ids,
)
from mmtier.serve.llm_tenants import SALT_DOMAIN, IngressArgs, TenantSalts
from mmtier.serve.tiny_models import image
from tests.support import media_samples
from tests.support.media_samples import video

LIMITS = RequestLimits()
IMAGE = frozenset({"image"})


def url_of(fmt: str, declared: str | None = None, cut: bool = False, seed: int = 1) -> str:
    buf = io.BytesIO()
    image(seed).save(buf, fmt)
    data = buf.getvalue()[: len(buf.getvalue()) // 2] if cut else buf.getvalue()
    return f"data:{declared or 'image/' + fmt.lower()};base64," + base64.b64encode(data).decode()


def chat_with(*parts) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "w1"},
                                       {"role": "user", "content": list(parts)}]}


def refused(body: dict, accepts=IMAGE) -> RequestError:
    with pytest.raises(RequestError) as err:
        check_messages(body, "m", accepts, LIMITS)
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}
    return err.value


def test_png_and_jpeg_data_urls_pass():
    check_messages(chat_with({"type": "image_url", "image_url": {"url": url_of("PNG")}},
                             {"type": "image_url", "image_url": {"url": url_of("JPEG")}},
                             {"type": "text", "text": "w2"}), "m", IMAGE, LIMITS)


@pytest.mark.parametrize(("url", "code"), [
    (url_of("GIF"), "invalid_image_format"),
    (url_of("GIF", declared="image/png"), "invalid_image_format"),
    (url_of("JPEG", declared="image/png"), "invalid_image_format"),      # declares one, holds another
    (url_of("PNG", cut=True), "invalid_image"),
    ("data:image/png;base64,iVBORw0K!!!", "invalid_base64"),
    ("data:image/png;base64,", "invalid_value"),
    ("data:image/png,rawbytes", "invalid_image_url"),                     # not base64
    ("https://example.com/cat.png", "invalid_image_url"),                  # nothing is fetched
])
def test_bad_images_are_refused_with_the_part_named(url, code):
    err = refused(chat_with({"type": "text", "text": "w"}, {"type": "image_url", "image_url": {"url": url}}))
    assert (err.status, err.code, err.param) == (400, code, "messages[1].content[1].image_url.url")


def test_media_a_model_does_not_take_is_a_400_that_says_what_it_takes():
    wav = base64.b64encode(b"RIFF....WAVE").decode()
    err = refused(chat_with({"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}))
    assert (err.status, err.code, err.param) == (400, "unsupported_modality", "messages[1].content[0]")
    assert "takes no audio" in err.message and "text, image" in err.message
    err = refused(chat_with({"type": "image_url", "image_url": {"url": url_of("PNG")}}), accepts=frozenset())
    assert err.code == "unsupported_modality" and "it takes: text " in err.message


def test_wav_input_audio_where_the_model_takes_audio():
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x01\x02" * 1600)
    good = base64.b64encode(buf.getvalue()).decode()
    check_messages(chat_with({"type": "input_audio", "input_audio": {"data": good, "format": "wav"}}), "m",
                   frozenset({"audio"}), LIMITS)
    err = refused(chat_with({"type": "input_audio", "input_audio": {"data": good, "format": "flac"}}),
                  accepts=frozenset({"audio"}))
    assert err.param == "messages[1].content[0].input_audio.format"
    err = refused(chat_with({"type": "input_audio", "input_audio": {"data": good, "format": "mp3"}}),
                  accepts=frozenset({"audio"}))                     # WAV bytes declared MP3
    assert err.param == "messages[1].content[0].input_audio.data" and "not an MP3" in err.message
    cut = base64.b64encode(buf.getvalue()[:60]).decode()
    err = refused(chat_with({"type": "input_audio", "input_audio": {"data": cut, "format": "wav"}}),
                  accepts=frozenset({"audio"}))
    assert err.param == "messages[1].content[0].input_audio.data"


def video_url(data: bytes, declared: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": f"data:{declared};base64," + base64.b64encode(data).decode()}}


def test_mp4_video_urls_where_the_model_takes_video():
    """``video_url`` as vLLM's server takes it, a ``data:video/mp4`` URL, checked in full."""
    limits = RequestLimits(max_video_seconds=3.0, max_video_frames=20, max_video_pixels=48 * 48)
    video_only = frozenset({"video"})
    mp4 = video(1, frames=8, size=(32, 24), fps=4)
    check_messages(chat_with(video_url(mp4), {"type": "text", "text": "w"}), "m", video_only, limits)
    where = "messages[1].content[0].video_url.url"
    for part, code in [
        (video_url(mp4[: len(mp4) // 2]), "invalid_video"),                         # cut short
        (video_url(mp4, "video/webm"), "invalid_video_format"),                     # declared another type
        (video_url(video(1, frames=4, fmt="webm")), "invalid_video_format"),        # WebM declared MP4
        (video_url(media_samples.image(1)), "invalid_video"),                    # not a video
        (video_url(video(2, frames=21, fps=30)), "video_too_large"),                # over 20 frames
        (video_url(video(3, frames=16, fps=4)), "video_too_large"),                 # 4 s, over 3 s
        (video_url(video(4, frames=2, size=(64, 48))), "video_too_large"),          # frames over 48 x 48
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA!!"}}, "invalid_base64"),
        ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, "invalid_video_url"),
        ({"type": "video_url", "video_url": {}}, "invalid_video_url"),
    ]:
        with pytest.raises(RequestError) as err:
            check_messages(chat_with(part), "m", video_only, limits)
        assert (err.value.status, err.value.code, err.value.param) == (400, code, where), err.value.message
    for typeless in ({"video_url": {"url": video_url(mp4[:99])["video_url"]["url"]}}, {"video_url": "data:,"},
                     {"text": "w"}):                       # vLLM would read the first two as videos
        with pytest.raises(RequestError) as err:
            check_messages(chat_with(typeless), "m", video_only, limits)
        assert (err.value.code, err.value.param) == ("missing_required_parameter", "messages[1].content[0].type")
    err = refused(chat_with(video_url(mp4)))                                      # a model without video
    assert (err.code, err.param) == ("unsupported_modality", "messages[1].content[0]")
    assert IngressArgs(api_keys={"k": "a"}, max_video_frames=7).limits().max_video_frames == 7


def test_bodies_that_are_not_json_objects_and_client_salts():
    for raw in (b"{", b"[1]", b"\xff\xfe", b'"text"'):
        with pytest.raises(RequestError) as err:
            parse_body(raw, LIMITS)
        assert err.value.code == "invalid_json" and err.value.status == 400
    with pytest.raises(RequestError) as err:
        parse_body(b"{}" + b" " * 100, RequestLimits(max_body_bytes=64))
    assert err.value.status == 413
    assert parse_body(b'{"model": "m"}', LIMITS) == {"model": "m"}
    with pytest.raises(RequestError) as err:
        refuse_client_salt({"cache_salt": "someone-else"})
    assert (err.value.param, err.value.code) == ("cache_salt", "unsupported_parameter")


def test_tenant_salts_are_hmacs_under_the_secret(monkeypatch):
    monkeypatch.setenv("MMTIER_KEY_SECRET", "s3cret")
    salts = IngressArgs(api_keys={"k": "a"}).salts()
    want = hmac.new(b"s3cret", SALT_DOMAIN + b"a", hashlib.sha256).hexdigest()
    assert salts.salt("a") == want and salts.salt("b") != want
    assert TenantSalts(b"other").salt("a") != want                  # another secret, another salt
    monkeypatch.delenv("MMTIER_KEY_SECRET")
    with pytest.raises(ConfigError):
        IngressArgs(api_keys={"k": "a"}).salts()                    # the public default only when allowed
    assert IngressArgs(api_keys={"k": "a"}, allow_default_key_secret=True).salts().salt("a") != want


def test_key_table_from_the_config_digests_and_the_environment(monkeypatch):
    monkeypatch.setenv("TEST_KEYS", json.dumps({"sk-env": "env-tenant"}))
    digest = hashlib.sha256(b"sk-hashed").hexdigest()
    table = IngressArgs(api_keys={"sk-plain": "plain"}, api_key_sha256={digest: "hashed"},
                        api_keys_env="TEST_KEYS").key_table()
    assert [table.tenant(k) for k in ("sk-plain", "sk-hashed", "sk-env", "sk-nope", None)] == \
        ["plain", "hashed", "env-tenant", None, None]
    with pytest.raises(ConfigError):
        IngressArgs().key_table()                                    # no keys at all
    with pytest.raises(ConfigError):
        IngressArgs(api_keys_env="UNSET_VARIABLE_X").key_table()
    with pytest.raises(ConfigError):
        IngressArgs.parse({"api_keys": {"k": ""}})
    with pytest.raises(ConfigError):
        IngressArgs.parse({"media": {"m": ["smell"]}})
    with pytest.raises(ConfigError):
        IngressArgs.parse({"tenant": "a"})                           # unknown field


def test_each_media_part_gets_a_uuid_of_its_tenant_and_content():
    """vLLM names an item by its ``uuid``: the same picture is one name within a tenant and two
    across tenants; another picture is another name; a client's uuid is replaced; text is left."""
    def named(salt: str, seed: int, client_uuid: str | None = None) -> str:
        part = {"type": "image_url", "image_url": {"url": url_of("PNG", seed=seed)}}
        if client_uuid is not None:
            part["uuid"] = client_uuid
        body = chat_with(part, {"type": "text", "text": "w1"})
        tenant_media_ids(body, salt)
        assert "uuid" not in body["messages"][1]["content"][1] and body["messages"][0]["content"] == "w1"
        return body["messages"][1]["content"][0]["uuid"]

    a = named("salt-a", 1)
    assert a.startswith("mmtier-") and named("salt-a", 1) == a == named("salt-a", 1, client_uuid="mine")
    assert named("salt-b", 1) != a and named("salt-a", 2) != a
    clip = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    body = chat_with(clip)
    tenant_media_ids(body, "salt-a")
    assert body["messages"][1]["content"][0]["uuid"].startswith("mmtier-")
