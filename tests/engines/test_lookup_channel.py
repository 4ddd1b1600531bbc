"""The lookup channel between vLLM's scheduler and its worker's cache: exact answers over a real
Unix socket, each key looked up as if asked alone (a cache's lookups count hits and misses)."""

from __future__ import annotations

import hashlib
import uuid

from mmtier.content import ContentKey
from mmtier.engines.vllm.lookup_channel import LookupChannel


def key(i: int) -> ContentKey:
    return ContentKey(hashlib.sha256(str(i).encode()).digest(), "text", "prefix", b"\0" * 16,
                      hashlib.sha256(b"tag%d" % i).digest())


class Held:
    """A cache's ``contains``, recording every lookup."""

    def __init__(self, held: set[ContentKey]):
        self.held, self.asked = held, []

    def contains(self, k: ContentKey) -> bool:
        self.asked.append(k)
        return k in self.held


def ends(cache: Held, shards: int = 1, caches: list[Held] | None = None):
    name = "t" + uuid.uuid4().hex[:12]
    workers = [LookupChannel(name, 0, worker=True, cache=c, shards=shards, shard=i)
               for i, c in enumerate(caches or [cache])]
    return workers, LookupChannel(name, 0, worker=False, cache=None, shards=shards)


def test_first_held_is_one_round_trip_that_looks_up_in_order_until_one_is_held():
    keys = [key(i) for i in range(6)]
    cache = Held({keys[3], keys[5]})
    workers, sched = ends(cache)
    try:
        assert sched.first_held(keys) == 3
        assert cache.asked == keys[:4]             # as if asked one by one, stopping at the hit
        client = sched._clients[0]
        assert client.calls == 1
        assert sched.first_held(keys[:3]) is None
        assert sched.first_held([]) is None
        assert sched.leading_held(keys) == 0       # the leading run stops at the first miss
        cache.held = set(keys[:2])
        assert sched.leading_held(keys) == 2
    finally:
        for end in (*workers, sched):
            end.close()


def test_first_held_over_shards_is_the_first_key_every_worker_holds():
    keys = [key(i) for i in range(6)]
    a, b = Held({keys[1], keys[4]}), Held({keys[2], keys[4], keys[5]})
    workers, sched = ends(a, shards=2, caches=[a, b])
    try:
        assert sched.first_held(keys) == 4
        b.held = {keys[2]}
        assert sched.first_held(keys) is None
    finally:
        for end in (*workers, sched):
            end.close()


def test_a_worker_that_is_gone_is_nothing_held():
    keys = [key(i) for i in range(3)]
    workers, sched = ends(Held(set(keys)))
    for end in workers:
        end.close()
    try:
        assert sched.first_held(keys) is None
        assert sched.leading_held(keys) == 0
    finally:
        sched.close()
