"""The registry split over shards (``RegistryShards``) on a real local Ray: routing is stable and
total; the same operations give the same answers as one ``ContentRegistry``; a shard killed
makes its keys miss (and only its keys) until ``start()`` recreates it and it rebuilds from the
holders' inventories; a cached location that went stale is verified by the holder and is a miss,
never wrong bytes.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import random  # noqa: E402
import secrets  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

ray = pytest.importorskip("ray")

import mmtier.cluster as mma  # noqa: E402
from mmtier import CacheConfig, ModalitySpec, UnknownKeyError  # noqa: E402
from mmtier.cluster import ClusterSettings  # noqa: E402
from mmtier.cluster.actors import ContentRegistryActor  # noqa: E402
from mmtier.cluster.engine_pool import RayTransport  # noqa: E402
from mmtier.cluster.registry import ContentRegistry, HolderInfo  # noqa: E402
from mmtier.cluster.registry_shards import RegistryShards, shard_name, shard_of, split  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.ray

SHARDS = 4
CFG = CacheConfig(
    model="tiny-mm", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32",
    modalities={"text": ModalitySpec(page_size=4),
                "vision_embed": ModalitySpec(kind="embedding", width=12, page_size=8)},
    device="cpu", device_bytes=4 << 20, key_secret="test-secret")
# a slow sweep: the semantics test's holders are names without actors, which a sweep drops
SETTINGS = ClusterSettings(registry_shards=SHARDS, sweep_interval_s=0.5, ping_timeout_s=2.0,
                           call_timeout_s=20.0, cpu_pool_bytes=4 << 20)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, namespace="mmtier", include_dashboard=False,
             object_store_memory=100 << 20)          # a fresh local Ray, never one already running
    try:
        yield
    finally:
        ray.shutdown()


def _digests(n: int, rng: random.Random) -> list[str]:
    return [rng.randbytes(32).hex() for _ in range(n)]


def test_routing_is_stable_and_total():
    rng = random.Random(secrets.randbits(32))
    digests = _digests(4000, rng)
    for n in (1, 2, 4, 8):
        parts = split(digests, n)
        assert sorted(i for p in parts for i in p) == list(range(len(digests)))    # each once
        assert all(shard_of(digests[i], n) == s for s, p in enumerate(parts) for i in p)
        # every shard gets a share near 1/n (a binomial's 6 sigma: fails only if routing is skewed)
        sigma = (len(digests) * (1 / n) * (1 - 1 / n)) ** 0.5
        assert all(abs(len(p) - len(digests) / n) <= 6 * sigma + 1 for p in parts), [len(p) for p in parts]
    names = [f"not-hex-{i}" for i in range(2000)]           # any other name: hashed, as total
    assert sorted(i for p in split(names, 4) for i in p) == list(range(len(names)))
    assert all(len(p) > 300 for p in split(names, 4))
    # the same shard in another interpreter with another hash seed (not Python's salted hash)
    sample = digests[:50] + names[:50]
    code = ("import sys; from mmtier.cluster.registry_shards import shard_of; "
            "print(' '.join(str(shard_of(d, 8)) for d in sys.argv[1:]))")
    env = {**os.environ, "PYTHONHASHSEED": str(rng.randrange(1, 1 << 30))}
    out = subprocess.run([sys.executable, "-c", code, *sample], capture_output=True, text=True,
                         env=env, check=True).stdout.split()
    assert out == [str(shard_of(d, 8)) for d in sample]
    assert {shard_name(SETTINGS, i) for i in range(SHARDS)} == {
        "mmtier-registry", "mmtier-registry:shard1", "mmtier-registry:shard2", "mmtier-registry:shard3"}


def _item(digest: str, tokens: int, tier: str = "device") -> dict:
    return {"key": {"digest": digest, "modality": "vision"}, "tier": tier,
            "num_tokens": tokens, "nbytes": tokens * 64}


def test_same_answers_as_one_registry(local_ray):
    """A random sequence of every operation, against one ``ContentRegistry`` (the reference)
    and against ``RegistryShards`` over real shard actors: every answer equal."""
    settings = SETTINGS.model_copy(update={"registry_name": "semantics", "sweep_interval_s": 3600.0})
    actors = [ray.remote(ContentRegistryActor).options(name=shard_name(settings, i), max_concurrency=100)
              .remote(CFG.model_dump(mode="json"), settings.model_dump(mode="json"), i) for i in range(SHARDS)]
    try:
        router = RegistryShards(settings)
        ref = ContentRegistry(sweep_misses=settings.sweep_misses)
        seed = secrets.randbits(32)
        rng = random.Random(seed)
        digests = _digests(120, rng)
        holders = [HolderInfo(f"h{i}", f"node{i % 2}", "pool" if i % 2 else "store") for i in range(4)]
        info = {h.name: {"name": h.name, "node": h.node, "kind": h.kind} for h in holders}
        get = lambda pending: pending.get(30)  # noqa: E731
        for step in range(400):
            op = rng.choice(["sync", "add", "add", "remove", "drop", "ref", "claim", "unclaim", "lookup", "lookup"])
            h = rng.choice(holders)
            some = rng.sample(digests, rng.randint(1, 12))
            ctx = f"seed {seed} step {step} op {op}"
            if op == "sync":
                inv = [_item(d, rng.randint(1, 64)) for d in some]
                ref.sync_holder(h, inv)
                get(router.sync_holder(info[h.name], inv))
            elif op == "add":
                items = [_item(d, rng.randint(1, 64), rng.choice(["device", "host", "disk"])) for d in some]
                ref.add(h.name, items, h)
                get(router.add(h.name, items, info[h.name]))
            elif op == "remove":
                assert get(router.remove(h.name, some)) == ref.remove(h.name, some), ctx
            elif op == "drop":
                assert get(router.drop_holder(h.name)) == sorted(ref.drop_holder(h.name)), ctx
            elif op == "ref":
                delta = rng.choice([-1, 1, 2])
                ref.ref(some, delta)
                get(router.ref(some, delta))
            elif op == "claim":
                who = rng.choice(["c1", "c2"])
                assert get(router.claim(some[0], who)) == ref.claim(some[0], who, settings.lease_ttl_s), ctx
            elif op == "unclaim":
                who = rng.choice(["c1", "c2"])
                ref.unclaim(some[0], who)
                get(router.unclaim(some[0], who))
            else:
                assert get(router.lookup(some)) == ref.lookup(some), ctx
        assert get(router.lookup(digests)) == ref.lookup(digests), seed
        assert get(router.stats()) == ref.stats(), seed
        assert {h.name for h in get(router.holders())} == {h.name for h in ref.holders()}, seed
        # a digest's state lives on its shard only
        for i, a in enumerate(actors):
            mine = [d for d in digests if shard_of(d, SHARDS) == i]
            theirs = [d for d in digests if shard_of(d, SHARDS) != i]
            assert ray.get(a.lookup.remote(mine)) == ref.lookup(mine)
            assert ray.get(a.lookup.remote(theirs)) == [None] * len(theirs)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


@pytest.fixture(scope="module")
def started(local_ray):
    mma.start(CFG, SETTINGS)
    try:
        yield
    finally:
        mma.shutdown(SETTINGS)


def _put_embeddings(cc, n: int, tag: bytes) -> dict:
    gen = torch.Generator().manual_seed(secrets.randbits(31))
    out = {}
    for i in range(n):
        key = cc.content_key("vision_embed", tag + bytes([i]), tenant="acme")
        x = torch.randn(8, 12, generator=gen)
        assert cc.put_embedding(key, x)
        out[key] = x
    return out


def test_killed_shard_misses_its_keys_until_rebuilt(started):
    cc = mma.connect(SETTINGS)
    try:
        groups = _put_embeddings(cc, 24, b"shard-kill")
        keys = list(groups)
        by_shard = {s: [k for k in keys if shard_of(k.address, SHARDS) == s] for s in range(SHARDS)}
        lost = max(by_shard, key=lambda s: len(by_shard[s]))
        assert by_shard[lost] and len(by_shard[lost]) < len(keys)
        assert all(loc is not None for loc in cc.locate_many(keys))
        ray.kill(ray.get_actor(shard_name(SETTINGS, lost), namespace="mmtier"), no_restart=True)

        # the client's lookups: the lost shard's keys miss, the others hit, nothing raises
        found = cc.locate_many(keys)
        assert [loc is None for loc in found] == [shard_of(k.address, SHARDS) == lost for k in keys]
        for k in keys:
            if shard_of(k.address, SHARDS) == lost:
                with pytest.raises(UnknownKeyError):
                    cc.get_embedding(k)
            else:
                assert torch.equal(cc.get_embedding(k), groups[k])
        # the engine's path (``RayTransport``): the same misses, no exception, a counted failure
        transport = RayTransport(SETTINGS)
        got = transport.wait(transport.lookup_async([k.address for k in keys]), len(keys))
        assert [loc is None for loc in got] == [shard_of(k.address, SHARDS) == lost for k in keys]
        assert transport.calls["lookup_failed"] == 1
        assert cc.registry_stats()["keys"] == len(keys) - len(by_shard[lost])
        # what goes to every shard still reaches the live ones (the lost one rebuilds later)
        assert RegistryShards(SETTINGS).drop_holder("mmtier-pool:gone:cpu0").get(30) == []

        # start() recreates the shard; it rebuilds its part from the holders' inventories
        report = mma.start(CFG, SETTINGS)
        assert report.created == [shard_name(SETTINGS, lost)]
        assert wait_until(lambda: all(loc is not None for loc in cc.locate_many(keys)), timeout=60)
        for k in keys:
            assert torch.equal(cc.get_embedding(k), groups[k])
        assert cc.registry_stats()["keys"] == len(keys)
    finally:
        cc.close()


def test_stale_cached_location_is_a_miss_never_wrong_bytes(started):
    """A client trusting found locations for a minute: the group leaves its holder (dropped
    through another client); the cache still names the holder, the holder refuses the key:
    a miss, the entry dropped, and the next lookup asks the registry again."""
    cached = SETTINGS.model_copy(update={"registry_cache_s": 60.0})
    a, b = mma.connect(cached), mma.connect(SETTINGS)
    try:
        groups = _put_embeddings(a, 3, b"stale")
        keys = list(groups)
        locs = a.locate_many(keys)                     # learned, and cached
        assert all(loc is not None for loc in locs)
        gone = keys[0]
        holder = locs[0].holders[0][0]
        # another client removes the group at its holder and tells the registry
        dropped = ray.get(b.holders.actors[holder].drop.remote([gone.to_wire()]), timeout=30)
        assert dropped == [gone.address]
        b.holders.forget_evicted(holder, dropped)
        assert wait_until(lambda: b.locate(gone) is None, timeout=30)
        assert a.locate(gone) == locs[0]               # a's cache is stale, within its bound
        assert a.holders.registry.cache_hits >= 1
        with pytest.raises(UnknownKeyError):
            a.get_embedding(gone)                      # verified by the holder: a miss
        assert a.locate(gone) is None                  # the stale entry is gone
        for k in keys[1:]:                             # the others still right, from the cache
            assert torch.equal(a.get_embedding(k), groups[k])
    finally:
        a.close()
        b.close()
