"""A node's holder killed outright, on a real two-node Ray cluster on loopback (issue 50, item 3).

Node A holds groups (its node store, or an engine's embedded pool); its process is killed with
SIGKILL (``os.kill`` of the actor's worker process, as the OOM killer or a lost node would: no
close runs). Meanwhile an engine on node B looks the groups up: a miss, never an error and never
a dead holder's bytes, and the registry's liveness sweep drops the dead holder. Then the holder
is started again over the same ``disk_dir``: it re-registers every group its disk holds (the
write-behind put them there) and B finds each again, bytes equal to those of the tensors saved
(fresh random inputs); a torn file is quarantined at the restart, not registered: a miss.

A node removed and added again (a new Ray node id) finds its folders by its stable label:
tests/cluster/test_node_labels.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import signal  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import mmtier.cluster as mma  # noqa: E402
from mmtier import CacheConfig, ModalitySpec  # noqa: E402
from mmtier.cluster import ClusterSettings  # noqa: E402
from mmtier.cluster.actors import store_name  # noqa: E402
from mmtier.cluster.engine_pool import host_name  # noqa: E402
from mmtier.cluster.registry_shards import RegistryShards  # noqa: E402
from mmtier.cluster.store import store_dir  # noqa: E402
from mmtier.content import ContentKey  # noqa: E402
from tests.support.cluster_probe import Probe, exported, groups, named  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402

pytestmark = pytest.mark.ray

L, H, D = 2, 2, 16
CFG = CacheConfig(
    model="tiny-mm", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
    modalities={"text": ModalitySpec(page_size=4), "vision": ModalitySpec(page_size=8)},
    device="cpu", device_bytes=2 << 20, key_secret="restart-secret")
SETTINGS = ClusterSettings(namespace="mmtier-restart-test", device_resource="no_such_device",
                           sweep_interval_s=0.5, ping_timeout_s=1.0, sweep_misses=2, call_timeout_s=20.0)
WAIT_S = 30.0          # bound of every wait for the cluster to settle


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    global CFG
    CFG = CFG.model_copy(update={"disk_dir": tmp_path_factory.mktemp("mmtier-restart")})
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_b": 1}, "object_store_memory": 80 << 20,
        "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"node_a": 1}, object_store_memory=80 << 20)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=SETTINGS.namespace, include_dashboard=False)
    try:
        mma.start(CFG, SETTINGS)
        nodes = {r: n["NodeID"] for n in ray.nodes() if n["Alive"]
                 for r in ("node_a", "node_b") if r in n["Resources"]}
        probe_b = _probe(nodes["node_b"])
        yield nodes, probe_b
    finally:
        mma.shutdown(SETTINGS)
        ray.shutdown()
        c.shutdown()


def _probe(node: str, **options):
    """An engine on ``node`` (detached: a serving process outlives whoever started it, and Ray
    lets its name go when it dies)."""
    return ray.remote(Probe).options(
        name=host_name(node), namespace=SETTINGS.namespace, num_cpus=0, max_concurrency=2, **options,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(SETTINGS.model_dump(mode="json"))


def _get(ref):
    return ray.get(ref, timeout=WAIT_S)


def _wait_until(pred, timeout=WAIT_S) -> bool:
    return wait_until(pred, timeout)


def _registry() -> RegistryShards:
    """The registry as every client sees it: its shards behind one router."""
    return RegistryShards(SETTINGS)


def _holders(digests: list[str]) -> list[set[str]]:
    """Each digest's holders as the registry sees them now."""
    return [set() if loc is None else {h for h, _ in loc.holders}
            for loc in _registry().lookup(digests).get(WAIT_S)]


def _groups(tag: str, sizes: tuple[int, ...]):
    return groups(CFG, tag, sizes)


def _sigkill(actor) -> None:
    """Kill the actor's worker process as a crash would: no close, no flush, no goodbye."""
    os.kill(_get(actor.pid.remote()), signal.SIGKILL)


