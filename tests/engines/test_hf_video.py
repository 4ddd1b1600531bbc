"""Video through the transformers adapter and ``Session`` (Qwen2-VL, Qwen2.5-VL): real MP4 bytes
made at test time by PyAV, decoded and sampled at the processor's fps by
``video_frames.VideoProcessor`` (no torchvision), cut into segments that are groups of the
``video`` pool. Every answer equals the dense path (``DynamicCache`` + sdpa, the whole video
through the vision tower); a repeated video runs no vision tower; eviction on a tiny pool takes
whole segments, and a video whose later segments were evicted re-encodes only those."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("av", reason="the hf extra (PyAV) is not installed")

from mmtier import TieredKVCache  # noqa: E402
from mmtier.engines import transformers as mt  # noqa: E402
from mmtier.engines.transformers.session import Media, Session  # noqa: E402
from mmtier.engines.transformers.video_frames import VideoProcessor, decode, probe  # noqa: E402
from mmtier.errors import BadMediaError, ShapeError  # noqa: E402
from tests.support.hf_models import MODELS, QWEN_IDS  # noqa: E402
from tests.support.media_samples import video  # noqa: E402

NEW = 5
VIDEO, START, END = QWEN_IDS["video_token_id"], QWEN_IDS["vision_start_token_id"], QWEN_IDS["vision_end_token_id"]
VIDEO_MODELS = ("qwen2_vl", "qwen2_5_vl")


def processor() -> VideoProcessor:
    """The tiny models' patches (4 px, 2x2 merge, 2 frames a temporal patch), 2 frames a second."""
    from transformers import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32}, patch_size=4,
                                      merge_size=2, temporal_patch_size=2)
    return VideoProcessor(images, fps=2.0, min_frames=2, max_frames=16)


@pytest.fixture(scope="module")
def vlms():
    out = {}
    for name in VIDEO_MODELS:
        torch.manual_seed(7)
        ref = MODELS[name][0]()
        model = mt.enable(copy.deepcopy(ref))
        rows = []              # rows of pixels per vision tower call
        model.model.visual.register_forward_hook(lambda mod, args, out, rows=rows: rows.append(args[0].shape[0]))
        out[name] = (ref, model, rows)
    return out


def video_media(name: str, data: bytes, vp: VideoProcessor) -> Media:
    header = probe(data)
    inputs = vp.inputs(data, header)
    if name == "qwen2_5_vl":
        inputs["second_per_grid_ts"] = torch.tensor([vp.second_per_grid(header)])
    return Media(data, inputs, vp.params)


def prompt(seed: int, tokens: int, tail: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(3, 140, (1, 4), generator=g), torch.tensor([[START]]),
                      torch.full((1, tokens), VIDEO), torch.tensor([[END]]),
                      torch.randint(3, 140, (1, tail), generator=g)], 1)


def dense(ref, ids, media: list[Media]):
    extra = {"mm_token_type_ids": (ids == QWEN_IDS["image_token_id"]).int() + 2 * (ids == VIDEO).int()}
    for m in media:
        for k, v in m.inputs.items():
            extra[k] = torch.cat([extra[k], v]) if k in extra else v
    return ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra, max_new_tokens=NEW,
                        do_sample=False, output_logits=True, return_dict_in_generate=True)


def assert_same(want, got):
    assert torch.equal(want.sequences, got.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(want.logits, got.logits)) <= 1e-5


