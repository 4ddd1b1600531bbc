"""A put's NaN / Inf scan runs beside its copy into pages (``pages.payload.FiniteCheck``) and is
waited on before the group becomes visible: a payload that is not finite is refused with
``DTypeError``, its pages are freed and nothing is recorded, however far the copy had got."""

from __future__ import annotations

import pytest
import torch

from mmtier import CacheConfig, DTypeError, ModalitySpec, TieredKVCache
from mmtier.pages.copies import EngineBlocks
from mmtier.pages.payload import FiniteCheck

L, H, D, P = 2, 2, 32, 16
N = 64                                        # tokens per group: 4 pages


def cfg(tmp_path, groups_on_device: int, **over) -> CacheConfig:
    spec = ModalitySpec(page_size=P)
    group_bytes = spec.pages_for(N) * L * 2 * P * H * D * 4
    return CacheConfig(model="put-checks", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
                       modalities={"text": spec}, device="cpu", device_bytes=groups_on_device * group_bytes,
                       host_bytes=8 * group_bytes, **over)


def kv(gen: torch.Generator):
    return torch.randn(L, N, H, D, generator=gen), torch.randn(L, N, H, D, generator=gen)


def poisoned(gen: torch.Generator, value: float):
    k, v = kv(gen)
    side = k if torch.randint(2, (1,), generator=gen).item() else v
    at = tuple(int(torch.randint(s, (1,), generator=gen)) for s in side.shape)
    side[at] = value
    return k, v


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_payload_that_is_not_finite_is_refused_and_changes_nothing(tmp_path, value):
    gen = torch.Generator().manual_seed(hash(str(value)) & 0xFFFF)
    with TieredKVCache(cfg(tmp_path, groups_on_device=4)) as cache:
        pool = cache.pools["text"]
        good_key = cache.content_key("text", b"good")
        good = kv(gen)
        assert cache.put(good_key, *good)
        free_before, inventory_before = pool.num_free, sorted(map(repr, cache.inventory()))
        bad_key = cache.content_key("text", b"bad")
        with pytest.raises(DTypeError, match="NaN or Inf"):
            cache.put(bad_key, *poisoned(gen, value))
        assert not cache.contains(bad_key)
        assert pool.num_free == free_before                      # the written pages were freed
        assert sorted(map(repr, cache.inventory())) == inventory_before
        k, v = cache.read_group(good_key)
        assert torch.equal(k, good[0]) and torch.equal(v, good[1])
        fresh = kv(gen)                                          # the key is still free to store
        assert cache.put(bad_key, *fresh)
        k, v = cache.read_group(bad_key)
        assert torch.equal(k, fresh[0]) and torch.equal(v, fresh[1])


def test_a_refused_put_that_made_room_leaves_the_moved_group_intact(tmp_path):
    gen = torch.Generator().manual_seed(7)
    # demote: the refused put pushes ``first`` down to make room before its check fails
    with TieredKVCache(cfg(tmp_path, groups_on_device=1, put_placement="demote")) as cache:
        first_key = cache.content_key("text", b"first")
        first = kv(gen)
        assert cache.put(first_key, *first)
        with pytest.raises(DTypeError):
            cache.put(cache.content_key("text", b"bad"), *poisoned(gen, float("nan")))
        tiers = {key: tier for key, tier, _ in cache.inventory()}
        assert tiers == {first_key: "host"}                      # moved down to make room, kept
        k, v = cache.read_group(first_key)
        assert torch.equal(k, first[0]) and torch.equal(v, first[1])
        assert cache.pools["text"].num_free == cache.pools["text"].num_pages


def test_a_bad_payload_under_a_key_already_held_is_refused_too(tmp_path):
    gen = torch.Generator().manual_seed(11)
    with TieredKVCache(cfg(tmp_path, groups_on_device=4)) as cache:
        key = cache.content_key("text", b"held")
        first = kv(gen)
        assert cache.put(key, *first)
        with pytest.raises(DTypeError):
            cache.put(key, *poisoned(gen, float("inf")))
        assert cache.put(key, *kv(gen)) is False                 # a good payload: already held
        k, v = cache.read_group(key)
        assert torch.equal(k, first[0]) and torch.equal(v, first[1])


def test_engine_blocks_with_one_bad_block_are_refused(tmp_path):
    gen = torch.Generator().manual_seed(3)
    blocks = 12
    layers = [(torch.randn(blocks, P, H, D, generator=gen), torch.randn(blocks, P, H, D, generator=gen))
              for _ in range(L)]
    ids = [9, 2, 5, 6]                                           # N tokens: 4 blocks of P
    layers[1][1][5, 3, 1, 7] = float("nan")                      # in one chosen block
    layers[0][0][0, 0, 0, 0] = float("nan")                      # and one outside the group
    with TieredKVCache(cfg(tmp_path, groups_on_device=4)) as cache:
        eb = EngineBlocks(layers, ids)
        with pytest.raises(DTypeError):
            cache.put(cache.content_key("text", b"blocks"), eb, eb)
        layers[1][1][5, 3, 1, 7] = 0.5                           # mended: the block outside is no part
        assert cache.put(cache.content_key("text", b"blocks"), eb, eb)
        k, _ = cache.read_group(cache.content_key("text", b"blocks"))
        want = torch.cat([layers[0][0][b] for b in ids])
        assert torch.equal(k[0], want)


def test_the_scan_runs_beside_on_the_cpu_and_reports_through_wait():
    spec = cfg(None, 1).spec("text")
    gen = torch.Generator().manual_seed(5)
    good, bad = kv(gen), poisoned(gen, float("nan"))
    check = FiniteCheck(spec, *good)
    assert check._future is not None                             # on a second thread
    check.wait()
    check = FiniteCheck(spec, *bad)
    with pytest.raises(DTypeError):
        check.wait()
    check.settle()
