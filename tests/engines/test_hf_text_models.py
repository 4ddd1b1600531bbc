"""The text-only architectures the adapter claims (Llama, Qwen2, Mistral; tiny configs, random
weights): ``Session`` requests give the tokens of a dense run; sliding windows are exact within the window and refused past it (the paged
kernels attend every earlier position: a Mistral with ``sliding_window=8`` over 30 tokens would
otherwise answer other tokens than ``DynamicCache`` + sdpa). Plain ``generate`` on these models
is checked token for token in ``test_hf_generate.py``."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from transformers import GenerationMixin  # noqa: E402

from mmtier import TieredKVCache  # noqa: E402
from mmtier.engines import transformers as mt  # noqa: E402
from mmtier.engines.transformers.session import Session  # noqa: E402
from mmtier.errors import UnsupportedError  # noqa: E402
from tests.support.hf_models import text_inputs, tiny_llama, tiny_mistral, tiny_qwen2  # noqa: E402

NEW = 5
BUILDERS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "mistral": tiny_mistral}


def pair(build, **kw):
    torch.manual_seed(11)
    ref = build(**kw)
    return ref, mt.enable(copy.deepcopy(ref))


def dense(ref, inputs, new=NEW):
    return GenerationMixin.generate(ref, **inputs, max_new_tokens=new, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)


def assert_same(want, got):
    assert torch.equal(want.sequences, got.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(want.logits, got.logits)) <= 1e-5


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_session_equals_dense(name):
    ref, model = pair(BUILDERS[name])
    first = text_inputs(1, seed=2, n=20)["input_ids"]
    second = torch.cat([first, text_inputs(1, seed=3, n=6)["input_ids"]], 1)
    with TieredKVCache(mt.config_for(model)) as cache:
        session = Session(model, cache, tenant="acme")
        a = session.generate(first, max_new_tokens=NEW)
        b = session.generate(second, max_new_tokens=NEW)   # a text-only prompt is one span
        for ids, got in ((first, a), (second, b)):
            assert_same(dense(ref, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}), got)


def test_a_window_wider_than_the_sequence_is_exact():
    ref, model = pair(tiny_mistral, sliding_window=8)
    inputs = text_inputs(2, seed=4, n=4)            # 4 + 4 fed tokens: within the window of 8
    with TieredKVCache(mt.config_for(model)) as cache, mt.cache_for(model, cache) as past:
        got = GenerationMixin.generate(model, **inputs, past_key_values=past, max_new_tokens=NEW,
                                       do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert_same(dense(ref, inputs), got)


@pytest.mark.parametrize("build, kw, full", [
    (tiny_mistral, dict(sliding_window=8), dict(sliding_window=None)),
    (tiny_qwen2, dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), {})])
def test_a_sequence_past_the_window_is_refused(build, kw, full):
    ref, model = pair(build, **kw)
    inputs = text_inputs(1, seed=5, n=30)
    # the window matters here: the same weights attending in full answer other tokens
    unwindowed = build(**full)
    unwindowed.load_state_dict(ref.state_dict())
    assert not torch.equal(dense(ref, inputs, new=8).sequences, dense(unwindowed, inputs, new=8).sequences)
    with TieredKVCache(mt.config_for(model)) as cache:
        with mt.cache_for(model, cache) as past, pytest.raises(UnsupportedError, match="sliding-window"):
            GenerationMixin.generate(model, **inputs, past_key_values=past, max_new_tokens=8, do_sample=False)
        assert cache.stats().sequences == 0
        with pytest.raises(UnsupportedError, match="sliding-window"):      # through a Session too
            Session(model, cache, tenant="acme").generate(inputs["input_ids"], max_new_tokens=8)
        assert cache.stats().sequences == 0
