"""A node removed from Ray and added again under its stable label finds its disk (issue 50 item 3),
on a real Ray cluster on loopback.

Nodes carry the Ray label ``mmtier.io/node`` (as ``ray start --labels`` sets it). Node A's store
takes groups and writes them behind to disk; then the node is removed (``cluster.remove_node``)
and a new node joins with the same label: Ray gives it a new node id, and its store, named by
that id, opens the same folder (``node-a/store``), re-registers every group there, and an engine
on node B reads each bit-equal (fresh random inputs). Nodes with different labels never share a
folder; a second live node with a label already in use is refused (``NodeLabelError``) before
anything is created for it, and an engine started there is refused too.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import mmtier.cluster as mma  # noqa: E402
from mmtier import CacheConfig, ModalitySpec  # noqa: E402
from mmtier.cluster import ClusterSettings, NodeLabelError  # noqa: E402
from mmtier.cluster.actors import store_name  # noqa: E402
from mmtier.cluster.engine_pool import host_name  # noqa: E402
from mmtier.cluster.node_labels import LABEL  # noqa: E402
from mmtier.cluster.registry_shards import RegistryShards  # noqa: E402
from tests.support.cluster_probe import Probe, exported, groups, named  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.ray

CFG = CacheConfig(
    model="tiny-mm", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32",
    modalities={"text": ModalitySpec(page_size=4), "vision": ModalitySpec(page_size=8)},
    device="cpu", device_bytes=2 << 20, key_secret="labels-secret")
SETTINGS = ClusterSettings(namespace="mmtier-labels-test", device_resource="no_such_device",
                           sweep_interval_s=0.5, ping_timeout_s=1.0, sweep_misses=2, call_timeout_s=20.0)
WAIT_S = 30.0          # bound of every wait for the cluster to settle
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    global CFG
    CFG = CFG.model_copy(update={"disk_dir": tmp_path_factory.mktemp("mmtier-labels")})
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "object_store_memory": 80 << 20, "include_dashboard": False,
        "labels": {LABEL: "b"}})
    node_a = c.add_node(labels={LABEL: "a"}, **NODE)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=SETTINGS.namespace, include_dashboard=False)
    try:
        mma.start(CFG, SETTINGS)
        ids = _ids_by_label()
        yield c, node_a, ids, _probe(ids["b"])
    finally:
        mma.shutdown(SETTINGS)
        ray.shutdown()
        c.shutdown()


def _ids_by_label() -> dict[str, str]:
    return {n["Labels"][LABEL]: n["NodeID"] for n in ray.nodes() if n["Alive"] and LABEL in n["Labels"]}


def _probe(node: str):
    """An engine on ``node`` (detached, as a serving process is)."""
    return ray.remote(Probe).options(
        name=host_name(node), namespace=SETTINGS.namespace, num_cpus=0, max_concurrency=2,
        lifetime="detached", scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(SETTINGS.model_dump(mode="json"))


def _get(ref):
    return ray.get(ref, timeout=WAIT_S)


def _alive(node: str) -> bool:
    return any(n["NodeID"] == node and n["Alive"] for n in ray.nodes())


def _holders(digests: list[str]) -> list[set[str]]:
    """Each digest's holders as the registry sees them now."""
    return [set() if loc is None else {h for h, _ in loc.holders}
            for loc in RegistryShards(SETTINGS).lookup(digests).get(WAIT_S)]


def _save_in_store(node: str, saved) -> None:
    """Put groups into ``node``'s store as a pool offloads them, publish, wait until on disk."""
    store = ray.get_actor(store_name(node), namespace=SETTINGS.namespace)
    info = {"name": store_name(node), "node": node, "kind": "store"}
    before = _get(store.stats.remote())["durable_writes"]
    for key, k, v, _ in saved:
        item, _ = _get(store.import_group.remote(key.to_wire(), *exported(CFG, key, k, v)))
        assert item is not None and item["tier"] == "host"
        RegistryShards(SETTINGS).publish(info["name"], [item], [], info).get(WAIT_S)
    assert wait_until(lambda: _get(store.stats.remote())["durable_writes"] == before + len(saved), WAIT_S)


def _files(folder, saved) -> set[str]:
    """The digests among ``saved`` with a group file under ``folder``."""
    return {key.hex for key, *_ in saved if any(folder.rglob(f"*-{key.hex}-*.arrow"))}


