"""The Serve app's chat engines without Ray: the transformers chat model behind the worker's
engine interface, over a real ``TieredKVCache``, answering stateless requests (each carries its
conversation's history, as an OpenAI ``messages`` list does); its ingress frontend; real weights
loaded from local directories (``model: {path, audio_path}``)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers, Pillow) is not installed")

from mmtier import TieredKVCache  # noqa: E402
from mmtier.chat.model import dense_chat  # noqa: E402
from mmtier.errors import BadMediaError, ShapeError  # noqa: E402
from mmtier.serve.chat_model import load_chat  # noqa: E402
from mmtier.serve.config import ModelArgs  # noqa: E402
from mmtier.serve.engine_loader import load_engine, load_frontend  # noqa: E402
from tests.support.media_samples import image, video, wav  # noqa: E402

NEW = 3


@pytest.fixture(scope="module")
def engine():
    return load_engine(ModelArgs(seed=0))


def converse(engine, cache, tenant: str, turns) -> list:
    """Each turn a stateless request carrying the turns before it and their answers' text."""
    history, outs = [], []
    for t in turns:
        out = engine.answer(cache, tenant, history, t, NEW)
        outs.append(out)
        history.append((t, out.text))
    return outs


def test_an_answer_sent_back_as_text_is_the_same_tokens():
    """The byte-level vocabulary's text is lossless: random answer ids (most not UTF-8), and
    text with characters of every width, come back as the same ids (the old text form replaced
    bytes that are not UTF-8 with U+FFFD, so a client's history lost them)."""
    import random

    from mmtier.chat.media import ESCAPE0, ids_text, text_ids

    rng = random.Random()
    for _ in range(500):
        ids = [rng.randrange(4, 260) for _ in range(rng.randrange(1, 24))]
        assert text_ids(ids_text(ids)) == ids
    for text in ("plain", "h\u00e9 \u20ac \U0001f600", chr(ESCAPE0 + 0x41) + "x"):
        ids = text_ids(text)
        assert text_ids(ids_text(ids)) == ids
    assert ids_text(text_ids("h\u00e9")) == "h\u00e9"


def test_turns_match_the_dense_chat_and_count_what_ran(engine):
    png, clip = image(11, (64, 48)), wav(11, 0.5)
    turns = [[("text", "Look: "), ("image", png), ("text", " what is it?")],
             [("text", "and "), ("audio", clip)],
             [("text", "ok?")]]
    dense = dense_chat(engine.chat, [[p for _k, p in t] for t in turns], NEW)
    with TieredKVCache(engine.chat.cache_config(device_bytes=32 << 20)) as cache:
        outs = converse(engine, cache, "acme", turns)
        assert [o.tokens for o in outs] == dense
        assert outs[0].counts["encoder_runs"] == {"image": 1} and outs[0].cached_tokens == 0
        assert outs[1].counts["encoder_runs"] == {"audio": 1}
        assert outs[1].counts["transcript_tokens"] > 0
        # each request's history is found by key: all of it but the last answer token (its
        # K/V is the next turn's to write) is attached, nothing of it prefilled again
        for before, out in zip(outs, outs[1:]):
            assert out.cached_tokens == before.prompt_tokens + len(before.tokens) - 1
        assert outs[2].counts["encoder_runs"] == {} and outs[2].counts["transcript_hits"] == 1
        assert outs[2].prompt_tokens == outs[2].cached_tokens + outs[2].counts["prefilled_tokens"]
        # the ingress's prefix keys are the spans the requests sealed; another tenant's are not held
        frontend = load_frontend(ModelArgs(seed=0))
        prefix = frontend.prefix_keys(cache, "acme", [(turns[0], outs[0].text)], turns[1])
        assert len(prefix) >= 3 and all(cache.contains(k) for k in prefix)
        assert not any(cache.contains(k) for k in
                       frontend.prefix_keys(cache, "globex", [(turns[0], outs[0].text)], turns[1]))
        # the ingress's keys are the content-only groups the turns left in the cache
        frontend = load_frontend(ModelArgs(seed=0))
        want = {"image": ["vision_embed"], "audio": ["transcript_ids", "audio"]}
        for kind, data in (("image", png), ("audio", clip)):
            keys = frontend.routing_keys(cache, "acme", kind, data)
            assert [k.modality for k in keys] == want[kind] and all(cache.contains(k) for k in keys)
            assert not any(cache.contains(k) for k in frontend.routing_keys(cache, "globex", kind, data))
        # a second conversation (another prefix) with the same image and clip runs no encoder,
        # and the clip's transcript comes from the cache (no Whisper decoder either)
        again = engine.answer(cache, "acme", [], [("text", "hear "), ("audio", clip), ("text", "see "),
                                                  ("image", png)], NEW)
        assert again.counts["encoder_runs"] == {} and again.counts["media_hits"] == {"audio": 1}
        assert again.counts["embedding_hits"] == {"image": 1}
        assert again.counts["transcript_hits"] == 1 and again.counts["transcript_tokens"] == 0


