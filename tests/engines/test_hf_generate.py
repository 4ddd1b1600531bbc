"""Real transformers model code through the cache: greedy ``generate`` with the mmtier adapter
equals ``DynamicCache`` + sdpa token for token (logits within 1e-5, float32), for LLaVA,
Qwen2-VL, Qwen2.5-VL, Mllama, Whisper and text-only Llama, Qwen2 and Mistral (tiny configs, random weights, no download), at batch
1 and 2 (row 1 left-padded; LLaVA's decoder has 6 query heads on 2 KV heads), with groups
pushed to host and disk between steps, and under the Triton backend (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from transformers import GenerationMixin, LogitsProcessor, LogitsProcessorList  # noqa: E402

from mmtier import ConfigError, TieredKVCache  # noqa: E402
from mmtier.engines import transformers as mt  # noqa: E402
from mmtier.errors import UnsupportedError  # noqa: E402
from tests.support.hf_models import MODELS  # noqa: E402

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def models():
    """name -> (reference model on sdpa, the same weights enabled for mmtier)."""
    out = {}
    for name, (build, _) in MODELS.items():
        torch.manual_seed(1234)
        ref = build()
        out[name] = (ref, mt.enable(copy.deepcopy(ref)))
    return out


def generate(model, inputs, **extra):
    # Whisper's own generate copies the cache into dense tensors per row after the run; the
    # generic greedy loop is the same decoding without that copy.
    return GenerationMixin.generate(model, **inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True, **extra)


def assert_same(want, got):
    assert torch.equal(want.sequences, got.sequences)
    assert len(want.logits) == len(got.logits) == NEW_TOKENS
    diff = max(float((a - b).abs().max()) for a, b in zip(want.logits, got.logits))
    assert diff <= 1e-5, diff


def run_both(models, name, batch, cfg_over=None, extra=None):
    ref, model = models[name]
    inputs = MODELS[name][1](batch, seed=batch)
    want = generate(ref, inputs)
    with TieredKVCache(mt.config_for(model, **(cfg_over or {}))) as cache:
        with mt.cache_for(model, cache, tenant="acme") as past:
            got = generate(model, inputs, past_key_values=past, **(extra(cache) if extra else {}))
            rows = [cache.sequence(s) for s in past.sequences]
            assert len(rows) == batch
            real = inputs["attention_mask"].sum(1).tolist() if "attention_mask" in inputs else [1] * batch
            # every row holds its real tokens only (the last generated token is never fed back)
            assert [t.length for t in rows] == [n + NEW_TOKENS - 1 for n in real]
        # the rows' sequences are released with the cache object (a Pressure filler stays)
        assert cache.stats().sequences == (0 if extra is None else 1)
        assert_same(want, got)
        return cache.stats()


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_matches_dynamic_cache(models, name, batch):
    run_both(models, name, batch)


class Pressure(LogitsProcessor):
    """Between decode steps, fill every KV pool of the cache with a filler sequence: the rows'
    groups (referenced, not in use between steps) move down to host and disk."""

    def __init__(self, cache: TieredKVCache):
        self.cache = cache
        self.filler = None

    def __call__(self, input_ids, scores):
        cache = self.cache
        if self.filler is not None:
            cache.release(self.filler)
        self.filler = cache.create_sequence("filler")
        for name, pool in cache.pools.items():
            spec = pool.spec
            n = pool.num_pages * spec.page_size
            k = torch.randn(spec.num_layers, n, spec.num_kv_heads, spec.head_dim)
            cache.append(self.filler, name, k, torch.randn_like(k))
        return scores


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_with_groups_moving_to_host_and_disk(models, name, tmp_path):
    def extra(cache):
        return {"logits_processor": LogitsProcessorList([Pressure(cache)])}

    stats = run_both(models, name, 2, dict(device_bytes=1 << 20, host_bytes=64 << 10, disk_dir=tmp_path,
                                           disk_free_floor_bytes=0), extra)
    assert stats.counters.get("lower_tier_attentions", 0) > 0
    assert stats.counters.get("spills_to_host", 0) > 0 and stats.counters.get("spills_to_disk", 0) > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton backend needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", ["llava", "mllama", "whisper"])
def test_generate_on_the_triton_backend(models, name):
    pytest.importorskip("triton", reason="triton is not installed")
    run_both(models, name, 2, dict(attention_backend="triton"))


def test_refusals_are_typed(models):
    ref, model = models["llava"]
    with TieredKVCache(mt.config_for(model)) as cache:
        with pytest.raises(UnsupportedError):
            mt.cache_for(ref, cache)                        # not enabled
        other = mt.config_for(models["qwen2_5_vl"][1])
        with TieredKVCache(other) as wrong, pytest.raises(ConfigError):
            mt.cache_for(model, wrong)                      # pools of another shape
        inputs = MODELS["llava"][1](1)
        with mt.cache_for(model, cache) as past, pytest.raises(UnsupportedError):
            generate(model, inputs, past_key_values=past, num_beams=2)
        padded = MODELS["llava"][1](2)
        with pytest.raises(UnsupportedError):
            generate(model, padded)                         # a padded batch without the cache


def test_whisper_own_generate_returns_scores_equal_to_dynamic_cache(models):
    """Whisper's ``generate(..., return_dict_in_generate=True)`` (what scores and timestamps
    need) splits ``past_key_values`` per batch row, reading each layer's ``keys``: the run gives
    the sequences and scores of ``DynamicCache``; the copy it returns holds no tokens (the K/V
    live in the cache's pages: reused, it recomputes), and a later request through the same
    model (its audio encoder on the "mmtier" attention) is not taken for a cache layer."""
    ref, model = models["whisper"]
    for seed in (3, 4):
        inputs = MODELS["whisper"][1](2, seed=seed)
        kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True, output_scores=True)
        want = ref.generate(**inputs, **kw)
        with TieredKVCache(mt.config_for(model)) as cache, mt.cache_for(model, cache) as past:
            got = model.generate(**inputs, past_key_values=past, **kw)
        assert torch.equal(want.sequences, got.sequences)
        assert len(got.scores) == len(want.scores) == NEW_TOKENS
        assert max(float((a - b).abs().max()) for a, b in zip(want.scores, got.scores)) <= 1e-5
        copied = got.past_key_values
        assert copied.get_seq_length() == 0 and copied.cross_attention_cache.get_seq_length() == 0
