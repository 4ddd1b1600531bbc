"""mmtier's SGLang HiCache storage backend, created by SGLang's own backend factory
(``--hicache-storage-backend dynamic``): round trips of pages through the flat page API and
the zero-copy API in each host layout, tenants and TP ranks apart, corrupt pages as misses.

``HostPool`` (``tests/support/sglang_harness.py``) stands in for SGLang's host pool, which cannot be
imported here; it reproduces its page layouts and page methods line for line."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="SGLang is not importable: run ./run engines (.venv-engines: a real vLLM engine, its CPU build here, and SGLang); ./run test then runs this file there")

from mmtier.core.groups import Tier  # noqa: E402
from mmtier.engines.connector_cache import close_shared  # noqa: E402
from mmtier.errors import ConfigError  # noqa: E402
from tests.support.sglang_harness import PAGES, D, H, HostPool, L, P, backend_for  # noqa: E402


def backend(tmp_path, *, tenant="acme", tp_rank=0, device_pages=64):
    return backend_for(dict(model="tiny-sgl", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
                            modalities={"text": {"page_size": P}}, device="cpu",
                            device_bytes=device_pages * P * 2 * L * H * D * 4, host_bytes=0,
                            disk_dir=str(tmp_path / "spill"), disk_bytes=64 << 20, disk_free_floor_bytes=0),
                       tenant=tenant, tp_rank=tp_rank)


@pytest.fixture(autouse=True)
def _close():
    yield
    close_shared()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_zero_copy_round_trip_into_a_fresh_host_pool(tmp_path, layout):
    store = backend(tmp_path)
    assert type(store).__name__ == "MMTierHiCacheStorage"
    src, dst = HostPool(layout), HostPool(layout)
    src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape))
    keys = [f"page-{i}" for i in range(3)]
    src_idx = torch.cat([torch.arange(p * P, (p + 1) * P) for p in (4, 1, 3)])   # shuffled pages
    dst_idx = torch.cat([torch.arange(p * P, (p + 1) * P) for p in (0, 5, 2)])
    store.register_mem_pool_host(src)
    assert store.batch_exists(keys) == 0
    assert store.batch_set_v1(keys, src_idx) == [True] * 3
    assert store.batch_exists(keys + ["missing"]) == 3
    store.register_mem_pool_host(dst)
    assert store.batch_get_v1(keys + ["missing"], torch.cat([dst_idx, torch.arange(8)])) == [True] * 3 + [False]
    for s, d in zip((4, 1, 3), (0, 5, 2), strict=True):
        assert torch.equal(dst.tokens(d * P), src.tokens(s * P))


def test_flat_pages_round_trip_and_tenants_and_ranks_stay_apart(tmp_path):
    store = backend(tmp_path)
    pool = HostPool("page_first")
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    store.register_mem_pool_host(pool)
    pages = [pool.get_data_page(i * P) for i in range(2)]
    assert store.batch_set(["a", "b"], pages) is True
    assert store.exists("a") and store.exists("b") and not store.exists("c")
    got = store.batch_get(["a", "b", "c"], [pool.get_dummy_flat_data_page() for _ in range(3)])
    assert torch.equal(got[0], pages[0]) and torch.equal(got[1], pages[1]) and got[2] is None
    assert torch.equal(store.get("b"), pages[1])
    other_tenant, other_rank = backend(tmp_path, tenant="other"), backend(tmp_path, tp_rank=1)
    assert not other_tenant.exists("a") and not other_rank.exists("a")



def test_a_requests_cache_salt_reaches_the_backend_in_sglangs_page_keys(tmp_path):
    """SGLang's storage API passes no per-request salt (``HiCacheStorageExtraInfo`` holds prefix
    keys only); its page hashes are chained from a seed of the request's ``extra_key`` and
    ``cache_salt`` (``get_storage_hash_str``, ``storage_namespace_seed``; SGLang's ``RadixKey``
    cannot be imported without torchvision), so one tenant's pages are not found under another's
    salt, nor without one, while the same salt finds them."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str, storage_namespace_seed

    tokens = list(range(3 * P))

    def keys(salt):          # what get_storage_hash_str does for a RadixKey carrying the salt
        return get_storage_hash_str(tokens, storage_namespace_seed(None, salt), page_size=P)

    store = backend(tmp_path)
    pool = HostPool("page_first")
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    store.register_mem_pool_host(pool)
    assert store.batch_set_v1(keys("tenant-a"), torch.arange(3 * P)) == [True] * 3
    assert store.batch_exists(keys("tenant-a")) == 3
    assert store.batch_exists(keys("tenant-b")) == 0 and store.batch_exists(keys(None)) == 0

def test_a_corrupt_page_is_a_miss_and_bad_pools_are_refused(tmp_path):
    store = backend(tmp_path, device_pages=2)
    pool = HostPool("layer_first")
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    store.register_mem_pool_host(pool)
    assert store.batch_set_v1([f"p{i}" for i in range(PAGES)], torch.arange(PAGES * P)) == [True] * PAGES
    store.cache.flush()
    key = store.key("p0")
    assert store.cache.index.groups[key].tier == Tier.DISK
    path = next((tmp_path / "spill").glob(f"text-{key.hex}*.arrow"))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    target = pool.get_dummy_flat_data_page().fill_(float("nan"))
    assert store.get("p0", target) is None and torch.isnan(target).all()
    assert not store.exists("p0")
    wrong = HostPool("layer_first")
    wrong.head_dim = 8
    with pytest.raises(ConfigError):
        store.register_mem_pool_host(wrong)
