"""Live sharing across vLLM instances through the mmtier cluster (``mmtier_cluster``), on a real
two-node Ray cluster on loopback: instance A (a process on node A) saves a request with a prefix
and an image; instance B (a process on node B, its own cache) gets every full block from one
registry lookup and one fetch per group, and loads the same bytes into its own paged tensors;
another ``cache_salt`` gets nothing; the registry shows the groups at A's node store; once A's
process is killed B's copies still load, and a fresh cache in B pulls them again from the store.
Encoder outputs (the EC connector) go the same way; so do a scheduler and a worker in processes
of their own (vLLM's Ray executor, as under Ray Serve LLM), joined only by the cluster.

Each instance is a Ray actor that builds its connectors with vLLM's own factory and objects
(``tests/support/vllm_instance.py``); needs vLLM importable (``./run engines``)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not importable: run ./run engines (.venv-engines: a real vLLM engine, its CPU build here, and SGLang); "
                "./run test then runs this file there", allow_module_level=True)

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import mmtier.cluster as mma  # noqa: E402
from mmtier.cluster import ClusterSettings  # noqa: E402
from mmtier.cluster.actors import NodeStoreActor, store_name  # noqa: E402
from mmtier.cluster.registry_shards import RegistryShards  # noqa: E402
from mmtier.config import CacheConfig  # noqa: E402
from tests.support.engine_shapes import EMBED_WIDTH, cache_fields, with_embeddings  # noqa: E402
from tests.support.vllm_instance import VllmInstance  # noqa: E402

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]

# A dead holder leaves the registry at once; a live one under CI's load (engines beside these
# tests on two cores) may answer a ping late, so it leaves only after 20 missed pings in a row.
SETTINGS = ClusterSettings(namespace="mmtier-share-test", device_resource="no_such_device",
                           sweep_interval_s=0.5, ping_timeout_s=2.0, sweep_misses=20, call_timeout_s=20.0)
CLUSTER = {"namespace": SETTINGS.namespace, "call_timeout_s": 20.0}
NUM_BLOCKS, PROMPT_BLOCKS = 24, 6
SECRET = os.urandom(32).hex()       # the cluster's; the engines' configs leave theirs unset and take it


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("share")
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_a": 1}, "object_store_memory": 80 << 20, "include_dashboard": False})
    c.add_node(num_cpus=2, resources={"node_b": 1}, object_store_memory=80 << 20)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=SETTINGS.namespace, include_dashboard=False)
    mma.start(CacheConfig(**with_embeddings(cache_fields(base / "cluster")), key_secret=SECRET), SETTINGS)
    nodes = {r: n["NodeID"] for n in ray.nodes() for r in ("node_a", "node_b") if r in n["Resources"]}
    yield base, nodes, c.address
    mma.shutdown(SETTINGS)
    ray.shutdown()
    c.shutdown()


def _instance(node: str, disk_dir):
    """An engine process on ``node`` with its own cache (its own disk directory: nothing is
    shared through the filesystem)."""
    return ray.remote(VllmInstance).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(cache_fields(disk_dir), CLUSTER)


def _blocks(seed: int) -> list[int]:
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[:PROMPT_BLOCKS].tolist()


def test_a_second_instance_loads_what_the_first_saved_and_outlives_it(cluster):
    base, nodes, _address = cluster
    a, b = _instance(nodes["node_a"], base / "a"), _instance(nodes["node_b"], base / "b")
    pid_a, _ = ray.get([a.ready.remote(), b.ready.remote()], timeout=180)
    seed = int.from_bytes(os.urandom(4), "little")              # a fresh prompt every run

    src = ray.get(a.save.remote("r1", seed, _blocks(1), seed), timeout=60)
    assert torch.isfinite(src).all() and src.abs().sum() > 0

    # the registry shows every group of the request, held by A's node store
    digests = ray.get(a.digests.remote("r1", seed), timeout=60)
    assert len(digests) == 3                                   # text [0, 10), image [10, 26), text [26, 40)
    locs = RegistryShards(SETTINGS).lookup(digests).get(30)
    assert all(loc is not None for loc in locs)
    assert {loc.holders for loc in locs} == {((store_name(nodes["node_a"]), "host"),)}

    # B: every full block, one lookup and one fetch per group, the same bytes in its own tensors
    got = ray.get(b.load.remote("r2", seed, _blocks(2)), timeout=60)
    assert got["hit"] == 40 and got["failed"] == []
    assert torch.equal(got["kv"], src)
    assert got["calls"]["lookup"] == 1 and got["calls"]["fetch"] == 3
    assert got["counters"]["pulled"] == 3

    # another tenant (cache_salt) gets nothing, from B's cache or the cluster's
    assert ray.get(b.hit.remote("r3", seed, "other"), timeout=60) == 0

    # the encoder-cache connector: an encoder output A saved is found and loaded by B
    ray.get([a.encoder_cache.remote(str(base / "a-ec")), b.encoder_cache.remote(str(base / "b-ec"))], timeout=60)
    x = torch.randn(16, EMBED_WIDTH)
    item = f"img-{seed}"
    assert ray.get(b.ec_load.remote("e0", item), timeout=60)["has"] is False
    ray.get(a.ec_save.remote(item, x), timeout=60)
    ec = ray.get(b.ec_load.remote("e1", item), timeout=60)
    assert ec["has"] is True and torch.equal(ec["x"], x) and ec["deferred"] == 1   # a step, not a wait
    assert ec["calls"]["lookup"] == 2 and ec["calls"]["fetch"] == 1

    # A's process dies: B's own copies load (no cluster call), and a fresh cache in B pulls
    # the groups again from the node store, which outlives A
    os.kill(pid_a, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(a.ready.remote(), timeout=60)
    again = ray.get(b.load.remote("r4", seed, _blocks(3)), timeout=60)
    assert again["hit"] == 40 and again["failed"] == [] and torch.equal(again["kv"], src)
    assert (again["calls"]["lookup"], again["calls"]["fetch"]) == (2, 3)   # r2 and r3's: none for r4
    ray.get(b.reopen.remote(str(base / "b-fresh")), timeout=60)
    fresh = ray.get(b.load.remote("r5", seed, _blocks(4)), timeout=60)
    assert fresh["hit"] == 40 and fresh["failed"] == [] and torch.equal(fresh["kv"], src)
    assert fresh["counters"]["pulled"] == 3

    # vLLM's Ray executor (Serve LLM): scheduler and worker with caches of their own; the
    # scheduler only locates the groups, the worker pulls them at load
    ray.get(b.split.remote(str(base / "b-split")), timeout=60)
    split = ray.get(b.load.remote("r6", seed, _blocks(5)), timeout=60)
    assert split["hit"] == 40 and split["failed"] == [] and torch.equal(split["kv"], src)
    assert split["scheduler_groups"] == 0 and split["counters"].get("pulled", 0) == 0
    assert split["calls"]["lookup"] == 1 and split["worker_counters"]["pulled"] == 3
    assert split["worker_calls"]["lookup"] == 1 and split["worker_calls"]["fetch"] == 3
    ray.get(b.encoder_cache.remote(str(base / "b-ec-split"), True), timeout=60)
    ec = ray.get(b.ec_load.remote("e2", item), timeout=60)
    assert ec["has"] is True and torch.equal(ec["x"], x) and ec["deferred"] == 1
    assert ec["scheduler_groups"] == 0 and ec["worker_pulled"] == 1
    ray.kill(b, no_restart=True)


def test_sglang_instances_share_pages_through_the_cluster(cluster):
    """SGLang's backend in this process (A) stores pages; a second process (B), not connected to
    Ray until its backend joins the cluster (``RAY_ADDRESS``), finds them with ``batch_exists``
    (one lookup, one fetch per page) and loads the same bytes zero-copy into its host pool."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not importable: run ./run engines")
    from mmtier.engines.connector_cache import close_shared
    from tests.support import sglang_harness as sh

    base, _nodes, address = cluster
    run = os.urandom(6).hex()                                   # fresh page keys every run
    keys = [f"{run}-page-{i}" for i in range(3)]
    store = sh.backend_for(cache_fields(base / "sgl-a"), mmtier_cluster=CLUSTER)
    try:
        pool = sh.HostPool("page_first")
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
        store.register_mem_pool_host(pool)
        assert store.batch_exists(keys) == 0                    # nobody holds them yet
        assert store.batch_set_v1(keys, sh.page_indices([4, 1, 3])) == [True] * 3
        store.link.wait()                                       # written through and published
        assert store.link.counters["shared"] == 3
        want = torch.stack([pool.tokens(p * sh.P) for p in (4, 1, 3)])
        holder, lost = store.link.store, store.key(keys[1]).to_wire()
    finally:
        close_shared()
    env = dict(os.environ, RAY_ADDRESS=address, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    job = {"fields": cache_fields(base / "sgl-b"), "cluster": CLUSTER, "keys": keys, "pages": [0, 5, 2]}
    done = subprocess.run([sys.executable, "-m", "tests.support.sglang_harness", json.dumps(job)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("{")))
    assert got["found"] == 3 and got["loaded"] == [True] * 3 and got["other_tenant"] == 0
    assert got["calls"]["lookup"] == 1 and got["calls"]["fetch"] == 3 and got["pulled"] == 3
    assert torch.equal(torch.tensor(got["values"]).reshape(want.shape), want)

    # a holder that lost a group the registry still lists: the pull of it fails, a miss from
    # there on (the pages before it still load), never wrong bytes
    ray.get(ray.get_actor(holder, namespace=SETTINGS.namespace).drop.remote([lost]), timeout=30)
    fresh = sh.backend_for(cache_fields(base / "sgl-c"), mmtier_cluster=CLUSTER)
    try:
        pool = sh.HostPool("page_first")
        fresh.register_mem_pool_host(pool)
        assert fresh.batch_exists(keys) == 1
        assert fresh.link.counters["pulled"] == 1 and fresh.link.counters["pull_failed"] == 1
        assert fresh.batch_get_v1(keys, sh.page_indices([0, 5, 2])) == [True, False, False]
        assert torch.equal(pool.tokens(0), want[0]) and torch.isnan(pool.tokens(5 * sh.P)).all()
    finally:
        close_shared()


SLOW_S = 3.0


class SlowStore(NodeStoreActor):
    """A real node store whose exports take ``SLOW_S`` longer (a slow holder; this test only)."""

    def export(self, wire):
        time.sleep(SLOW_S)
        return super().export(wire)


def test_the_ec_scheduler_never_waits_on_a_slow_pull(cluster):
    """An encoder output held only by a slow holder: vLLM's scheduler asks
    ``ensure_cache_available`` (``False``: defer the request) and ``has_cache_item`` (``False``)
    and both return at once while the pull runs; once it landed, both say ``True`` and the worker
    loads the same bytes."""
    from vllm.config import DeviceConfig, ECTransferConfig, ParallelConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from mmtier import TieredKVCache
    from mmtier.engines.connector_cache import close_shared

    base, nodes, _address = cluster
    fields = with_embeddings(cache_fields(base / "ec-slow"))
    ec = ECTransferConfig(ec_connector="MMTierECConnector", ec_role="ec_both",
                          ec_connector_module_path="mmtier.engines.vllm.ec",
                          ec_connector_extra_config={"mmtier_cache": fields, "mmtier_tenant": "acme",
                                                     "mmtier_cluster": CLUSTER})
    cfg = VllmConfig(ec_transfer_config=ec, device_config=DeviceConfig(device="cpu"))
    cfg.parallel_config = ParallelConfig(distributed_executor_backend="uni")   # one process, as vLLM
    sched, worker = (ECConnectorFactory.create_connector(cfg, r) for r in (ECConnectorRole.SCHEDULER,
                                                                           ECConnectorRole.WORKER))
    assert not sched.split                     # on a GPU: the scheduler pulls the item itself
    try:
        from tests.support.vllm_harness import image_inputs

        item = f"img-slow-{os.urandom(4).hex()}"
        mm = [MultiModalFeatureSpec(data=image_inputs(item), modality="image", identifier=item,
                                    mm_position=PlaceholderRange(offset=2, length=16))]
        req = Request("slow-1", [1] * 20, SamplingParams(max_tokens=1), None, mm_features=mm)
        key, x = sched.item_key(req, mm[0]), torch.randn(16, EMBED_WIDTH)    # keyed by the pixels
        cluster_cfg = sched.cache.cfg.model_copy(update={"disk_dir": None, "host_bytes": 1 << 20})
        with TieredKVCache(cluster_cfg) as elsewhere:           # the item, computed elsewhere
            elsewhere.put_embedding(key, x)
            meta, buf = elsewhere.export_pages(key).to_wire()
        name = f"mmtier-slow-store:{os.urandom(3).hex()}"
        slow = ray.remote(SlowStore).options(
            name=name, namespace=SETTINGS.namespace, max_concurrency=4, num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes["node_b"], soft=False),
        ).remote(cluster_cfg.model_dump(mode="json"), name, nodes["node_b"], SETTINGS.model_dump(mode="json"))
        held, _ = ray.get(slow.import_group.remote(key.to_wire(), meta, buf), timeout=60)
        RegistryShards(SETTINGS).add(name, [held], ray.get(slow.ping.remote(), timeout=30)).get(30)

        t0 = time.monotonic()
        ready = sched.ensure_cache_available(req, 0)
        has = sched.has_cache_item(item)
        again = sched.ensure_cache_available(req, 0)      # a later step, the pull still running
        took = time.monotonic() - t0
        assert (ready, has, again) == (False, False, False)
        assert took < SLOW_S / 3, took
        assert sched.link._inflight                       # the pull is still running
        sched.link.wait()
        assert sched.ensure_cache_available(req, 0) and sched.has_cache_item(item), dict(sched.link.counters)
        assert sched.link.counters["pulled"] == 1 and sched.cache.holds([key]) == [True]
        sched.update_state_after_alloc(req, 0)
        worker.bind_connector_metadata(sched.build_connector_meta(None))
        encoder_cache: dict[str, torch.Tensor] = {}
        worker.start_load_caches(encoder_cache)
        worker.clear_connector_metadata()
        assert torch.equal(encoder_cache[item], x)
        sched.request_finished(req)
        assert not sched._waits
        ray.kill(slow, no_restart=True)
    finally:
        close_shared()


@pytest.mark.parametrize(("change", "field"), [
    ({"model": "another"}, "model"), ({"key_secret": "f" * 64}, "key_secret"),
    ({"modalities": {"text": {"page_size": 16}}}, "modalities.text"),
    ({"cluster": {"namespace": "no-mmtier-here"}}, "mmtier_cluster.namespace")])
def test_an_engine_that_cannot_share_is_refused_at_construction(cluster, tmp_path, change, field):
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not importable: run ./run engines")
    from mmtier.engines.connector_cache import close_shared
    from mmtier.errors import ConfigError
    from tests.support import sglang_harness as sh

    change = dict(change)
    where = {**CLUSTER, **change.pop("cluster", {})}
    with pytest.raises(ConfigError) as err:
        sh.backend_for({**cache_fields(tmp_path), **change}, mmtier_cluster=where)
    assert err.value.fields == (field,)
    close_shared()
