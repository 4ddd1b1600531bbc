"""``TieredKVCache.export_pages`` / ``import_pages`` (``cache/page_io.py``): a group as page
bytes with one checksum per page and back, on a tiny CPU cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmtier import TieredKVCache
from mmtier.cache import GroupPages
from mmtier.errors import CorruptDataError, ShapeError, UnknownKeyError
from tests.cache.test_parts import kv, make_cfg


def _pair() -> tuple[TieredKVCache, TieredKVCache]:
    return TieredKVCache(make_cfg()), TieredKVCache(make_cfg())


def test_pages_round_trip_byte_for_byte_and_through_the_wire():
    src, dst = _pair()
    key = src.content_key("vision", b"img")
    k, v = kv(13)                                         # 2 pages, the last one 5 tokens
    src.put(key, k, v)
    shipped = src.export_pages(key)
    assert shipped.num_tokens == 13 and shipped.data.dtype == np.uint8 and len(shipped.sums) == 2
    assert dst.import_pages(key, GroupPages.from_wire(*shipped.to_wire()))
    got_k, got_v = dst.read_group(key)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    again = dst.export_pages(key)
    assert np.array_equal(again.data, shipped.data) and again.sums == shipped.sums
    assert dst.stats().counters["puts"] == 1


def test_embeddings_round_trip():
    src, dst = _pair()
    key = src.content_key("vision_embed", b"img")
    x = torch.randn(11, 12)
    src.put_embedding(key, x)
    assert dst.import_pages(key, src.export_pages(key))
    assert torch.equal(dst.get_embedding(key), x)


def test_export_of_a_key_not_held_raises_and_counts_nothing():
    cache = TieredKVCache(make_cfg())
    with pytest.raises(UnknownKeyError):
        cache.export_pages(cache.content_key("vision", b"never put"))
    assert cache.stats().counters.get("exports", 0) == 0


def test_import_of_a_key_held_already_changes_nothing():
    src, dst = _pair()
    key = src.content_key("vision", b"img")
    k, v = kv(16)
    src.put(key, k, v)
    dst.put(key, k + 1, v + 1)                            # other bytes under the same key
    used, counters = dst.page_usage().used_pages, dst.stats().counters
    assert not dst.import_pages(key, src.export_pages(key))
    assert dst.page_usage().used_pages == used and dst.stats().counters == counters
    assert torch.equal(dst.read_group(key)[0], k + 1)


def test_a_flipped_byte_is_a_counted_miss_and_its_pages_go_back():
    src, dst = _pair()
    key = src.content_key("vision", b"img")
    src.put(key, *kv(16))
    shipped = src.export_pages(key)
    bad = np.array(shipped.data, copy=True)
    bad[-1] ^= 0xFF
    free = dst.pools["vision"].num_free
    with pytest.raises(CorruptDataError):
        dst.import_pages(key, GroupPages(shipped.num_tokens, bad, shipped.sums))
    counters = dst.stats().counters
    assert counters["corrupt_reads"] == counters["transfer_corrupt_reads"] == 1
    assert dst.indexed([key]) == [False] and dst.pools["vision"].num_free == free


def test_wrong_sizes_and_missing_checksums_are_refused_up_front():
    src, dst = _pair()
    key = src.content_key("vision", b"img")
    src.put(key, *kv(16))
    shipped = src.export_pages(key)
    free = dst.pools["vision"].num_free
    with pytest.raises(ShapeError):
        dst.import_pages(key, GroupPages(shipped.num_tokens, shipped.data[:-1], shipped.sums))
    with pytest.raises(ShapeError):
        dst.import_pages(key, GroupPages(shipped.num_tokens, shipped.data, shipped.sums[:1]))
    with pytest.raises(ShapeError):
        GroupPages.from_wire({"num_tokens": 16}, shipped.data)
    assert dst.pools["vision"].num_free == free and dst.indexed([key]) == [False]


def test_export_without_copy_is_a_view_of_the_arena_only_when_asked():
    cache = TieredKVCache(make_cfg())
    key = cache.content_key("vision", b"img")
    cache.put(key, *kv(16))
    arena = cache.pools["vision"].view.numpy()
    assert np.shares_memory(cache.export_pages(key, copy=False).data, arena)
    assert not np.shares_memory(cache.export_pages(key).data, arena)
