"""The registry's shards by chain (``registry_placement="chain"``, the default): every key derived
down a chain carries its root's placement beside it (``ContentKey.place``; the key itself is as
it always was), clients ask with ``digest@placement`` addresses, so a request's chain is on one
shard and its lookup is one call; the placement is the same in every process (a hash of the
root's digest, not Python's salted ``hash``); holders report it with each item, so a killed
shard's chains miss whole until ``start()`` recreates it and it rebuilds them, on the same
shard, from the holders' inventories; a wrong placement is a miss, never wrong bytes.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import dataclasses  # noqa: E402
import json  # noqa: E402
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
from mmtier.cluster.registry_shards import RegistryShards, shard_name, shard_of  # noqa: E402
from mmtier.content import PLACE_BYTES, KeyMaker, tenant_salt  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.ray

SHARDS = 4
CFG = CacheConfig(
    model="tiny-mm", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32",
    modalities={"text": ModalitySpec(page_size=4),
                "vision_embed": ModalitySpec(kind="embedding", width=12, page_size=8)},
    device="cpu", device_bytes=4 << 20, key_secret="test-secret")
SETTINGS = ClusterSettings(registry_shards=SHARDS, sweep_interval_s=0.5, ping_timeout_s=2.0,
                           call_timeout_s=20.0, cpu_pool_bytes=4 << 20)
LAYOUT = [("page_size", "4")]


def _chain(maker: KeyMaker, salt: bytes, tag: bytes, n: int) -> list:
    """A prompt's chain: a root, then each block derived from the one before (as the engines do)."""
    keys, parent = [], None
    for i in range(n):
        parent = maker.derive(modality="text", layout=LAYOUT, media=tag + bytes([i]), tenant_salt=salt,
                              parent=parent)
        keys.append(parent)
    return keys


def test_a_chains_addresses_route_to_one_shard_in_every_process():
    maker, salt = KeyMaker("tiny-mm", "test-secret"), tenant_salt("test-secret", "acme")
    chains = [_chain(maker, salt, secrets.token_bytes(16), 30) for _ in range(20)]
    for keys in chains:
        assert all(k.placement == keys[0].placement for k in keys)
        assert len({k.digest for k in keys}) == len(keys)          # distinct keys, one placement
        tp, state = maker.shard(keys[5], "tp0/2"), maker.state(keys[5], "text")
        for n in (2, 8, 256):
            assert len({shard_of(k.address, n, "chain") for k in keys + [tp, state]}) == 1
    # key placement spreads a chain: 30 keys over 8 shards land on more than one (p(1) = 8^-29)
    assert all(len({shard_of(k.address, 8, "key") for k in keys}) > 1 for keys in chains)
    # a bare digest routes by key as its address does (the old routing, unchanged)
    assert all(shard_of(k.hex, 8, "key") == shard_of(k.address, 8, "key") for k in chains[0])
    # the roots spread over the shards as any hash does
    assert len({shard_of(keys[0].address, 4, "chain") for keys in chains}) > 1
    # another interpreter, another hash seed: the same keys, placements and shards
    tags = [secrets.token_hex(8) for _ in range(5)]
    code = ("import sys, json; from mmtier.content import KeyMaker, tenant_salt; "
            "from mmtier.cluster.registry_shards import shard_of; "
            "m, s = KeyMaker('tiny-mm', 'test-secret'), tenant_salt('test-secret', 'acme'); out = []\n"
            "for t in sys.argv[1:]:\n"
            "    p = None\n"
            "    for i in range(6):\n"
            "        p = m.derive(modality='text', layout=[('page_size', '4')], media=bytes.fromhex(t) + bytes([i]), "
            "tenant_salt=s, parent=p)\n"
            "        out.append([p.address, shard_of(p.address, 8), shard_of(p.address, 8, 'key')])\n"
            "print(json.dumps(out))")
    env = {**os.environ, "PYTHONHASHSEED": str(secrets.randbelow(1 << 30) + 1)}
    got = json.loads(subprocess.run([sys.executable, "-c", code, *tags], capture_output=True, text=True,
                                    env=env, check=True).stdout)
    here = [[k.address, shard_of(k.address, 8), shard_of(k.address, 8, "key")]
            for t in tags for k in _chain(maker, salt, bytes.fromhex(t), 6)]
    assert got == here


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, namespace="mmtier", include_dashboard=False,
             object_store_memory=100 << 20)          # a fresh local Ray, never one already running
    try:
        yield
    finally:
        ray.shutdown()


def _item(key) -> dict:
    return {"key": key.to_wire(), "tier": "host", "num_tokens": 4, "nbytes": 256}


