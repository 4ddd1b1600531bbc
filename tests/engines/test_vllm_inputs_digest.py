"""``vllm.keys.inputs_digest``: computed once per item object, never shared between items."""

from __future__ import annotations

import gc
from collections import UserDict
from types import SimpleNamespace

import torch

from mmtier.engines.vllm import keys as vllm_keys


class Item(UserDict):             # vLLM's MultiModalKwargsItem is a UserDict of fields with .data
    pass


def test_a_digest_is_remembered_per_item_and_forgotten_with_it(monkeypatch):
    calls = [0]
    digest = vllm_keys._digest
    monkeypatch.setattr(vllm_keys, "_digest", lambda item: calls.__setitem__(0, calls[0] + 1) or digest(item))
    a = Item(pixel_values=SimpleNamespace(data=torch.ones(3, 4)))
    b = Item(pixel_values=SimpleNamespace(data=torch.ones(3, 4) * 2))
    assert vllm_keys.inputs_digest(a) == vllm_keys.inputs_digest(a) == digest(a)
    assert vllm_keys.inputs_digest(b) == digest(b) != digest(a)
    assert calls[0] == 2                      # a hashed once, b once
    same = Item(pixel_values=SimpleNamespace(data=torch.ones(3, 4)))
    assert vllm_keys.inputs_digest(same) == digest(a)     # equal content, equal digest
    held = len(vllm_keys._DIGESTS)
    del a, b, same
    gc.collect()
    assert len(vllm_keys._DIGESTS) == held - 3
    assert vllm_keys.inputs_digest({"x": SimpleNamespace(data=torch.ones(2))}) is not None   # no weakref: not kept
    assert vllm_keys.inputs_digest(None) is None