def test_frontend_counts_image_tokens_as_the_conversation_adds_them(engine):
    frontend = load_frontend(ModelArgs(seed=0))
    png = image(12, (120, 90))
    with TieredKVCache(engine.chat.cache_config(device_bytes=32 << 20)) as cache:
        out = engine.answer(cache, "acme", [], [("image", png), ("text", "x")], 1)
        # the prompt: the image with its two markers, then one text token
        assert out.counts["prefilled_tokens"] == out.prompt_tokens == frontend.media_tokens("image", png) + 1


def test_a_video_turn_through_the_engine_and_its_frontend(engine):
    """A video's tokens as the frontend counts them are those the conversation prefills; its
    segments' ``video_embed`` groups are the routing keys, held after the turn; a second
    conversation with the video at another place runs no vision tower; equal to dense."""
    pytest.importorskip("av", reason="the hf extra (PyAV) is not installed")
    frontend = load_frontend(ModelArgs(seed=0))
    mp4 = video(14, frames=16, size=(112, 112), fps=4)        # 8 frames sampled: 2 segments
    turns = [[("video", mp4), ("text", "x")], [("text", "and "), ("video", mp4)]]
    with TieredKVCache(engine.chat.cache_config(device_bytes=32 << 20)) as cache:
        first = engine.answer(cache, "acme", [], turns[0], NEW)
        assert first.counts["prefilled_tokens"] == frontend.media_tokens("video", mp4) + 1 == 4 * 16 + 3
        assert first.counts["encoder_runs"] == {"video": 1}
        keys = frontend.routing_keys(cache, "acme", "video", mp4)
        assert [k.modality for k in keys] == ["video_embed"] * 2 and all(cache.contains(k) for k in keys)
        second = engine.answer(cache, "acme", [(turns[0], first.text)], turns[1], NEW)
        assert second.counts["encoder_runs"] == {} and second.counts["embedding_hits"] == {"video": 2}
        assert second.cached_tokens == first.prompt_tokens + NEW - 1
        assert [first.tokens, second.tokens] == dense_chat(engine.chat, [[p for _k, p in t] for t in turns], NEW)


def test_check_refuses_bad_turns_before_anything_runs(engine):
    png = image(13)
    with pytest.raises(BadMediaError):
        engine.check([], [("image", png[:40])], 2)
    with pytest.raises(BadMediaError):
        engine.check([], [("audio", png)], 2)
    with pytest.raises(BadMediaError):
        engine.check([], [("video", png)], 2)
    with pytest.raises(BadMediaError):                         # bad media in the history too
        engine.check([([("image", png[:40])], "ok")], [("text", "hi")], 2)
    with pytest.raises(ShapeError):
        engine.check([], [("text", "hi")], 0)
    with pytest.raises(ShapeError):
        engine.check([([("text", "hi")], "")], [("text", "hi")], 2)
    engine.check([([("text", "a")], "b")], [("text", "hi"), ("image", png), ("audio", wav(13, 0.2))], 2)


def test_real_weights_from_local_directories(tmp_path, engine):
    """``model: {path, audio_path}`` loads saved weights and processors with no download: the
    same model as the random-weight one it was saved from, token for token."""
    chat = engine.chat
    vlm_dir, whisper_dir = tmp_path / "vlm", tmp_path / "whisper"
    chat.dense_vlm.save_pretrained(vlm_dir)
    chat.image_processor.save_pretrained(vlm_dir)
    chat.dense_whisper.save_pretrained(whisper_dir)
    chat.feature_extractor.save_pretrained(whisper_dir)
    args = ModelArgs(path=str(vlm_dir), audio_path=str(whisper_dir))
    loaded = load_engine(args)
    assert load_chat(args) is loaded.chat
    png, clip = image(14, (56, 56)), wav(14, 0.3)
    turn = [("text", "see "), ("image", png), ("text", "hear "), ("audio", clip)]
    assert str(vlm_dir) in loaded.chat.cache_config().model     # its own identity (own keys)
    with TieredKVCache(loaded.chat.cache_config(device_bytes=32 << 20)) as cache:
        assert loaded.answer(cache, "acme", [], turn, NEW).tokens == dense_chat(chat, [[p for _k, p in turn]], NEW)[0]
    assert load_frontend(args).media_tokens("image", png) == load_frontend(ModelArgs()).media_tokens("image", png)


def test_weights_that_do_not_load_are_a_config_error(tmp_path):
    from mmtier.errors import ConfigError

    for name in ("vlm", "whisper"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")                 # no model_type
        (tmp_path / name / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ConfigError) as err:
        load_engine(ModelArgs(path=str(tmp_path / "vlm"), audio_path=str(tmp_path / "whisper")))
    assert err.value.fields == ("model.path",) and "without a download" in str(err.value)
