"""The KV of generated tokens (``put(..., generated=True)``: the vLLM connector's decode saves)
is admitted on probation: a stream of single-turn requests, each storing its prompt and its
answer, does not push out a prompt that later lookups reused, as a prompt-only stream of the same
requests does not (plain LRU, which has no probation, loses it: the test can fail); an answer
stored again after it was evicted neither enters the reuse lane nor teaches the share. Exact,
on tiny pools."""

from __future__ import annotations

import pytest
import torch

from mmtier import TieredKVCache
from mmtier.config import CacheConfig, ModalitySpec
from mmtier.eviction.slru import PROBATION, PROTECTED


def tiny_cache(policy: str, pages: int = 8) -> TieredKVCache:
    cfg = CacheConfig(model="tiny", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32",
                      device="cpu", device_bytes=pages * 4 * 16, eviction_policy=policy,
                      modalities={"text": ModalitySpec(page_size=4)})
    return TieredKVCache(cfg)


def kv() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 4, 1, 2), torch.randn(1, 4, 1, 2)


def single_turn_stream(policy: str, *, decode: bool, requests: int = 5) -> bool:
    """A reused prompt group, then ``requests`` single-turn requests (a prompt group each and,
    with ``decode``, its answer's group chained to it): whether the reused prompt is still held."""
    with tiny_cache(policy) as cache:
        reused = cache.content_key("text", b"system prompt", tenant="t")
        cache.put(reused, *kv())
        for _ in range(2):                         # two later turns found it and loaded it
            assert cache.contains(reused)
            cache.read_group(reused)
        for i in range(requests):
            p = cache.content_key("text", b"prompt %d" % i, tenant="t")
            cache.put(p, *kv())
            if decode:
                cache.put(cache.content_key("text", b"answer %d" % i, tenant="t", parent=p), *kv(),
                          generated=True)
        held = cache.contains(reused)
        stats = cache.stats().by_modality["text"]
        assert stats.get("decode_puts", 0) == (requests if decode else 0)
        return held


@pytest.mark.parametrize("decode", [False, True], ids=["prompt-only", "with-answers"])
def test_a_single_turn_stream_of_answers_does_not_evict_a_reused_prompt(decode):
    # 8 pages: the reused prompt and 5 prompts fit; with their 5 answers, 3 groups must go
    assert single_turn_stream("adaptive_slru", decode=decode)
    # LRU has no probation: the answers push the reused prompt out (prompt-only keeps it)
    assert single_turn_stream("lru", decode=decode) is not decode


def test_an_answer_stored_again_stays_on_probation_and_teaches_the_share_nothing():
    with tiny_cache("adaptive_slru", pages=4) as cache:
        pol = cache.policy
        keys = [cache.content_key("text", b"g%d" % i, tenant="t") for i in range(4)]
        for i, key in enumerate(keys):
            cache.put(key, *kv(), generated=i == 0)
        assert cache.contains(keys[3])
        cache.read_group(keys[3])                  # reused: protected; 3 of 4 pages on probation
        for key in keys[:2]:                       # room for two: the probation over its share
            cache.put(cache.content_key("text", b"new %r" % key.digest, tenant="t"), *kv())
        assert not cache.contains(keys[0]) and not cache.contains(keys[1])
        share = pol.share["text"]
        cache.put(keys[0], *kv(), generated=True)  # the answer again: probation, share unchanged
        assert pol._entries[cache.index.groups[keys[0]].gid].lane == PROBATION
        assert pol.share["text"] == share
        cache.put(keys[1], *kv())                  # a prompt cut too early: protected, share grows
        assert pol._entries[cache.index.groups[keys[1]].gid].lane == PROTECTED
        assert pol.share["text"] > share