@pytest.mark.parametrize("placement", ["chain", "key"])
def test_one_call_per_request_per_chain(local_ray, placement):
    """8 real shard actors: a request's chain is one call by chain (and the answers are the
    holders'), many calls by key; a chain plus a shared media root is at most two calls."""
    settings = SETTINGS.model_copy(update={"registry_name": f"calls-{placement}", "registry_shards": 8,
                                           "registry_placement": placement, "sweep_interval_s": 3600.0})
    actors = [ray.remote(ContentRegistryActor).options(name=shard_name(settings, i), max_concurrency=100)
              .remote(CFG.model_dump(mode="json"), settings.model_dump(mode="json"), i) for i in range(8)]
    try:
        ray.get([a.__ray_ready__.remote() for a in actors], timeout=300)     # 8 processes on a small machine
        router = RegistryShards(settings)
        maker, salt = KeyMaker("tiny-mm", "test-secret"), tenant_salt("test-secret", "acme")
        chains = [_chain(maker, salt, secrets.token_bytes(16), 30) for _ in range(6)]
        media = maker.derive(modality="text", layout=LAYOUT, media=secrets.token_bytes(32), tenant_salt=salt)
        info = {"name": "h0", "node": "n0", "kind": "store"}
        held = [k for keys in chains[:5] for k in keys] + [media]         # chain 5: never stored
        router.add("h0", [_item(k) for k in held], info).get(30)
        for keys in chains:
            ask = [k.address for k in keys]
            pending = router.lookup(ask)
            calls = len(pending.refs)
            found = pending.get(30)
            assert [loc is not None for loc in found] == [k in held for k in keys]
            assert all(loc.holders[0][0] == "h0" for loc in found if loc is not None)
            if placement == "chain":
                assert calls == 1
            else:
                assert calls == len({shard_of(a, 8, "key") for a in ask}) > 1
            with_media = router.lookup(ask + [media.address])
            assert len(with_media.refs) <= (2 if placement == "chain" else 8)
            assert with_media.get(30)[-1] is not None
        # the shard that holds a chain holds all of it and nothing of it is anywhere else
        if placement == "chain":
            for keys in chains[:5]:
                s = shard_of(keys[0].address, 8)
                assert all(x is not None for x in ray.get(actors[s].lookup.remote([k.hex for k in keys])))
                others = [a for i, a in enumerate(actors) if i != s]
                assert all(x is None for a in others for x in ray.get(a.lookup.remote([k.hex for k in keys])))
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def _put_chains(cc, gen) -> tuple[dict[int, list], dict]:
    """Chains of 5 embedding groups, each derived from the one before, on two shards at least."""
    chains: dict[int, list] = {}
    groups = {}
    while len(chains) < 2:                 # fresh content each run
        parent, keys = None, []
        tag = secrets.token_bytes(8)
        for i in range(5):
            parent = cc.content_key("vision_embed", tag + bytes([i]), tenant="acme", parent=parent)
            keys.append(parent)
        chains.setdefault(shard_of(keys[0].address, SHARDS), keys)
    for keys in chains.values():
        assert len({shard_of(k.address, SHARDS) for k in keys}) == 1
        for k in keys:
            groups[k] = torch.randn(8, 12, generator=gen)
            assert cc.put_embedding(k, groups[k])
    return chains, groups


def _shard_holds(s: int, keys) -> list[bool]:
    actor = ray.get_actor(shard_name(SETTINGS, s), namespace="mmtier")
    return [x is not None for x in ray.get(actor.lookup.remote([k.hex for k in keys]), timeout=30)]


def test_killed_shard_misses_its_chains_whole_then_rebuilds_on_the_same_shard(local_ray):
    mma.start(CFG, SETTINGS)
    cc = mma.connect(SETTINGS)
    try:
        chains, groups = _put_chains(cc, torch.Generator().manual_seed(secrets.randbits(31)))
        keys = list(groups)
        assert all(loc is not None for loc in cc.locate_many(keys))
        lost = next(iter(chains))
        ray.kill(ray.get_actor(shard_name(SETTINGS, lost), namespace="mmtier"), no_restart=True)

        found = cc.locate_many(keys)
        assert [loc is None for loc in found] == [k in chains[lost] for k in keys]     # whole chains
        for k in keys:
            if k in chains[lost]:
                with pytest.raises(UnknownKeyError):
                    cc.get_embedding(k)
            else:
                assert torch.equal(cc.get_embedding(k), groups[k])

        # restarted: it rebuilds its chains from the holders' inventories (which carry each
        # key's placement), on the shard their placement names and on no other
        report = mma.start(CFG, SETTINGS)
        assert report.created == [shard_name(SETTINGS, lost)]
        assert wait_until(lambda: all(loc is not None for loc in cc.locate_many(keys)), timeout=60)
        assert _shard_holds(lost, keys) == [k in chains[lost] for k in keys]
        for s in range(SHARDS):
            if s != lost:
                assert not any(_shard_holds(s, chains[lost]))
        again = mma.connect(SETTINGS)                  # a new client's router: the same shards
        try:
            assert all(loc is not None for loc in again.locate_many(chains[lost]))
            for k in keys:
                assert torch.equal(again.get_embedding(k), groups[k])
        finally:
            again.close()
        assert cc.registry_stats()["keys"] == len(keys)
    finally:
        cc.close()
        mma.shutdown(SETTINGS)


def test_a_wrong_placement_is_a_miss_never_wrong_bytes(local_ray):
    mma.start(CFG, SETTINGS)
    cc = mma.connect(SETTINGS)
    try:
        chains, groups = _put_chains(cc, torch.Generator().manual_seed(secrets.randbits(31)))
        keys = [k for ks in chains.values() for k in ks]
        for k in keys:
            here = shard_of(k.address, SHARDS)
            while True:                    # a placement naming another shard
                wrong = dataclasses.replace(k, place=secrets.token_bytes(PLACE_BYTES))
                if shard_of(wrong.address, SHARDS) != here:
                    break
            assert wrong == k                              # the same key, only routed elsewhere
            assert cc.locate(wrong) is None
            with pytest.raises(UnknownKeyError):
                cc.get_embedding(wrong)
            # another chain's placement (a real one, of the same tenant): a miss as well
            other = next(ks for s, ks in chains.items() if s != here)[0]
            assert cc.locate(dataclasses.replace(k, place=other.placement)) is None
            assert torch.equal(cc.get_embedding(k), groups[k])      # the right one: its own bytes
        assert cc.registry_stats()["keys"] == len(keys)
    finally:
        cc.close()
        mma.shutdown(SETTINGS)
