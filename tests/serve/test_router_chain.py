"""The affinity router follows a conversation by its longest held chain (``held_chain``): through
the part of a chunk the previous turn's prompt ended inside and through the previous answer's
groups (the connector's decode saves), as the connector's scheduler forks, not by the first
chunks only. No engine: the connector's own key functions (``KeyScheme``) make what each node's
saves registered, in a real ``ContentRegistry``; the request is the fields keying reads."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from mmtier.cache import TieredKVCache
from mmtier.cluster.registry import ContentRegistry, HolderInfo
from mmtier.config import CacheConfig
from mmtier.content import split_address
from mmtier.engines.vllm.keys import KeyScheme
from mmtier.serve.affinity_router import best_node
from mmtier.serve.request_keys import PromptChain, held_chain

BS, CHUNK = 8, 4


@pytest.fixture
def cache():
    cfg = CacheConfig(model="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32",
                      modalities={"text": {"page_size": BS}}, device="cpu", device_bytes=1 << 20, host_bytes=0)
    with TieredKVCache(cfg) as c:
        yield c


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 30000, n).tolist()


def request(ids: list[int]):
    return SimpleNamespace(prompt_token_ids=ids, mm_features=None, cache_salt=None, lora_request=None)


def saved(scheme: KeyScheme, cache, prompt: list[int], answer: list[int]) -> list:
    """The segments a turn's connector saves: its prompt's whole blocks, then (decode saves) the
    prompt and answer planned as one sequence cut where the prompt's whole blocks end, up to
    the answer's last whole block whose KV was written (all but the last token's)."""
    req = request(prompt)
    full = len(prompt) // BS * BS
    segs = [s for s in scheme.plan(cache, req).segments if s.end <= full]
    end = (len(prompt) + len(answer) - 1) // BS * BS
    both = scheme.plan_tokens(cache, req, (prompt + answer)[:end], cuts=(full,))
    assert [s.key for s in both.segments[:len(segs)]] == [s.key for s in segs]
    return segs + list(both.segments[len(segs):])


def register(registry: ContentRegistry, holder: str, node: str, segs) -> None:
    registry.add(holder, [{"key": s.key.to_wire(), "tier": "host", "num_tokens": s.end - s.start, "nbytes": 1}
                          for s in segs], HolderInfo(holder, node, "store"))


def test_the_router_follows_a_conversation_through_its_previous_prompt_and_answer(cache):
    scheme = KeyScheme(BS, tenant="acme", chunk_blocks=CHUNK)
    registry = ContentRegistry()
    system = tokens(40, 0)
    p1, a1 = system + tokens(5, 1), tokens(51, 2)          # turn 1: 45 prompt tokens, a 51-token answer
    register(registry, "store-a", "A", saved(scheme, cache, p1, a1))
    # another conversation with the same system prompt ran on B: B holds the first chunk too
    register(registry, "store-b", "B", saved(scheme, cache, system + tokens(30, 3), tokens(9, 4)))

    turn2 = p1 + a1 + tokens(20, 5)
    keys = PromptChain(scheme, cache, request(turn2), scheme.plan(cache, request(turn2))).keys(())

    async def lookup(addresses):                # a plain registry: digests (a shard router strips them)
        return registry.lookup([split_address(a)[0] for a in addresses])

    node_of = {"store-a": "A", "store-b": "B"}
    # the first chunks only: both nodes hold the first chunk, the second ([32, 64)) nobody (turn
    # 1's prompt ended inside it at 40): a tie, no conversation followed
    plain = asyncio.run(lookup(keys.addresses()))
    assert plain[0] is not None and plain[1] is None
    followed, found = asyncio.run(held_chain(keys, lookup))
    run = 0
    for (_, n), loc in zip(followed.prefix, found, strict=True):
        if loc is None or "store-a" not in {h for h, _ in loc.holders}:
            break
        run += n
    assert run == (len(p1) + len(a1) - 1) // BS * BS == 88     # the prompt's part, then the answer's
    assert followed.prefix[0] == keys.prefix[0]
    assert best_node(followed, found, node_of) == "A"
    # a chat template that re-tokenized the answer: its ids part at 60, inside the answer's first
    # chunk [40, 72); the chain stops at the last group wholly before them (the prompt's part
    # ending at 40), never past, as the connector's hit does
    parted = list(turn2)
    parted[60] = (parted[60] + 1) % 30000 or 3
    pk = PromptChain(scheme, cache, request(parted), scheme.plan(cache, request(parted))).keys(())
    pk, pfound = asyncio.run(held_chain(pk, lookup))
    held = 0
    for (_, n), loc in zip(pk.prefix, pfound, strict=True):
        if loc is None:
            break
        held += n
    assert held == 40 and best_node(pk, pfound, node_of) == "A"


def test_a_chain_nobody_forked_from_is_left_as_it_was(cache):
    scheme = KeyScheme(BS, tenant="acme", chunk_blocks=CHUNK)
    registry = ContentRegistry()
    ids = tokens(70, 9)
    keys = PromptChain(scheme, cache, request(ids), scheme.plan(cache, request(ids))).keys(())

    async def lookup(addresses):                # a plain registry: digests (a shard router strips them)
        return registry.lookup([split_address(a)[0] for a in addresses])

    followed, found = asyncio.run(held_chain(keys, lookup))
    assert followed == keys and found == [None] * len(keys.prefix)
    assert best_node(followed, found, {}) is None
