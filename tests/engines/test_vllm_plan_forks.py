"""A conversation's next turn through the vLLM connector's plan (``vllm.plan``): text is cut in
chunks of several blocks at absolute positions, and the last prompt's full blocks ended inside
one, so the new prompt's whole chunk misses what the last turn stored. ``fork_keys`` names the
parts that end on each block boundary inside the chunk; a plan cut there (``cuts``) chains the
same keys the shorter prompt stored, and everything after the cut chains from that part."""

from __future__ import annotations

import numpy as np
import pytest

from mmtier.cache import TieredKVCache
from mmtier.config import CacheConfig
from mmtier.engines.vllm.plan import MediaItem, fork_keys, plan_request
from mmtier.errors import ShapeError

BS = 8


@pytest.fixture
def cache():
    mods = {"text": {"page_size": BS, "share": 0.5}, "vision": {"page_size": BS, "share": 0.5}}
    cfg = CacheConfig(model="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", modalities=mods,
                      device="cpu", device_bytes=1 << 20, host_bytes=0)
    with TieredKVCache(cfg) as c:
        yield c


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(100, 30000, n).tolist()


def plan(cache, toks, media=(), cuts=(), tenant="acme"):
    return plan_request(cache, toks, list(media), block_size=BS, tenant=tenant, chunk_blocks=4, cuts=cuts)


def test_the_next_turn_finds_the_last_prompts_part_of_the_chunk_and_chains_after_it(cache):
    first = tokens(45)                            # full blocks end at 40, inside the chunk [32, 64)
    turn = first + tokens(40, seed=1)             # the next turn repeats it and goes on (85: full 80)
    stored = plan(cache, first)
    assert [(s.start, s.end) for s in stored.segments] == [(0, 32), (32, 40)]
    whole = plan(cache, turn)
    assert [(s.start, s.end) for s in whole.segments] == [(0, 32), (32, 64), (64, 80)]
    assert whole.segments[0].key == stored.segments[0].key
    assert whole.segments[1].key != stored.segments[1].key          # the whole chunk: a miss
    forks = fork_keys(cache, whole, 1, turn, block_size=BS, tenant="acme")
    assert [end for end, _ in forks] == [56, 48, 40]                 # longest first
    assert dict(forks)[40] == stored.segments[1].key                 # the last prompt's part
    forked = plan(cache, turn, cuts=(40,))
    assert [(s.start, s.end) for s in forked.segments] == [(0, 32), (32, 40), (40, 64), (64, 80)]
    assert forked.segments[1].key == stored.segments[1].key
    assert forked.segments[2].key.parent == stored.segments[1].key.digest   # chained after the part
    # the turn after: its chunk misses, the fork at 40 and then the one at 80 find both turns'
    third = turn + tokens(30, seed=2)             # 115 tokens: full 112
    again = plan(cache, third, cuts=(40,))
    assert [s.key for s in again.segments[:3]] == [s.key for s in forked.segments[:3]]
    later = plan(cache, third, cuts=(40, 80))
    assert later.segments[3].key == forked.segments[3].key and later.segments[3].end == 80


def test_a_fork_matches_only_the_same_tokens_under_the_same_prefix_and_tenant(cache):
    first = tokens(45)
    stored = plan(cache, first).segments[1].key
    turn = first + tokens(40, seed=1)
    changed = list(turn)
    changed[35] += 1                              # inside the part
    other_prefix = list(turn)
    other_prefix[3] += 1                          # before it: another parent
    for toks, tenant in ((changed, "acme"), (other_prefix, "acme"), (turn, "other")):
        p = plan(cache, toks, tenant=tenant)
        assert stored not in {k for _, k in fork_keys(cache, p, 1, toks, block_size=BS, tenant=tenant)}


def test_media_items_and_one_block_segments_have_no_forks_and_cuts_fall_on_blocks(cache):
    toks = tokens(70)
    toks[20:36] = [32000] * 16
    item = MediaItem(20, 16, "img", "image", b"\x01" * 32)
    p = plan(cache, toks, [item])
    kinds = [(s.start, s.end, s.text) for s in p.segments]
    assert kinds == [(0, 20, True), (20, 36, False), (36, 64, True)]
    assert fork_keys(cache, p, 1, toks, block_size=BS, tenant="acme") == []          # the image
    # after the image the parts end on block boundaries (40 ... 56), not at the item's end
    assert [e for e, _ in fork_keys(cache, p, 2, toks, block_size=BS, tenant="acme")] == [56, 48, 40]
    one = plan_request(cache, toks, [], block_size=BS, tenant="acme", chunk_blocks=1)
    assert fork_keys(cache, one, 2, toks, block_size=BS, tenant="acme") == []
    with pytest.raises(ShapeError, match="block boundaries"):
        plan(cache, toks, cuts=(41,))
