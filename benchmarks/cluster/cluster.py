"""Ray layer figures on a two-node cluster on loopback (``python -m benchmarks.cluster.cluster [--quick]``).

- ``registry_lookups_per_s`` (batched: 1,000 keys per call) and ``registry_single_lookups_per_s``
  (one key per call), from the driver to the registry actor;
- ``remote_attention_ms`` vs ``local_attention_ms``: the same attention through the client, the
  group in the home pool against the group on the other node (partial attention there, merged);
- ``copy_gb_per_s``: an embedded pool's fetch (``HostedCache.fetch``), an engine actor on node A
  (a ``PoolHost``) pulling a group whole from the pool on node B into its own pool: one call to
  the holder, whose export returns the pages themselves (a leased view of the arena that Ray
  writes into the object store), the bytes pulled to A and copied from the object-store buffer
  straight into the pages: one copy on each side; against ``object_store_gb_per_s``: the same
  bytes returned by an actor on B to an actor on A that asked for them and does not even read
  them. Both are timed inside the receiving actor, from its call to the bytes in place, once
  per round, the order rotated each round: ``remote_fetch_over_object_store`` = fetch
  throughput / raw throughput, the median of the rounds' ratios (best, worst and every pair
  beside it); and ``remote_fetch_over_object_store_and_copy``: against the same get followed by
  one copy of the bytes into the receiver's memory (the floor of any fetch into a pool).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import mmtier.cluster as mma  # noqa: E402
from benchmarks._common import (  # noqa: E402
    add_out_arg,
    best_time,
    paired_rounds,
    print_table,
    ratio_figures,
    write_results,
)
from mmtier import CacheConfig, ModalitySpec  # noqa: E402
from mmtier.cluster import ClusterSettings, PoolHost, RegistryShards, host_name  # noqa: E402
from mmtier.content import ContentKey, KeyMaker, media_digest, tenant_salt  # noqa: E402


@ray.remote(num_cpus=0)
class _Source:
    def __init__(self, nbytes: int):
        self.buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)

    def make(self) -> np.ndarray:
        return self.buf                      # the object store takes a copy (a put on this node)


@ray.remote(num_cpus=0)
class _Sink:
    def __init__(self, nbytes: int):
        self.dst = torch.ones(nbytes, dtype=torch.uint8)   # touched: resident, like a pool's arena

    def take(self, source) -> float:
        """Seconds to get the source's bytes here (a transfer from the other node), unread."""
        t0 = time.perf_counter()
        buf = ray.get(source.make.remote(), timeout=120)
        seconds = time.perf_counter() - t0
        assert buf.nbytes == self.dst.numel()
        return seconds

    def take_into(self, source) -> float:
        """The same get, then one copy into memory of this process (as an import makes it: a
        byte copy from the read-only object-store buffer, libc's memcpy): a fetch's floor."""
        t0 = time.perf_counter()
        buf = ray.get(source.make.remote(), timeout=120)
        np.copyto(self.dst.numpy(), buf)
        return time.perf_counter() - t0


class _Engine(PoolHost):
    """An engine holding its pool, reduced to the fetch: pull a group, time it, let it go."""

    def fetch_once(self, holder: str, wire: dict[str, str]) -> float:
        key = ContentKey.from_wire(wire)
        t0 = time.perf_counter()
        assert self.local.fetch(key, holder)
        seconds = time.perf_counter() - t0
        assert self.local.drop([key]) == [key.address]    # room for the next round, not timed
        self.local.end_turn()
        return seconds


def _pin(node: str):
    return NodeAffinitySchedulingStrategy(node, soft=False)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seconds, a check that it runs: small sizes, few rounds")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    quick = args.quick
    group_mb = 4 if quick else 32
    store = (group_mb * 6 + 64) << 20
    cfg = CacheConfig(
        model="bench-mm", num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16",
        modalities={"text": ModalitySpec(page_size=16), "vision": ModalitySpec(page_size=64)},
        device="cpu", device_bytes=(group_mb * 4 + 16) << 20, key_secret="bench")
    settings = ClusterSettings(call_timeout_s=120.0, copy_after_remote_uses=0)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "object_store_memory": store, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=store)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="mmtier", include_dashboard=False)
    try:
        figures = _run(cfg, settings, group_mb, quick)
    finally:
        mma.shutdown(settings)
        ray.shutdown()
        cluster.shutdown()
    path = write_results("cluster", figures, args.out)
    print_table("mmtier cluster (2 nodes on loopback)", list(figures.items()))
    print(f"\nwrote {path}")
    return figures


