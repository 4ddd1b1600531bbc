"""Groups an embedded pool attends where they live (``RemoteParts``), without Ray: a real
``HostedCache`` over a real ``PoolService``, its holders real ``PoolService``s in this process,
reached through an in-process transport (the Ray edge replaced by direct calls, nothing else).

Checked against the float64 oracle over the logical sequence, and against a cache that holds
every group itself: the same prefix keys, the same states."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from mmtier.cluster.engine_cache import HostedCache
from mmtier.cluster.pool import PoolService
from mmtier.content import split_address
from mmtier.errors import UnknownKeyError
from tests.support.oracle import oracle_attention, rel_err
from tests.support.reference_model import ReferenceModel

MODEL = ReferenceModel(seed=0)


class InProcess:
    """``RayTransport``'s calls for remote groups, made directly on the holders; counted."""

    def __init__(self, holders: dict[str, PoolService]):
        self.holders = holders
        self.calls: Counter[str] = Counter()

    def attach(self, holder, proxy, tenant, wire):
        self.calls["attach"] += 1
        return self.holders[holder].attach(proxy, tenant, wire)

    def attend(self, holder, parts, layer, q, q_pos, causal, scale):
        self.calls["attend"] += 1
        return self.holders[holder].attend(parts, layer, q, q_pos, causal, scale)

    def attended(self, state, holder):
        return state

    def release(self, holder, proxies):
        self.calls["release"] += 1
        self.holders[holder].release(proxies)


