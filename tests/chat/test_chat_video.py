"""Video in the chat model (``mmtier.chat.model``): real MP4 bytes made at test time by
PyAV, a video a span per segment (a group of the ``video`` pool). Every turn answers with the
tokens of the dense path (``DynamicCache`` + sdpa, the conversation recomputed, each video whole
through the vision tower); a repeated video runs no vision tower (its segments attached, or at
a new place their ``video_embed`` outputs reused); another tenant never hits; on a tiny video
pool eviction takes whole segments and a later turn re-encodes only the segments it lost."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("av", reason="the hf extra (PyAV) is not installed")

from mmtier import ShapeError, TieredKVCache  # noqa: E402
from mmtier.chat.model import ChatModel, dense_chat  # noqa: E402
from tests.support.media_samples import image, video  # noqa: E402

NEW = 5


@pytest.fixture(scope="module")
def chat():
    torch.set_num_threads(1)
    return ChatModel.tiny(seed=3)


def clip(seed: int, frames: int = 16) -> bytes:
    """112x112 frames at 4 fps: sampled at 2 fps, 16 tokens a temporal patch, a segment of 32."""
    return video(seed, frames=frames, size=(112, 112), fps=4)


def test_video_turns_equal_dense_and_a_repeated_video_runs_no_vision_tower(chat):
    a, b = clip(1), clip(2, frames=24)
    convo = [["You are a helpful assistant. Watch this. ", a, " What happens?"],
             ["Now this picture ", image(3, (112, 112)), " and this video: ", b],
             ["And the first one again? ", a]]
    want = dense_chat(chat, convo, NEW)
    rows = []
    hook = chat.vlm.model.visual.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    try:
        with TieredKVCache(chat.cache_config(device_bytes=96 << 20)) as cache:
            conv = chat.conversation(cache, tenant="acme")
            got = [conv.send(items, NEW) for items in convo]
            assert [r.tokens for r in got] == want
            first, second, third = (r.counters for r in got)
            assert first.encoder_runs == {"vision": 0, "video": 1, "audio": 0}     # both segments, one run
            assert second.encoder_runs == {"vision": 1, "video": 1, "audio": 0}
            assert second.cached_tokens == first.prefilled_tokens + NEW - 1
            # the first video at a new place: its decoder K/V is new, its tower output is cached
            assert third.encoder_runs["video"] == 0 and third.video_embedding_hits == 2
            assert rows == [4 * 64, 64, 6 * 64]       # patch rows: video a (4 temporal patches), the image, video b (6)
            table_video = cache.stats().by_modality["video"]
            assert table_video["puts"] == 2 + 3 + 2 and table_video["stored_tokens"] == 64 + 96 + 64

            again = chat.conversation(cache, tenant="acme").send(convo[0], NEW)      # same opening
            assert again.tokens == got[0].tokens and again.counters.media_hits["video"] == 2
            assert again.counters.encoder_runs["video"] == 0 and again.counters.prefilled_tokens < 20
            other = chat.conversation(cache, tenant="globex").send(convo[0], NEW)
            assert other.tokens == got[0].tokens and other.counters.media_hits["video"] == 0
            assert other.counters.encoder_runs["video"] == 1 and other.counters.video_embedding_hits == 0
            assert cache.stats().sequences == 0
    finally:
        hook.remove()


def test_a_tiny_video_pool_evicts_whole_segments_and_turns_stay_equal(chat):
    """A video pool of four pages (a segment is one): a second conversation's three-segment video
    evicts the first one's tail (leaf first), whole segments only; the first conversation's next
    turn attaches what is left and re-encodes only the segment it lost."""
    a, b = clip(11, frames=24), clip(12, frames=24)            # three segments each
    turns_a = [["Watch: ", a], ["What was it? "]]
    turns_b = [["Look here: ", b]]
    want_a, want_b = dense_chat(chat, turns_a, NEW), dense_chat(chat, turns_b, NEW)
    base = chat.cache_config(device_bytes=64 << 20)
    page = base.modalities["video"]
    page_bytes = page.num_layers * 2 * page.page_size * base.num_kv_heads * base.head_dim * 4
    cfg = chat.cache_config(device_bytes=64 << 20, shares={"video": 4 * page_bytes / (64 << 20) + 1e-9})
    rows = []
    hook = chat.vlm.model.visual.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    try:
        with TieredKVCache(cfg) as cache:
            pool = cache.pools["video"]
            assert pool.num_pages == 4
            conv_a, conv_b = chat.conversation(cache, "acme"), chat.conversation(cache, "acme")
            first = conv_a.send(turns_a[0], NEW)
            segs_a = [s.key for s in conv_a.spans if s.modality == "video"]
            assert len(segs_a) == 3 and pool.num_used == 3
            assert conv_b.send(turns_b[0], NEW).tokens == want_b[0]
            held = [cache.contains(k) for k in segs_a]
            assert held == [True, False, False]            # a's tail segments went, b's three came
            assert pool.num_used == 4                      # whole segments: one page each, no part
            assert cache.stats().counters["evictions"] >= 2
            rows.clear()
            second = conv_a.send(turns_a[1], NEW)
            assert [first.tokens, second.tokens] == want_a
            assert second.counters.media_hits["video"] == 0 and second.counters.span_hits == 2
            # segments 1 and 2 prefilled again; their tower outputs were cached (video_embed)
            assert second.counters.video_embedding_hits == 2 and rows == []
    finally:
        hook.remove()


def test_bad_video_items_raise_typed_errors_and_change_nothing(chat):
    good = clip(21, frames=8)
    with TieredKVCache(chat.cache_config(device_bytes=64 << 20)) as cache:
        conv = chat.conversation(cache, tenant="acme")
        conv.send(["Hello. "], 2)
        ids, spans = list(conv.ids), list(conv.spans)
        for bad in (good[: len(good) // 2], video(22, frames=4, fmt="webm"), video(22, frames=4, fmt="mov"),
                    b"\x00\x00\x00\x18ftypisom" + bytes(64), video(23, frames=1, size=(112, 112))):
            with pytest.raises(ShapeError):
                conv.send(["see ", bad], 2)
        assert conv.ids == ids and conv.spans == spans and conv.videos == [] and cache.stats().sequences == 0
