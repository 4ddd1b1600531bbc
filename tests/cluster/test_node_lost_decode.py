"""A node lost mid-decode, on a real two-node Ray cluster on loopback (issue 52, item 4).

Sequences live on the head node's pool and attend, step after step and layer by layer, over
groups held only by node B's store (attached remotely: attention runs where the pages live).
While the decode loop runs, a thread SIGKILLs B's store and pool processes (``os.kill`` of the
actors' worker processes: no close). Every step that returns equals the float64 oracle, never a
wrong result:

- a sequence whose group had a copy elsewhere (imported into the head's store after the attach)
  is re-homed onto it and decodes on, every step equal;
- a sequence whose groups lived only on B fails its next step with ``HolderLostError`` naming
  exactly those groups (``lost``: their digests), and nothing wrong before that;
- B's store started again over the same ``disk_dir`` re-registers the groups its write-behind
  put on disk, and a new sequence over them decodes equal to the oracle again.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import signal  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

import mmtier.cluster as mma  # noqa: E402
from mmtier import CacheConfig, ModalitySpec  # noqa: E402
from mmtier.cluster import ClusterSettings, HolderLostError  # noqa: E402
from mmtier.cluster.actors import pool_name, store_name  # noqa: E402
from mmtier.cluster.registry_shards import RegistryShards  # noqa: E402
from tests.support.cluster_probe import exported  # noqa: E402
from tests.support.oracle import oracle_attention, rel_err  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.ray

L, H, D, HQ = 2, 2, 16, 4
STEPS = 12
CFG = CacheConfig(
    model="tiny-mm", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
    modalities={"text": ModalitySpec(page_size=4), "vision": ModalitySpec(page_size=8)},
    device="cpu", device_bytes=2 << 20, key_secret="lost-node-secret")
SETTINGS = ClusterSettings(namespace="mmtier-lost-node-test", device_resource="no_such_device",
                           sweep_interval_s=0.5, ping_timeout_s=1.0, sweep_misses=2, call_timeout_s=20.0,
                           copy_after_remote_uses=1000)     # no automatic copies: B's groups stay B's
WAIT_S = 30.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    global CFG
    CFG = CFG.model_copy(update={"disk_dir": tmp_path_factory.mktemp("mmtier-lost-node")})
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_head": 1}, "object_store_memory": 80 << 20,
        "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=80 << 20)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=SETTINGS.namespace, include_dashboard=False)
    try:
        mma.start(CFG, SETTINGS)
        nodes = {r: n["NodeID"] for n in ray.nodes() if n["Alive"]
                 for r in ("node_head", "node_b") if r in n["Resources"]}
        cc = mma.connect(SETTINGS)
        yield nodes, cc
        cc.close()
    finally:
        mma.shutdown(SETTINGS)
        ray.shutdown()
        c.shutdown()


def _actor(name: str):
    return ray.get_actor(name, namespace=SETTINGS.namespace)


def _holders(digests: list[str]) -> list[set[str]]:
    found = RegistryShards(SETTINGS).lookup(digests).get(WAIT_S)
    return [set() if loc is None else {h for h, _ in loc.holders} for loc in found]


class Decode:
    """A sequence and what it holds, for the float64 oracle: one query a step, every layer."""

    def __init__(self, cc, home: str, groups: list[tuple]):
        self.cc, self.groups = cc, groups
        self.seq = cc.create_sequence("acme", node=home)
        for key, *_ in groups:
            cc.attach(self.seq, key, transfer="remote")
        self.k = torch.cat([k for _, k, _ in groups], 1)
        self.v = torch.cat([v for _, _, v in groups], 1)
        self.steps = 0

    def step(self) -> None:
        """One decode step; raises what the cache raised, asserts every layer it answers."""
        n = self.k.shape[1]
        for layer in range(L):
            q = torch.randn(1, HQ, D)
            out = self.cc.attention(self.seq, layer, q)
            ref, _ = oracle_attention(q, torch.tensor([n - 1]), self.k[layer], self.v[layer], torch.arange(n))
            assert rel_err(out, ref) < 2e-5, f"step {self.steps} layer {layer}: a wrong result"
        self.steps += 1


def _on_b_only(cc, b: str, tag: str, n: int):
    key = cc.content_key("vision", f"{tag}-{os.urandom(4).hex()}".encode(), tenant="acme")
    k, v = torch.randn(L, n, H, D), torch.randn(L, n, H, D)
    assert cc.put(key, k, v, node=b) and cc.offload(key)        # B's pool -> B's store
    return key, k, v


def test_a_node_lost_mid_decode_rehomes_or_names_its_groups_then_comes_back_from_disk(cluster):
    nodes, cc = cluster
    head, b = nodes["node_head"], nodes["node_b"]
    b_store = store_name(b)
    lost_groups = [_on_b_only(cc, b, "lost", n) for n in (16, 24)]
    spare = _on_b_only(cc, b, "spare", 8)
    digests = [g[0].hex for g in (*lost_groups, spare)]
    assert _holders(digests) == [{b_store}] * 3
    # the write-behind has put B's store groups on disk (a wait, bounded, not a timing)
    assert wait_until(lambda: ray.get(_actor(b_store).stats.remote(), timeout=WAIT_S)["durable_writes"] >= 3,
                      WAIT_S)

    lost, rehome = Decode(cc, head, lost_groups), Decode(cc, head, [spare])
    # a copy of the spare group on the head's store, made after the attach: the step still
    # reads B's, and has somewhere to go when B dies
    h_store = store_name(head)
    item, _ = ray.get(_actor(h_store).import_group.remote(spare[0].to_wire(), *exported(CFG, *spare)),
                      timeout=WAIT_S)
    RegistryShards(SETTINGS).publish(h_store, [item], [], {"name": h_store, "node": head, "kind": "store"}
                                     ).get(WAIT_S)
    assert _holders([spare[0].hex]) == [{b_store, h_store}]

    for d in (lost, rehome):
        d.step()
    pids = [ray.get(_actor(n).pid.remote(), timeout=WAIT_S) for n in (b_store, pool_name(b, "cpu", 0))]
    started = threading.Event()

    def kill_node_b():
        started.wait(WAIT_S)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_node_b, daemon=True)
    killer.start()
    error = None
    for i in range(STEPS):
        if i == 1:
            started.set()                   # the kill lands while the steps run
        rehome.step()                       # re-homed on the head's copy: never fails
        if error is None:
            try:
                lost.step()
            except HolderLostError as exc:
                error = exc
    killer.join(WAIT_S)
    assert rehome.steps == STEPS + 1
    assert error is not None, "the steps over B's groups went on after B died"
    assert set(error.lost) == {g[0].hex for g in lost_groups}   # named, each of them
    assert b_store in str(error)

    # B's store and pool started again over the same disk_dir: the groups come back
    report = mma.start(CFG, SETTINGS)
    assert b_store in report.created
    assert wait_until(lambda: _holders([g[0].hex for g in lost_groups]) == [{b_store}] * 2, WAIT_S)
    again = Decode(cc, head, lost_groups)
    for _ in range(3):
        again.step()
    for d in (rehome, again):
        cc.release(d.seq)