def _kv(spec, n, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(spec.num_layers, n, spec.num_kv_heads, spec.head_dim, generator=g)
    return k, torch.randn(k.shape, generator=g)


@pytest.fixture
def world():
    cfg = MODEL.cache_config(device_bytes=6 << 20)
    holders = {"b1": PoolService(cfg, name="b1", node="n"), "b2": PoolService(cfg, name="b2", node="n")}
    host = PoolService(cfg, name="a", node="n")
    host.transport = InProcess(holders)
    whole = PoolService(cfg, name="whole", node="n")          # holds every group itself
    yield HostedCache(host), holders, whole
    for s in (*holders.values(), host, whole):
        s.close()


def test_remote_groups_between_local_runs_equal_the_oracle_and_a_local_sequence(world):
    hosted, holders, whole = world
    cache = hosted.cache
    vis, text = cache.cfg.spec("vision"), cache.cfg.spec("text")
    g1 = cache.content_key("vision", b"remote-one", tenant="acme")
    g2 = cache.content_key("vision", b"remote-two", tenant="acme")
    gl = cache.content_key("vision", b"local-one", tenant="acme")
    kv = {g1: _kv(vis, 70, 1), g2: _kv(vis, 33, 2), gl: _kv(vis, 40, 3)}
    holders["b1"].put(g1.to_wire(), *kv[g1])
    holders["b2"].put(g2.to_wire(), *kv[g2])
    hosted.put(gl, *kv[gl])
    for key, (k, v) in kv.items():
        whole.put(key.to_wire(), k, v)
    hosted._elsewhere = {g1: "b1", g2: "b2"}                   # the turn's plan: attended there
    assert hosted.contains(g1) and hosted.contains(g2)

    seq, ref = hosted.create_sequence("acme"), whole.cache.create_sequence("acme")
    parts = [("text", _kv(text, 21, 4)), g1, ("text", _kv(text, 11, 5)), gl, g2, ("text", _kv(text, 5, 6))]
    logical = []                                              # (k, v, key or None) in order
    for p in parts:
        if isinstance(p, tuple):
            hosted.append(seq, "text", *p[1])
            whole.cache.append(ref, "text", *p[1])
            logical.append((*p[1], None))
        else:
            hosted.attach(seq, p)
            whole.cache.attach(ref, p)
            logical.append((*kv[p], p))
        assert hosted.prefix_key(seq) == whole.cache.prefix_key(ref)     # same chain, same tail
    total = sum(k.shape[1] for k, _, _ in logical)
    assert hosted.sequence(seq).length == total == whole.cache.sequence(ref).length
    assert hosted.counters["remote_attaches"] == 2 and hosted.transport.calls["attach"] == 2

    starts, at = [], 0
    for k, _, _ in logical:
        starts.append(at)
        at += k.shape[1]
    hq = 2 * vis.num_kv_heads
    cases = [dict(), dict(q_positions=torch.tensor([3, 21, 95, 101, 140, total - 1])),
             dict(groups=[g1, gl], causal=False), dict(modalities=["vision"], causal=False),
             dict(groups=[g2])]
    calls = hosted.transport.calls["attend"]
    for layer in (0, vis.num_layers - 1):
        for case in cases:
            n_q = len(case.get("q_positions", [0, 0, 0]))
            q = torch.randn(n_q, hq, vis.head_dim)
            out, lse = hosted.attention_state(seq, layer, q, **case)
            keep = [i for i, (_, _, key) in enumerate(logical)
                    if ("groups" not in case or key in case["groups"])
                    and ("modalities" not in case or key is not None)]
            ks = torch.cat([logical[i][0][layer] for i in keep])
            vs = torch.cat([logical[i][1][layer] for i in keep])
            kpos = torch.cat([torch.arange(starts[i], starts[i] + logical[i][0].shape[1]) for i in keep])
            qpos = case.get("q_positions", torch.arange(total - n_q, total))
            want_out, want_lse = oracle_attention(q, qpos, ks, vs, kpos, causal=case.get("causal", True))
            assert rel_err(out, want_out) < 1e-4 and rel_err(lse, want_lse) < 1e-4, case
            got = whole.cache.attention_state(ref, layer, q, **case)          # all local: the same
            assert rel_err(out, got[0]) < 1e-4
    # one call per holder per attention call that reaches it: g1 and g2 live on two holders
    per_case = {0: 2, 1: 2, 2: 1, 3: 2, 4: 1}
    assert hosted.transport.calls["attend"] - calls == 2 * sum(per_case.values())

    with pytest.raises(UnknownKeyError):
        hosted.attention_state(seq, 0, torch.randn(1, hq, vis.head_dim),
                               groups=[cache.content_key("vision", b"never", tenant="acme")])
    hosted.release(seq)
    assert hosted.transport.calls["release"] == 2                          # one per holder
    for h in holders.values():                                             # proxies gone: unpinned
        assert h.leak_report()["sequences"] == 0


class Clustered(InProcess):
    """``InProcess`` with the turn-boundary calls: lookups on a real ``ContentRegistry`` and
    whole-group fetches from the holders' exports."""

    def __init__(self, holders: dict[str, PoolService]):
        from mmtier.cluster.registry import ContentRegistry, HolderInfo

        super().__init__(holders)
        self.registry = ContentRegistry()
        for name, h in holders.items():
            self.registry.register_holder(HolderInfo(name, h.node, "pool"))

    def forget(self, digests):
        pass                                    # no lookup cache here: the registry answers afresh

    def lookup_async(self, addresses):          # a plain registry: digests (the shard router strips them)
        self.calls["lookup"] += 1
        return self.registry.lookup([split_address(a)[0] for a in addresses])

    def wait(self, answer, n):
        return answer

    def fetch(self, holder, wire):
        self.calls["fetch"] += 1
        return self.holders[holder].export(wire)

    def land(self, pending, holder=None):
        return pending

    def publish_later(self, holder, items, removed, info):
        self.calls["publish"] += 1


def test_a_fallback_group_is_planned_only_when_its_key_is_found_nowhere():
    """``begin_turn(keys, fallbacks={k: [alt]})``: ``alt`` (a clip's Whisper K/V) is looked up in
    the same call as ``k`` (its transcript) and fetched only when ``k`` is held nowhere."""
    cfg = MODEL.cache_config(device_bytes=6 << 20)
    holder = PoolService(cfg, name="mmtier-pool:m:host0", node="m")
    host = PoolService(cfg, name="mmtier-pool:n:host0", node="n")
    host.transport = Clustered({holder.name: holder})
    hosted = HostedCache(host)
    try:
        vis = cfg.spec("vision")
        primary = hosted.content_key("vision", b"transcript", tenant="acme")
        alt = hosted.content_key("vision", b"whisper-kv", tenant="acme")
        other = hosted.content_key("vision", b"another-transcript", tenant="acme")
        kv = {primary: _kv(vis, 20, 7), alt: _kv(vis, 30, 8)}
        for key, (k, v) in kv.items():
            holder.put(key.to_wire(), k, v)
            host.transport.registry.add(holder.name, [holder.held_item(key)])
        # the key is elsewhere: it is fetched, its fallback is not (one lookup for both)
        hosted.begin_turn([primary], fallbacks={primary: [alt]})
        hosted.end_turn()
        assert host.transport.calls["lookup"] == 1 and host.transport.calls["fetch"] == 1
        assert hosted.plan == {primary.hex: "fetch"} and hosted.contains(primary)
        assert not host.cache.contains(alt)
        got_k, _ = host.cache.read_group(primary)
        assert torch.equal(got_k, kv[primary][0])
        # a key found nowhere: its fallback is planned and fetched
        hosted.begin_turn([other], fallbacks={other: [alt]})
        hosted.end_turn()
        assert host.transport.calls["lookup"] == 2 and host.transport.calls["fetch"] == 2
        assert hosted.plan == {other.hex: "miss", alt.hex: "fetch"} and host.cache.contains(alt)
        # a key held here: nothing is looked up for it or its fallback
        hosted.begin_turn([primary], fallbacks={primary: [alt]})
        hosted.end_turn()
        assert host.transport.calls["lookup"] == 2 and hosted.plan == {primary.hex: "local", alt.hex: "local"}
    finally:
        host.close()
        holder.close()


def test_a_prefix_dependent_group_attended_elsewhere_is_placed_only_under_its_prefix(world):
    """``RemoteParts`` checks the place of a prefix-dependent key in the local sequence (remote
    groups included in its chain): another prefix is ``PrefixMismatchError`` and nothing is
    attached at the holder; a key chained to the remote group attaches after it."""
    from mmtier.errors import PrefixMismatchError

    hosted, holders, _whole = world
    cache = hosted.cache
    vis, text = cache.cfg.spec("vision"), cache.cfg.spec("text")
    seq = hosted.create_sequence("acme")
    hosted.append(seq, "text", *_kv(text, 9, 7), tokens=list(range(9)))
    img = cache.content_key("vision", b"after-nine", tenant="acme", parent=hosted.prefix_key(seq))
    after = cache.content_key("vision", b"after-the-image", tenant="acme", parent=img)
    holders["b1"].put(img.to_wire(), *_kv(vis, 20, 8))
    holders["b2"].put(after.to_wire(), *_kv(vis, 12, 9))
    hosted._elsewhere = {img: "b1", after: "b2"}
    other = hosted.create_sequence("acme")
    hosted.append(other, "text", *_kv(text, 9, 7), tokens=list(range(1, 10)))   # other tokens
    with pytest.raises(PrefixMismatchError):
        hosted.attach(other, img)
    with pytest.raises(PrefixMismatchError):
        hosted.attach(seq, after)                              # img is not before it yet
    assert hosted.transport.calls["attach"] == 0 and hosted.sequence(other).length == 9
    hosted.attach(seq, img)
    hosted.attach(seq, after)                                  # chained to the remote group
    assert hosted.sequence(seq).length == 41 and hosted.transport.calls["attach"] == 2