def test_frames_are_sampled_at_the_processor_fps_and_laid_out_as_the_video_processor_does():
    vp = processor()
    data = video(1, frames=12, size=(32, 24), fps=4)         # 3 s at 4 fps: 6 frames at 2 fps
    header = probe(data)
    assert (header.codec, header.width, header.height, header.frames, header.fps) == ("mpeg4", 32, 24, 12, 4.0)
    assert vp.indices(header) == [0, 2, 4, 6, 8, 10] and vp.grid(header) == (3, 6, 8)
    inputs = vp.inputs(data, header)
    assert tuple(inputs["pixel_values_videos"].shape) == (3 * 6 * 8, 3 * 2 * 4 * 4)
    assert inputs["video_grid_thw"].tolist() == [[3, 6, 8]]
    # temporal patch t holds frames 2t, 2t+1 of the sampled ones, channel-major then frame:
    # a video of one still frame is exactly that frame as an image (which repeats it in time)
    from PIL import Image

    still = video(2, frames=4, size=(32, 24), fps=2, still=True)
    frames = decode(still, probe(still))
    assert all(np.array_equal(frames[0], f) for f in frames)
    image = vp.frames.__class__(size=vp.frames.size, patch_size=4, merge_size=2, temporal_patch_size=2)(
        images=[Image.fromarray(frames[0])], return_tensors="pt")
    got = vp.from_frames(frames[:2])
    assert got["video_grid_thw"].tolist() == image["image_grid_thw"].tolist()
    assert torch.equal(got["pixel_values_videos"], image["pixel_values"])
    # and two different frames land in the two temporal slots of each patch
    moving = decode(data, header)
    two = vp.from_frames([moving[0], moving[1]])["pixel_values_videos"].view(-1, 3, 2, 16)
    for slot in (0, 1):
        alone = vp.from_frames([moving[slot]] * 2)["pixel_values_videos"].view(-1, 3, 2, 16)
        assert torch.equal(two[:, :, slot], alone[:, :, 0]) and not torch.equal(two[:, :, 1 - slot], alone[:, :, 0])


