"""The chat layer (``mmtier.chat.model``): a Qwen2-VL + Whisper conversation over one
mmtier cache answers every turn with the tokens of the dense path (``DynamicCache`` + sdpa, the
conversation recomputed), prefills only each turn's new tokens, runs no vision tower or audio
encoder for cached media, never hits across tenants, and stays equal when a small budget moves
its groups to host and disk. The models are the demo's configs with random weights; the media are
real PNG / JPEG / WAV bytes made here (small images, so each test takes seconds)."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("PIL", reason="the hf extra (Pillow) is not installed")

from PIL import Image  # noqa: E402

from mmtier import ShapeError, TieredKVCache  # noqa: E402
from mmtier.chat.model import ChatModel, dense_chat  # noqa: E402

NEW = 5


def picture(seed: int, size=(112, 112), fmt="PNG") -> bytes:
    rng = np.random.default_rng(seed)
    arr = (rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


def clip(seed: int, seconds: float = 1.0, rate: int = 8000) -> bytes:
    """A tone plus noise at 8 kHz (the chat model resamples to Whisper's 16 kHz)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.4 * np.sin(2 * np.pi * (220 + 70 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def chat():
    torch.set_num_threads(1)
    return ChatModel.tiny(seed=3)


def turns(tag: int):
    return [["You are a helpful assistant. Look at this. ", picture(tag)],
            ["What changed? ", picture(tag + 1, (84, 140), "JPEG"), " Listen: ", clip(tag)],
            ["And this one again? ", picture(tag)]]


def test_three_turns_equal_dense_and_prefill_only_new_tokens(chat):
    convo = turns(1)
    want = dense_chat(chat, convo, NEW)
    with TieredKVCache(chat.cache_config(device_bytes=64 << 20)) as cache:
        conv = chat.conversation(cache, tenant="acme")
        forwards = []
        hook = chat.vlm.model.language_model.register_forward_hook(lambda *_: forwards.append(1))
        got = []
        try:
            for items in convo:
                forwards.clear()
                got.append(conv.send(items, NEW))
                # the spans the cache lacks (a text run and an image) in ONE decoder forward,
                # then generate: the turn's last span and NEW - 1 decode steps
                assert len(forwards) == 1 + NEW
        finally:
            hook.remove()
        assert [r.tokens for r in got] == want
        first, second, third = (r.counters for r in got)
        assert first.cached_tokens == 0 and first.encoder_runs == {"vision": 1, "video": 0, "audio": 0}
        # turn 2 attaches all of turn 1 (its prompt and its answer but the answer's last token)
        assert second.cached_tokens == first.prefilled_tokens + NEW - 1
        assert second.encoder_runs == {"vision": 1, "video": 0, "audio": 1} and second.transcript_tokens == chat.transcript_tokens
        # turn 3: the first image again, at a new place: its decoder K/V is prefilled (new
        # prefix), its vision tower output comes from the cache
        assert third.cached_tokens == second.cached_tokens + second.prefilled_tokens + NEW - 1
        assert third.encoder_runs == {"vision": 0, "video": 0, "audio": 0} and third.embedding_hits == 1
        assert third.prefilled_tokens == len(conv.ids) - NEW - third.cached_tokens
        assert cache.stats().sequences == 0          # nothing held between turns
        conv.close()


def test_cached_opening_and_clip_run_no_encoder_and_no_other_tenant_hits(chat):
    convo = turns(5)
    with TieredKVCache(chat.cache_config(device_bytes=64 << 20)) as cache:
        a = chat.conversation(cache, tenant="acme")
        ref = [a.send(items, NEW) for items in convo[:2]]
        runs = dict(chat.encoder_runs)
        b = chat.conversation(cache, tenant="acme")          # same opening, same clip
        again = b.send(convo[0], NEW)
        assert chat.encoder_runs == runs                     # no vision tower (hook count)
        assert again.counters.media_hits["vision"] == 1 and again.counters.prefilled_tokens < 10
        assert again.tokens == ref[0].tokens
        decoder = []
        hook = chat.whisper.model.decoder.register_forward_hook(lambda *_: decoder.append(1))
        try:
            listen = b.send(["Listen: ", convo[1][3]], NEW)
        finally:
            hook.remove()
        # the clip's transcript ids come from its transcript_ids group: no Whisper at all
        assert listen.counters.media_hits["audio"] == 1 and listen.counters.encoder_runs["audio"] == 0
        assert listen.counters.transcript_hits == 1 and listen.counters.transcript_tokens == 0
        assert decoder == [] and chat.encoder_runs["audio"] == runs["audio"]
        assert listen.tokens == dense_chat(chat, [convo[0], ["Listen: ", convo[1][3]]], NEW)[1]

        other = chat.conversation(cache, tenant="globex").send(convo[0], NEW)
        assert other.counters.cached_tokens == 0 and other.counters.media_hits["vision"] == 0
        assert other.counters.encoder_runs["vision"] == 1 and other.counters.embedding_hits == 0
        assert other.tokens == ref[0].tokens                 # same model, same answer


def test_an_invalid_transcript_group_is_a_miss_and_whisper_runs(chat):
    """A transcript_ids group whose values are not token ids (not whole numbers, or past
    Whisper's vocabulary) is never read as a transcript: Whisper runs and the turn equals the
    dense path. Another tenant's transcript of the same clip is never used."""
    from mmtier.chat.conversation import transcript_key

    sound = clip(7)
    items = ["Listen: ", sound]
    want = dense_chat(chat, [items], NEW)[0]
    vocab = chat.whisper.config.vocab_size
    for bad in (torch.tensor([[3.5], [7.0]]), torch.tensor([[float(vocab)]]), torch.tensor([[-1.0]])):
        with TieredKVCache(chat.cache_config(device_bytes=64 << 20)) as cache:
            cache.put_embedding(transcript_key(cache, "acme", sound, chat.transcript_tokens), bad)
            r = chat.conversation(cache, tenant="acme").send(items, NEW)
            assert r.counters.transcript_hits == 0 and r.counters.transcript_tokens > 0
            assert r.tokens == want
    with TieredKVCache(chat.cache_config(device_bytes=64 << 20)) as cache:
        chat.conversation(cache, tenant="acme").send(items, NEW)
        other = chat.conversation(cache, tenant="globex").send(items, NEW)
        assert other.counters.transcript_hits == 0 and other.counters.encoder_runs["audio"] == 1
        assert other.tokens == want


def test_small_budget_moves_groups_to_host_and_disk_and_stays_equal(chat, tmp_path):
    """Two conversations interleaved in an arena of a few pages per pool: history groups go
    to host and disk between turns and come back; every turn equals the dense path."""
    convs = [turns(11), turns(21)]
    want = [dense_chat(chat, c, NEW) for c in convs]
    cfg = chat.cache_config(device_bytes=12 << 20, host_bytes=3 << 20, disk_dir=tmp_path, disk_bytes=256 << 20,
                            shares={"text": 0.3, "vision": 0.2, "vision_embed": 0.05, "transcript": 0.05,
                                    "audio": 0.28, "video": 0.1})    # every pool gets at least one page
    with TieredKVCache(cfg) as cache:
        open_ = [chat.conversation(cache, tenant="acme") for _ in convs]
        got = [[], []]
        for i in range(3):
            for n, conv in enumerate(open_):
                got[n].append(conv.send(convs[n][i], NEW).tokens)
        assert got == want
        counters = cache.stats().counters
        assert counters.get("spills_to_host", 0) > 0 and counters.get("spills_to_disk", 0) > 0
        assert counters.get("restores", 0) + counters.get("lower_tier_attentions", 0) > 0


def test_bad_items_raise_typed_errors_and_change_nothing(chat):
    with TieredKVCache(chat.cache_config(device_bytes=64 << 20)) as cache:
        conv = chat.conversation(cache, tenant="acme")
        conv.send(["Hello. "], 2)
        ids, spans = list(conv.ids), list(conv.spans)
        for bad in ([b"GIF89a not supported"], [b"\x89PNG\r\n\x1a\n truncated"],
                    [b"RIFF\x00\x00\x00\x00WAVEjunk"], [3.5], []):
            with pytest.raises(ShapeError):
                conv.send(bad, 2)
        with pytest.raises(ShapeError):
            conv.send(["fine"], 0)
        assert conv.ids == ids and conv.spans == spans and cache.stats().sequences == 0
