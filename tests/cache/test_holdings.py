"""What a serving process asks of ``TieredKVCache`` (``cache/holdings.py``): group snapshots,
which keys are indexed, explicit drops, page usage, groups lost; ``attach_placed``; and the calls
of a group attended on another node (``check_attach``, ``chain_elsewhere``, ``chain_key``,
``device_bytes``)."""

from __future__ import annotations

import pytest

from mmtier import TieredKVCache
from mmtier.core.groups import Tier
from mmtier.errors import ForeignKeyError, PrefixMismatchError
from tests.cache.test_parts import kv, make_cfg


def test_group_info_is_a_snapshot_that_counts_no_hit():
    cache = TieredKVCache(make_cfg())
    key, missing = cache.content_key("vision", b"img"), cache.content_key("vision", b"no")
    cache.put(key, *kv(13))
    seq = cache.create_sequence()
    cache.attach(seq, key)
    before = cache.stats().counters
    info = cache.group_info(key)
    assert (info.key, info.num_tokens, info.tier, info.refs, info.evictable) == (key, 13, Tier.DEVICE, 1, False)
    assert info.nbytes == 2 * make_cfg().spec("vision").page_bytes
    assert cache.group_info(missing) is None
    assert cache.group_infos() == [info]
    assert cache.indexed([key, missing]) == [True, False]
    assert cache.stats().counters == before                 # checks, not uses


def test_drop_unreferenced_takes_only_what_nothing_holds_and_is_no_eviction():
    cache = TieredKVCache(make_cfg())
    held, free = cache.content_key("vision", b"held"), cache.content_key("vision", b"free")
    for key in (held, free):
        cache.put(key, *kv(8))
    cache.attach(cache.create_sequence(), held)
    used = cache.page_usage().used_pages
    assert cache.drop_unreferenced([held, free, free]) == [free]
    assert cache.indexed([held, free]) == [True, False]
    assert cache.page_usage().used_pages == used - 1
    assert cache.groups_lost() == 0 and cache.stats().counters.get("evictions", 0) == 0


def test_page_usage_tells_private_runs_from_cached_groups():
    cache = TieredKVCache(make_cfg())
    cache.put(cache.content_key("vision", b"img"), *kv(16))
    seq = cache.create_sequence()
    cache.append(seq, "text", *kv(5))                       # a private run: 2 text pages
    usage = cache.page_usage()
    assert (usage.sequences, usage.used_pages, usage.cached_pages, usage.leases) == (1, 4, 2, 0)
    cache.release(seq)
    usage = cache.page_usage()
    assert (usage.sequences, usage.used_pages, usage.cached_pages) == (0, 2, 2)


def test_groups_lost_counts_evictions_at_the_bottom():
    cache = TieredKVCache(make_cfg())                       # 4 vision pages, no host tier
    keys = [cache.content_key("vision", b"g%d" % i) for i in range(5)]
    for key in keys:
        cache.put(key, *kv(8))
    assert cache.groups_lost() == 1 and cache.indexed(keys) == [False] + [True] * 4


def image_after_a_prefix():
    """A cache; a sequence of 4 text tokens; an image keyed under that prefix, stored; another
    sequence of 4 other text tokens (where the image's key does not belong)."""
    cache = TieredKVCache(make_cfg())
    first = cache.create_sequence()
    cache.append(first, "text", *kv(4), tokens=[1, 2, 3, 4])
    key = cache.content_key("vision", b"img", parent=cache.prefix_key(first))
    cache.put(key, *kv(8))
    other = cache.create_sequence()
    cache.append(other, "text", *kv(4), tokens=[9, 9, 9, 9])
    return cache, first, key, other


def test_attach_placed_skips_the_prefix_check_but_not_the_tenant_check():
    cache, first, key, other = image_after_a_prefix()
    with pytest.raises(PrefixMismatchError):
        cache.attach(other, key)
    cache.attach_placed(other, key)
    assert cache.group_info(key).refs == 1 and cache.sequence(other).length == 12
    with pytest.raises(ForeignKeyError):
        cache.attach_placed(cache.create_sequence("someone-else"), key)


def test_check_attach_makes_attach_checks_and_changes_nothing():
    """A group attended where it lives elsewhere: the attach checks, nothing attached."""
    cache, first, key, other = image_after_a_prefix()
    before = (cache.sequence(other).length, cache.sequence(other).chain, cache.stats().counters)
    with pytest.raises(PrefixMismatchError):
        cache.check_attach(other, key)
    with pytest.raises(ForeignKeyError):
        cache.check_attach(cache.create_sequence("someone-else"), cache.content_key("vision", b"img"))
    assert (cache.sequence(other).length, cache.sequence(other).chain, cache.stats().counters) == before
    cache.check_attach(first, key)                             # where it was derived: fine
    assert cache.group_info(key).refs == 0 and cache.sequence(first).length == 4


def test_chain_elsewhere_names_what_follows_as_a_local_attach_would():
    cache = TieredKVCache(make_cfg())
    key = cache.content_key("vision", b"img")
    cache.put(key, *kv(8))
    local, remote = cache.create_sequence(), cache.create_sequence()
    for seq in (local, remote):
        cache.append(seq, "text", *kv(4), tokens=[5, 6, 7, 8])
    cache.attach(local, key)
    cache.chain_elsewhere(remote, key)
    assert cache.sequence(remote).length == 4                  # no tokens added here
    assert cache.sequence(remote).chain == cache.sequence(local).chain
    assert cache.chain_key(remote, "text") == cache.chain_key(local, "text")
    assert cache.chain_key(remote, "text") != cache.chain_key(cache.create_sequence(), "text")
    assert cache.device_bytes("vision") == 4 * make_cfg().spec("vision").page_bytes   # make_cfg's 4 pages