def _check_outage(probe_b, wires, digests, dead: str) -> None:
    """Right after the kill, and once the sweep has dropped ``dead``: each group a miss on B."""
    found, _, stats = _get(probe_b.find.remote(wires))
    assert found == [None] * len(wires)                 # a miss: no error, no bytes
    assert _wait_until(lambda: all(dead not in h for h in _holders(digests)))
    found, plan, _ = _get(probe_b.find.remote(wires))
    assert found == [None] * len(wires) and set(plan.values()) == {"miss"}
    assert dead not in {h.name for h in _registry().holders().get(WAIT_S)}


def test_sigkilled_store_re_registers_its_disk_and_other_nodes_find_it(cluster):
    nodes, probe_b = cluster
    a = nodes["node_a"]
    store = ray.get_actor(store_name(a), namespace=SETTINGS.namespace)
    groups = _groups("store", (16, 24, 32, 8))
    wires, digests = [g[0].to_wire() for g in groups], [g[0].hex for g in groups]
    info = {"name": store_name(a), "node": a, "kind": "store"}
    for key, k, v, _ in groups:          # as a pool offloads: import, then tell the registry
        item, _ = _get(store.import_group.remote(key.to_wire(), *_exported(key, k, v)))
        assert item is not None and item["tier"] == "host"
        _registry().publish(info["name"], [item], [], info).get(WAIT_S)
    assert _holders(digests) == [{store_name(a)}] * len(groups)
    # the write-behind has put every host group on disk (a wait, not a timing)
    assert _wait_until(lambda: _get(store.stats.remote())["durable_writes"] == len(groups))
    found, plan, _ = _get(probe_b.find.remote(wires))
    assert found == [g[3] for g in groups] and set(plan.values()) == {"fetch"}

    _sigkill(store)
    _check_outage(probe_b, wires, digests, store_name(a))
    torn_key = groups[-1][0]                    # a file torn by the crash: half of it is left
    for path in store_dir(CFG, a).glob(f"vision-{torn_key.hex}-*.arrow"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    assert store_name(a) in mma.start(CFG, SETTINGS).created      # restarted over the same dir
    store = ray.get_actor(store_name(a), namespace=SETTINGS.namespace)
    good = digests[:-1]
    assert _wait_until(lambda: _holders(good) == [{store_name(a)}] * len(good))
    assert _holders([torn_key.hex]) == [set()]                 # quarantined: never registered
    disk = _get(store.stats.remote())
    assert disk["adopted_from_disk"] == len(good) and disk["disk"]["quarantined_at_start"] >= 1
    found, plan, _ = _get(probe_b.find.remote(wires))
    assert found[:-1] == [g[3] for g in groups[:-1]]           # bit-equal, from the restarted store
    assert found[-1] is None and plan[torn_key.hex] == "miss"


def test_sigkilled_engine_re_registers_its_disk_and_other_nodes_find_it(cluster):
    nodes, probe_b = cluster
    a = nodes["node_a"]
    name = host_name(a)
    engine = _probe(a, lifetime="detached")
    groups = _groups("engine", (16, 40, 8))
    wires, digests = [g[0].to_wire() for g in groups], [g[0].hex for g in groups]
    assert _get(engine.save.remote([(w, g[1], g[2]) for w, g in zip(wires, groups)])) == len(groups)
    assert _wait_until(lambda: _holders(digests) == [{name}] * len(groups))
    assert _wait_until(lambda: _get(engine.durable_writes.remote()) == len(groups))

    _sigkill(engine)
    _check_outage(probe_b, wires, digests, name)

    assert _wait_until(lambda: not named(name, SETTINGS.namespace))        # Ray has let the dead actor's name go
    engine = _probe(a, lifetime="detached")             # the engine started again on node A
    assert _wait_until(lambda: _holders(digests) == [{name}] * len(groups))
    tiers = {it["key"]["digest"]: it["tier"] for it in _get(engine.inventory.remote())}
    assert tiers == {d: "disk" for d in digests}        # re-registered from its disk
    found, plan, _ = _get(probe_b.find.remote(wires))
    assert found == [g[3] for g in groups] and set(plan.values()) == {"fetch"}
    ray.kill(engine)


def _exported(key: ContentKey, k: torch.Tensor, v: torch.Tensor):
    return exported(CFG, key, k, v)
