"""``Session``: a second request with the same prefix and image attaches the cached text and
image K/V (chained to their prefix), runs no vision tower, prefills only its new tokens and
gives the tokens of a cold run; another tenant gets no hit. Mllama's and Whisper's
cross-attended media K/V is a content-only group, reused the same way."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from transformers import GenerationMixin  # noqa: E402

from mmtier import ShapeError, TieredKVCache  # noqa: E402
from mmtier.engines import transformers as mt  # noqa: E402
from mmtier.engines.transformers.session import Media, Session  # noqa: E402
from mmtier.errors import UnsupportedError  # noqa: E402
from tests.support.hf_models import (  # noqa: E402
    MODELS,
    llava_inputs,
    mllama_inputs,
    tiny_mllama,
    tiny_whisper,
    whisper_inputs,
)

NEW = 5


IMAGE_MODELS = {"llava": "vision_tower", "qwen2_vl": "visual", "qwen2_5_vl": "visual"}


@pytest.fixture(scope="module")
def vlms():
    """name -> (reference model, the same weights enabled for mmtier, vision tower calls)."""
    out = {}
    for name, tower in IMAGE_MODELS.items():
        torch.manual_seed(7)
        ref = MODELS[name][0]()
        model = mt.enable(copy.deepcopy(ref))
        calls = []
        getattr(model.model, tower).register_forward_hook(lambda mod, args, out, calls=calls: calls.append(1))
        out[name] = (ref, model, calls)
    return out


def image_of(name, inputs, data=b"\x89PNG fake image bytes"):
    keep = ("pixel_values", "image_grid_thw")
    return Media(data, {k: v for k, v in inputs.items() if k in keep})


def cold(ref, ids, image):
    extra = dict(image.inputs)
    if "image_grid_thw" in extra:
        extra["mm_token_type_ids"] = (ids == ref.config.image_token_id).int()
    return ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra,
                        max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)


def assert_same(want, got):
    assert torch.equal(want.sequences, got.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(want.logits, got.logits)) <= 1e-5


@pytest.mark.parametrize("name", sorted(IMAGE_MODELS))
def test_second_request_reuses_prefix_and_image(vlms, name):
    ref, model, calls = vlms[name]
    inputs = MODELS[name][1](1, seed=3)
    ids = inputs["input_ids"]
    image = image_of(name, inputs)
    n_img = int((ids == ref.config.image_token_id).sum())
    with TieredKVCache(mt.config_for(model)) as cache:
        session = Session(model, cache, tenant="acme")
        calls.clear()
        first = session.generate(ids, [image], max_new_tokens=NEW)
        assert calls == [1] and first.cached_tokens == 0 and first.media_hits == 0
        assert first.prefilled_tokens == ids.shape[1]
        assert_same(cold(ref, ids, image), first)
        assert cache.stats().by_modality["vision"]["stored_tokens"] == n_img    # the image's K/V

        follow = torch.cat([ids[:, :-3], torch.randint(3, 120, (1, 7))], 1)     # same prefix + image
        calls.clear()
        before = cache.stats().counters["appended_tokens"]
        second = session.generate(follow, [image], max_new_tokens=NEW)
        assert calls == []                                   # no vision tower
        last_text = ids.shape[1] - int(torch.nonzero(ids[0] == ref.config.image_token_id).max()) - 1
        assert second.media_hits == 1 and second.cached_tokens == ids.shape[1] - last_text
        assert second.prefilled_tokens == last_text - 3 + 7
        assert cache.stats().counters["appended_tokens"] - before == last_text - 3 + 7 + NEW - 1
        assert_same(cold(ref, follow, image), second)

        other = Session(model, cache, tenant="globex").generate(follow, [image], max_new_tokens=NEW)
        assert calls == [1] and other.cached_tokens == 0 and other.media_hits == 0
        assert torch.equal(other.sequences, second.sequences)

        swapped = image_of(name, {**image.inputs, "pixel_values": torch.randn_like(image.inputs["pixel_values"])},
                           b"another image")
        calls.clear()
        third = session.generate(follow, [swapped], max_new_tokens=NEW)     # same prefix, new image
        first_image = int(torch.nonzero(ids[0] == ref.config.image_token_id).min())
        assert calls == [1] and third.media_hits == 0 and third.cached_tokens == first_image
        assert_same(cold(ref, follow, swapped), third)
        assert cache.stats().sequences == 0


@pytest.mark.parametrize("name", sorted(IMAGE_MODELS))
def test_two_images_prefill_in_one_forward_and_match_a_cold_run(vlms, name):
    """A prompt with two images: the four spans before the last text run go through ONE
    decoder forward (each its own run, sealed apart), the tokens and logits equal a cold run;
    a second request with the second image swapped reuses the spans up to it."""
    ref, model, calls = vlms[name]
    a, b = MODELS[name][1](1, seed=5), MODELS[name][1](1, seed=6)
    ids = torch.cat([a["input_ids"], b["input_ids"]], 1)
    images = [image_of(name, a, b"image a"), image_of(name, b, b"image b")]

    def joined(imgs):
        return Media(b"", {k: torch.cat([m.inputs[k] for m in imgs]) for k in imgs[0].inputs})

    forwards = []
    hook = model.model.language_model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        with TieredKVCache(mt.config_for(model)) as cache:
            session = Session(model, cache, tenant="acme")
            calls.clear()
            first = session.generate(ids, images, max_new_tokens=NEW)
            assert len(forwards) == 1 + NEW and first.prefilled_tokens == ids.shape[1]
            assert_same(cold(ref, ids, joined(images)), first)
            swapped = [images[0], image_of(name, MODELS[name][1](1, seed=6, image_seed=9), b"image c")]
            forwards.clear()
            second = session.generate(ids, swapped, max_new_tokens=NEW)
            assert second.media_hits == 1 and len(forwards) == 1 + NEW
            second_image = a["input_ids"].shape[1] + int(torch.nonzero(b["input_ids"][0] == ref.config.image_token_id).min())
            assert second.cached_tokens == second_image          # text, image a, text: attached
            assert_same(cold(ref, ids, joined(swapped)), second)
            assert cache.stats().sequences == 0
    finally:
        hook.remove()


@pytest.mark.parametrize("name", ["mllama", "whisper"])
def test_cross_attended_media_is_a_content_only_group(name):
    """Mllama's projected vision K/V and Whisper's encoder K/V: stored once per tenant under a
    content-only key; a second request attaches it and runs no vision tower / audio encoder."""
    torch.manual_seed(11)
    build, make = (tiny_mllama, mllama_inputs) if name == "mllama" else (tiny_whisper, whisper_inputs)
    ref = build()
    model = mt.enable(copy.deepcopy(ref))
    calls = []
    tower = model.model.vision_model if name == "mllama" else model.model.encoder
    tower.register_forward_hook(lambda mod, args, out: calls.append(1))
    inputs = make(1, seed=5)
    if name == "mllama":
        ids = inputs.pop("input_ids")
        inputs.pop("attention_mask")
        extra = {"cross_attention_mask": inputs.pop("cross_attention_mask")}
        want = GenerationMixin.generate(ref, input_ids=ids, attention_mask=torch.ones_like(ids), **extra, **inputs,
                                        max_new_tokens=NEW, do_sample=False, output_logits=True,
                                        return_dict_in_generate=True)
    else:
        ids, extra = torch.tensor([[1, 5]]), {}
        want = GenerationMixin.generate(ref, decoder_input_ids=ids, **inputs, max_new_tokens=NEW, do_sample=False,
                                        output_logits=True, return_dict_in_generate=True)
    media = Media(b"media bytes of " + name.encode(), inputs)
    modality = "vision" if name == "mllama" else "audio"
    with TieredKVCache(mt.config_for(model)) as cache:
        session = Session(model, cache, tenant="acme")
        for hit in (0, 1):
            calls.clear()
            got = session.generate(ids, [media], max_new_tokens=NEW, **extra)
            assert got.media_hits == hit and len(calls) == 1 - hit
            assert_same(want, got)
        assert cache.stats().by_modality[modality]["puts"] == 1
        key = cache.content_key(modality, media.data, tenant="acme")
        assert key.sharing == "content" and cache.contains(key)
        calls.clear()
        other = Session(model, cache, tenant="globex").generate(ids, [media], max_new_tokens=NEW, **extra)
        assert other.media_hits == 0 and calls == [1]
        assert cache.stats().sequences == 0


def test_session_refusals(vlms):
    _, model, _ = vlms["llava"]
    with TieredKVCache(mt.config_for(model)) as cache:
        session = Session(model, cache)
        ids = llava_inputs(1)["input_ids"]
        with pytest.raises(ShapeError):
            session.generate(ids, [])                      # an image run without its media
        with pytest.raises(ShapeError):
            session.generate(torch.cat([ids, ids]), [])    # one request at a time
        whisper = mt.enable(tiny_whisper())
        with TieredKVCache(mt.config_for(whisper)) as other, pytest.raises(UnsupportedError):
            Session(whisper, other).generate(torch.tensor([[1]]), [])     # one media item per request


def test_images_whose_inputs_do_not_concatenate_take_separate_forwards():
    """``_chunks``: text and images run together while the images' processor outputs
    concatenate; an image with other names or another shape past the first dimension starts a
    new forward (each still a run of its own)."""
    from mmtier.engines.transformers.session import Span, _chunks

    def img(shape, names=("pixel_values",)):
        return Media(b"x", {n: torch.randn(*shape) for n in names})

    t = lambda i: Span("text", i, i + 1)          # noqa: E731
    v = lambda i, m: Span("vision", i, i + 1, m)  # noqa: E731
    same = [t(0), v(1, img((1, 3, 8, 8))), t(2), v(3, img((2, 3, 8, 8))), t(4)]
    assert [len(c) for c in _chunks(same)] == [5]
    other_shape = [t(0), v(1, img((1, 3, 8, 8))), t(2), v(3, img((1, 3, 16, 16))), t(4)]
    assert [len(c) for c in _chunks(other_shape)] == [3, 2]
    other_names = [v(0, img((4, 12))), v(1, img((4, 12), ("pixel_values", "image_grid_thw")))]
    assert [len(c) for c in _chunks(other_names)] == [1, 1]
    assert _chunks([]) == [] and [len(c) for c in _chunks([t(0), t(1)])] == [2]