def test_a_node_added_again_under_its_label_finds_its_groups(cluster):
    c, node_a, ids, probe_b = cluster
    a, b = ids["a"], ids["b"]
    on_a, on_b = groups(CFG, "on-a", (16, 24, 8)), groups(CFG, "on-b", (16,))
    _save_in_store(a, on_a)
    _save_in_store(b, on_b)
    disk = CFG.disk_dir
    # one folder per label, none by node id; each node's groups only in its own
    assert {p.name for p in disk.iterdir()} == {"node-a", "node-b"}
    assert _files(disk / "node-a", on_a) == {g[0].hex for g in on_a} and not _files(disk / "node-a", on_b)
    assert _files(disk / "node-b", on_b) == {on_b[0][0].hex} and not _files(disk / "node-b", on_a)
    wires, digests = [g[0].to_wire() for g in on_a], [g[0].hex for g in on_a]
    found, plan, _ = _get(probe_b.find.remote(wires))
    assert found == [g[3] for g in on_a] and set(plan.values()) == {"fetch"}

    c.remove_node(node_a)                       # the node leaves Ray, its processes with it
    assert wait_until(lambda: not _alive(a), WAIT_S)
    assert wait_until(lambda: _holders(digests) == [set()] * len(digests), WAIT_S)
    c.add_node(labels={LABEL: "a"}, **NODE)     # the same machine joins again: a new node id
    c.wait_for_nodes()
    a2 = _ids_by_label()["a"]
    assert a2 != a

    assert store_name(a2) in mma.start(CFG, SETTINGS).created
    assert wait_until(lambda: _holders(digests) == [{store_name(a2)}] * len(digests), WAIT_S)
    store = ray.get_actor(store_name(a2), namespace=SETTINGS.namespace)
    assert _get(store.stats.remote())["adopted_from_disk"] == len(on_a)
    assert {it["key"]["digest"]: it["tier"] for it in _get(store.inventory.remote())} == {d: "disk" for d in digests}
    found, plan, _ = _get(probe_b.find.remote(wires))
    assert found == [g[3] for g in on_a] and set(plan.values()) == {"fetch"}     # bit-equal
    assert {p.name for p in disk.iterdir()} == {"node-a", "node-b"}


def test_a_second_live_node_with_a_label_in_use_is_refused(cluster):
    c, *_ = cluster
    have = set(_ids_by_label().values())
    twin = c.add_node(labels={LABEL: "a"}, **NODE)      # "a" is alive already
    c.wait_for_nodes()
    try:
        new = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in have
                   and n["Labels"].get(LABEL) == "a")
        with pytest.raises(NodeLabelError, match="mmtier.io/node"):
            mma.start(CFG, SETTINGS)
        assert not named(store_name(new), SETTINGS.namespace)                  # nothing created for it
        engine = _probe(new)                                # an engine there is refused too
        with pytest.raises(ray.exceptions.RayActorError, match="NodeLabelError"):
            _get(engine.pid.remote())
        assert sorted(p.name for p in CFG.disk_dir.iterdir()) == ["node-a", "node-b"]
    finally:
        c.remove_node(twin)


def test_folders_follow_the_label_and_fall_back_to_the_node_id(tmp_path):
    """No cluster: the naming rule itself. A dead node may share its label with a live one (the
    node it was, added again); two live ones may not; a label that is not a folder-safe
    Kubernetes label value is refused; a node without a label keeps the folders by node id."""
    from mmtier.cluster.actors import pool_dir, pool_name
    from mmtier.cluster.node_labels import check_unique, label_of
    from mmtier.cluster.store import store_dir

    def node(i, label=None, alive=True):
        return {"NodeID": f"id{i}", "Alive": alive, "Labels": {LABEL: label} if label else {"ray.io/node-id": f"id{i}"}}

    assert check_unique([node(1, "a", alive=False), node(2, "a"), node(3, "b"), node(4)]) == \
        {"id2": "a", "id3": "b", "id4": None}
    with pytest.raises(NodeLabelError, match="'a'"):
        check_unique([node(1, "a"), node(2, "a"), node(3, "b")])
    for bad in ("-a", "a/b", "../up", "x" * 64):
        with pytest.raises(NodeLabelError):
            label_of(node(1, bad))
    cfg = CFG.model_copy(update={"disk_dir": tmp_path})
    assert store_dir(cfg, "id2", "a") == tmp_path / "node-a" / "store"
    assert store_dir(cfg, "id4") == tmp_path / "store-id4"
    assert pool_dir(tmp_path, pool_name("id2", "dev", 1), "a") == tmp_path / "node-a" / "pool-dev1"
    assert pool_dir(tmp_path, pool_name("id4", "cpu", 0)) == tmp_path / "pool-mmtier-pool_id4_cpu0"
    assert store_dir(CFG.model_copy(update={"disk_dir": None}), "id2", "a") is None
