"""ContentRegistry as a plain class (no Ray): holders, lookups, refs, claims, liveness."""

from __future__ import annotations

from mmtier import CacheConfig, ModalitySpec, TieredKVCache
from mmtier.cluster.registry import ContentRegistry, HolderInfo

CFG = CacheConfig(model="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32",
                  modalities={"vision": ModalitySpec(page_size=4)}, device="cpu", device_bytes=1 << 20)
KEYS = TieredKVCache(CFG)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def item(name: bytes, tokens=8, tier="device"):
    key = KEYS.content_key("vision", name, tenant="acme")
    return {"key": key.to_wire(), "tier": tier, "num_tokens": tokens, "nbytes": tokens * 64, "refs": 0}


def pool(name: str, node: str = "n1") -> HolderInfo:
    return HolderInfo(name, node, "pool")


def test_add_lookup_remove_batched_in_order():
    r = ContentRegistry()
    a, b, c = item(b"a"), item(b"b", 12), item(b"c")
    r.add("p1", [a, b], pool("p1"))
    r.add("p2", [b], pool("p2", "n2"))
    locs = r.lookup([a["key"]["digest"], c["key"]["digest"], b["key"]["digest"]])
    assert locs[1] is None
    assert locs[0].holders == (("p1", "device"),) and locs[0].num_tokens == 8
    assert dict(locs[2].holders) == {"p1": "device", "p2": "device"} and locs[2].nbytes == 12 * 64
    assert r.remove("p1", [b["key"]["digest"], c["key"]["digest"]]) == 1
    assert r.lookup([b["key"]["digest"]])[0].holders == (("p2", "device"),)
    assert r.stats() == {"keys": 2, "holders": 2, "copies": 2, "bytes": 8 * 64 + 12 * 64,
                         "refs": 0, "claims": 0}


def test_unknown_holder_must_register():
    r = ContentRegistry()
    try:
        r.add("ghost", [item(b"a")])
    except KeyError:
        pass
    else:
        raise AssertionError("an unregistered holder was accepted")


def test_drop_holder_loses_only_what_only_it_held():
    r = ContentRegistry()
    a, b = item(b"a"), item(b"b")
    r.add("p1", [a, b], pool("p1"))
    r.add("p2", [b], pool("p2"))
    orphaned = r.drop_holder("p1")
    assert orphaned == [a["key"]["digest"]]
    assert r.lookup([a["key"]["digest"]]) == [None]
    assert r.lookup([b["key"]["digest"]])[0].holders == (("p2", "device"),)
    assert r.drop_holder("p1") == []                      # idempotent


def test_liveness_misses_drop_after_limit_and_alive_resets():
    r = ContentRegistry(sweep_misses=2)
    a = item(b"a")
    r.add("p1", [a], pool("p1"))
    assert r.note_miss("p1") is False
    r.note_alive("p1")
    assert r.note_miss("p1") is False
    assert r.note_miss("p1") is True
    assert r.lookup([a["key"]["digest"]]) == [None] and r.holders() == []


def test_sync_holder_replaces_inventory_and_rebuilds_refs():
    r = ContentRegistry()
    a, b = item(b"a"), item(b"b")
    r.add("p1", [a], pool("p1"))
    b["refs"] = 3
    r.sync_holder(pool("p1"), [b])                        # restart / rebuild: inventory wins
    assert r.lookup([a["key"]["digest"]]) == [None]
    loc = r.lookup([b["key"]["digest"]])[0]
    assert loc.refs == 3 and r.inventory_of("p1") == [b["key"]["digest"]]


def test_refs_never_negative():
    r = ContentRegistry()
    a = item(b"a")
    r.add("p1", [a], pool("p1"))
    d = a["key"]["digest"]
    r.ref([d, d], 1)
    r.ref([d], -5)
    assert r.lookup([d])[0].refs == 0


def test_put_claims_are_leases_with_ttl():
    clock = Clock()
    r = ContentRegistry(clock=clock)
    a = item(b"a")
    d = a["key"]["digest"]
    assert r.claim(d, "c1", 10.0, a["key"]) == "granted"
    assert r.claim(d, "c2", 10.0) == "pending"
    assert r.claim(d, "c1", 10.0) == "granted"            # a claimant renews its own
    assert r.lookup([d]) == [None]                        # a claim is not a holder
    r.add("p1", [a], pool("p1"))                          # the put landed: claim ends
    assert r.claim(d, "c2", 10.0) == "held"
    b = item(b"b")
    db = b["key"]["digest"]
    assert r.claim(db, "c1", 5.0) == "granted"
    clock.t = 6.0
    assert r.claim(db, "c2", 5.0) == "granted"            # the first putter died: expired
    r.unclaim(db, "c2")
    assert r.stats()["claims"] == 0
    assert r.claim(db, "c3", 1.0) == "granted"
    clock.t = 8.0
    assert r.expire_claims() == 1 and r.stats()["claims"] == 0


def test_claim_placeholder_is_filled_by_first_holder():
    r = ContentRegistry()
    a = item(b"a", tokens=20)
    d = a["key"]["digest"]
    r.claim(d, "c1", 10.0)                                # no wire: placeholder
    r.add("p1", [a], pool("p1"))
    loc = r.lookup([d])[0]
    assert loc.num_tokens == 20 and loc.modality == "vision"


def test_a_large_batched_lookup_answers_every_key_in_order():
    """Thousands of keys in one call (an engine's step asks so; its speed is in the cluster
    benchmark, not here): each known key's own location, unknown ones ``None``, in order."""
    import random

    r = ContentRegistry()
    items = [item(str(i).encode(), tokens=1 + i % 7) for i in range(2000)]
    r.add("p1", items[:1200], pool("p1"))
    r.add("p2", items[800:], pool("p2", "n2"))
    unknown = [item(f"x{i}".encode())["key"]["digest"] for i in range(300)]
    asked = [i["key"]["digest"] for i in items] + unknown
    random.Random(7).shuffle(asked)
    want = {i["key"]["digest"]: (k, i["num_tokens"]) for k, i in enumerate(items)}
    for digest, loc in zip(asked, r.lookup(asked), strict=True):
        if digest not in want:
            assert loc is None
            continue
        k, tokens = want[digest]
        holders = {"p1"} if k < 800 else {"p1", "p2"} if k < 1200 else {"p2"}
        assert loc is not None and loc.num_tokens == tokens and {h for h, _ in loc.holders} == holders