@pytest.mark.parametrize("case", ["truncated", "webm", "quicktime", "not_a_video", "too_few_frames"])
def test_bad_videos_are_typed(case):
    vp = processor()
    good = video(3, frames=8)
    data, unsupported = {
        "truncated": (good[: len(good) // 2], False),
        "webm": (video(3, frames=4, fmt="webm"), True),
        "quicktime": (video(3, frames=4, fmt="mov"), True),
        "not_a_video": (b"\x00\x00\x00\x18ftypisom" + bytes(200), False),
        "too_few_frames": (video(3, frames=1), False),
    }[case]
    with pytest.raises(BadMediaError) as err:
        vp.inputs(data)
    assert err.value.unsupported is unsupported and str(err.value)


@pytest.mark.parametrize("name", VIDEO_MODELS)
def test_a_repeated_video_runs_no_vision_tower_and_matches_dense(vlms, name):
    ref, model, rows = vlms[name]
    vp = processor()
    clip = video_media(name, video(4, frames=12), vp)         # 3 temporal patches of 12 tokens
    ids = prompt(4, 36)
    with TieredKVCache(mt.config_for(model)) as cache:
        session = Session(model, cache, tenant="acme", video_segment=1)
        assert [s.modality for s in session.spans(ids, [clip])] == ["text", "video", "video", "video", "text"]
        rows.clear()
        first = session.generate(ids, [clip], max_new_tokens=NEW)
        assert rows == [3 * 48] and first.cached_tokens == 0 and first.video_segment_hits == 0
        assert_same(dense(ref, ids, [clip]), first)
        video_stats = cache.stats().by_modality["video"]
        assert video_stats["stored_tokens"] == 36 and video_stats["puts"] == 3       # a group per segment
        follow = torch.cat([ids[:, :-3], torch.randint(3, 120, (1, 6))], 1)
        rows.clear()
        second = session.generate(follow, [clip], max_new_tokens=NEW)
        assert rows == [] and second.video_segment_hits == 3 and second.cached_tokens == ids.shape[1] - 4   # all but [END, tail]
        assert_same(dense(ref, follow, [clip]), second)
        seq = cache.create_sequence("acme")                     # the chain, attached: its views
        spans = session.spans(ids, [clip])
        for key in session.keys(ids, spans, cache.prefix_key(seq))[:-1]:
            cache.attach(seq, key)
        table = cache.sequence(seq)
        assert [(b.start, b.num_tokens, len(b.group.pages)) for b in table.video_blocks] == \
            [(5, 12, 1), (17, 12, 1), (29, 12, 1)]
        assert len(table.text_blocks) == 1 and table.vision_blocks == [] and table.audio_blocks == []
        cache.release(seq)
        other = Session(model, cache, tenant="globex", video_segment=1).generate(follow, [clip], max_new_tokens=NEW)
        assert rows == [3 * 48] and other.video_segment_hits == 0 and other.cached_tokens == 0
        assert torch.equal(other.sequences, second.sequences)
        assert cache.stats().sequences == 0


@pytest.mark.parametrize("name", VIDEO_MODELS)
def test_an_image_and_a_video_in_one_prompt_prefill_in_one_forward(vlms, name):
    ref, model, rows = vlms[name]
    vp = processor()
    image_inputs = MODELS[name][1](1, seed=8)
    image = Media(b"image", {k: image_inputs[k] for k in ("pixel_values", "image_grid_thw")})
    clip = video_media(name, video(5, frames=8), vp)           # 2 temporal patches
    ids = torch.cat([image_inputs["input_ids"], prompt(5, 24)], 1)
    forwards = []
    hook = model.model.language_model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        with TieredKVCache(mt.config_for(model)) as cache:
            session = Session(model, cache, tenant="acme", video_segment=2)
            first = session.generate(ids, [image, clip], max_new_tokens=NEW)
            assert len(forwards) == 1 + NEW
            assert_same(dense(ref, ids, [image, clip]), first)
            rows.clear()
            again = session.generate(ids, [image, clip], max_new_tokens=NEW)
            assert rows == [] and again.media_hits == 1 and again.video_segment_hits == 1
            assert_same(dense(ref, ids, [image, clip]), again)
    finally:
        hook.remove()


def test_eviction_on_a_tiny_pool_takes_whole_segments(vlms):
    """A video pool of 4 pages (one a segment): a second video evicts the first one's later
    segments, whole, never a part of one; the first video again attaches its first segment and
    re-encodes only the two it lost (the vision tower over their rows alone), equal to dense."""
    ref, model, rows = vlms["qwen2_vl"]
    vp = processor()
    a, b = video_media("qwen2_vl", video(6, frames=12), vp), video_media("qwen2_vl", video(7, frames=12), vp)
    ids = prompt(6, 36)
    cfg = mt.config_for(model, device_bytes=2 << 20)
    page = cfg.modalities["video"].model_copy(update={"share": 4 * 16384 / (2 << 20)})
    cfg = cfg.model_copy(update={"modalities": {**cfg.modalities, "video": page}})
    with TieredKVCache(cfg) as cache:
        pool = cache.pools["video"]
        assert pool.num_pages == 4 and pool.spec.page_bytes == 16384
        session = Session(model, cache, tenant="acme", video_segment=1)
        spans = session.spans(ids, [a])
        keys_a = [k for k, s in zip(session.keys(ids, spans, _root(cache)), spans) if s.modality == "video"]
        session.generate(ids, [a], max_new_tokens=NEW)
        assert pool.num_used == 3 and all(cache.contains(k) for k in keys_a)
        session.generate(ids, [b], max_new_tokens=NEW)
        held = [cache.contains(k) for k in keys_a]
        assert held == [True, False, False]                     # leaf first: the chain's tail went
        assert pool.num_used == 4 == 1 + 3                      # whole segments only: a, and b's three
        assert cache.stats().counters["evictions"] >= 2
        rows.clear()
        again = session.generate(ids, [a], max_new_tokens=NEW)
        assert again.video_segment_hits == 1 and again.cached_tokens == 5 + 12
        assert rows == [2 * 48]                                 # segments 1 and 2 only
        assert_same(dense(ref, ids, [a]), again)


def _root(cache):
    seq = cache.create_sequence("acme")
    try:
        return cache.prefix_key(seq)
    finally:
        cache.release(seq)


def test_a_video_needs_its_tokens_and_a_video_pool(vlms):
    _, model, _ = vlms["qwen2_vl"]
    vp = processor()
    clip = video_media("qwen2_vl", video(8, frames=8), vp)        # 24 tokens
    with TieredKVCache(mt.config_for(model)) as cache:
        session = Session(model, cache, tenant="acme")
        with pytest.raises(ShapeError):
            session.generate(prompt(8, 20), [clip])               # a run of 20 for 24
        image = Media(b"i", {"pixel_values": torch.randn(4, 96), "image_grid_thw": torch.tensor([[1, 2, 2]])})
        with pytest.raises(ShapeError):
            session.generate(prompt(8, 24), [image])              # video tokens, an image given
        two = Media(b"v", {k: torch.cat([v, v]) for k, v in clip.inputs.items()})
        with pytest.raises(ShapeError):
            session.generate(prompt(8, 48), [two])                # two videos in one Media
        assert cache.stats().sequences == 0
    cfg = mt.config_for(model)
    cfg = cfg.model_copy(update={"modalities": {k: v for k, v in cfg.modalities.items() if k != "video"}})
    from mmtier.errors import ConfigError

    with TieredKVCache(cfg) as cache, pytest.raises(ConfigError):
        Session(model, cache).generate(prompt(8, 24), [clip])