def _run(cfg: CacheConfig, settings: ClusterSettings, group_mb: int, quick: bool) -> dict:
    mma.start(cfg, settings)
    cc = mma.connect(settings)
    nodes = {r: n["NodeID"] for n in ray.nodes() for r in ("node_a", "node_b") if r in n["Resources"]}
    a, b = nodes["node_a"], nodes["node_b"]
    pool_a, pool_b = cc.pools(a)[0], cc.pools(b)[0]
    reg = RegistryShards(settings)                  # as engines reach it (one call per shard)
    figures: dict[str, object] = {"quick": quick}

    # ---- registry lookups
    maker = KeyMaker(cfg.model, cfg.key_secret)
    salt = tenant_salt(cfg.key_secret, "bench")
    layout = cfg.spec("vision").layout_fields()
    n_keys = 1000 if quick else 20000
    keys = [maker.derive(modality="vision", layout=layout, media=media_digest(str(i).encode()),
                         tenant_salt=salt) for i in range(n_keys)]
    items = [{"key": k.to_wire(), "tier": "device", "num_tokens": 64, "nbytes": 1 << 20} for k in keys]
    for i in range(0, n_keys, 5000):      # recorded at a live pool, so the liveness sweep keeps them
        reg.add(pool_a, items[i:i + 5000]).get(120)
    digests = [k.hex for k in keys]
    batch = 1000
    batches = [digests[i:i + batch] for i in range(0, n_keys, batch)]
    reg.lookup(batches[0]).get(60)
    t0 = time.perf_counter()
    rounds = 2 if quick else 5
    for _ in range(rounds):
        pending = [reg.lookup(bt) for bt in batches]
        for p in pending:
            assert p.get(120)[0] is not None
    figures["registry_lookups_per_s"] = rounds * n_keys / (time.perf_counter() - t0)
    singles = 100 if quick else 2000
    t0 = time.perf_counter()
    for d in digests[:singles]:
        reg.lookup([d]).get(60)
    figures["registry_single_lookups_per_s"] = singles / (time.perf_counter() - t0)
    reg.remove(pool_a, digests).get(60)

    # ---- local vs remote partial attention
    n_img = 256 if quick else 4096
    spec = cfg.spec("vision")
    k = torch.randn(spec.num_layers, n_img, spec.num_kv_heads, spec.head_dim, dtype=torch.float16)
    v = torch.randn_like(k)
    img_a = cc.content_key("vision", b"bench-image-a", tenant="bench")
    img_b = cc.content_key("vision", b"bench-image-b", tenant="bench")
    cc.put(img_a, k, v, node=a)
    cc.put(img_b, k, v, node=b)
    local = cc.create_sequence("bench", node=a)
    cc.attach(local, img_a)
    remote = cc.create_sequence("bench", node=a)
    cc.attach(remote, img_b, transfer="remote")
    q = torch.randn(4, 32, spec.head_dim, dtype=torch.float16)
    t_local = best_time(lambda: cc.attention(local, 1, q, causal=False), repeat=5)
    t_remote = best_time(lambda: cc.attention(remote, 1, q, causal=False), repeat=5)
    ref = cc.attention(local, 1, q, causal=False).float()
    got = cc.attention(remote, 1, q, causal=False).float()
    assert float((ref - got).abs().max()) < 1e-2
    figures.update(local_attention_ms=t_local * 1e3, remote_attention_ms=t_remote * 1e3,
                   remote_attention_overhead_ms=(t_remote - t_local) * 1e3,
                   remote_over_local_attention=t_remote / t_local)
    cc.release(local)
    cc.release(remote)

    # ---- group copy vs raw object store, same bytes, same run
    n_big = (group_mb << 20) // spec.token_bytes
    kb = torch.randn(spec.num_layers, n_big, spec.num_kv_heads, spec.head_dim, dtype=torch.float16)
    big = cc.content_key("vision", b"bench-big", tenant="bench")
    cc.put(big, kb, kb, node=b)
    nbytes = spec.pages_for(n_big) * spec.page_bytes
    wire = big.to_wire()
    engine = ray.remote(_Engine).options(
        name=host_name(a), namespace=settings.namespace, num_cpus=0, scheduling_strategy=_pin(a),
    ).remote(settings, device_bytes=(group_mb * 2 + 16) << 20)
    source = _Source.options(scheduling_strategy=_pin(b)).remote(nbytes)
    sink = _Sink.options(scheduling_strategy=_pin(a)).remote(nbytes)

    def copy_once() -> float:
        return ray.get(engine.fetch_once.remote(pool_b, wire), timeout=120)

    def raw_once() -> float:
        return ray.get(sink.take.remote(source), timeout=120)

    def floor_once() -> float:
        return ray.get(sink.take_into.remote(source), timeout=120)

    reps = 5 if quick else 61             # rounds vary 0.7-1.9x on 2 cores: many, for a steady median
    copy_once()                            # one untimed round each: actors and buffers warm
    raw_once()
    floor_once()
    # every side once per round, the order rotated: each fetch is paired with the raw get and
    # the floor measured next to it
    t = paired_rounds({"raw": raw_once, "fetch": copy_once, "floor": floor_once}, reps)
    gb = nbytes / 1e9
    figures.update(group_bytes=nbytes, copy_gb_per_s=gb / statistics.median(t["fetch"]),
                   object_store_gb_per_s=gb / statistics.median(t["raw"]), transfer_rounds=reps)
    # fetch throughput over the raw get's, per pair (the raw get's seconds over the fetch's)
    figures.update(ratio_figures("remote_fetch_over_object_store", t["raw"], t["fetch"], True))
    # the same get plus one copy into the receiver's memory: what any fetch into a pool must at
    # least do; 1.0 means the fetch adds nothing else
    figures.update(ratio_figures("remote_fetch_over_object_store_and_copy", t["floor"], t["fetch"], True))
    ray.kill(engine)
    cc.close()
    return figures


if __name__ == "__main__":
    main()
