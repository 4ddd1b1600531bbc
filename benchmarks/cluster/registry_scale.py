"""Registry lookups vs shards and client processes (``python -m benchmarks.cluster.registry_scale [--quick]``).

On a fresh local Ray (loopback): for each shard count (1, 2, 4, 8) the registry's shards are
created (``ContentRegistryActor``, as ``start()`` makes them) and filled with ``KEYS`` groups at
one holder; then 1, 2 and 4 client processes (Ray actors, each its own process, each with its
own ``RegistryShards`` router, as an engine has) look keys up at once for ``CELL_S`` seconds:

- ``single``: one key per call (an engine's miss of one group), back to back;
- ``batched``: ``BATCH`` keys per call (a scheduler step's misses), one call per shard concerned,
  sent at once and awaited together.

Per cell: calls/s and keys/s summed over the clients, the p50 and p99 of one call's latency as
the clients saw it, and the machine's 1-minute load before and after. No client cache
(``registry_cache_s=0``): every lookup reaches a shard. The machine has 2 cores that the shard
actors, the clients and Ray's own processes share: past 2 busy processes more shards only
divide the same cores (see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import ray  # noqa: E402

from benchmarks._common import add_out_arg, write_results  # noqa: E402
from mmtier import CacheConfig, ModalitySpec  # noqa: E402
from mmtier.cluster.actors import ContentRegistryActor  # noqa: E402
from mmtier.cluster.registry_shards import RegistryShards, shard_name  # noqa: E402
from mmtier.cluster.settings import ClusterSettings  # noqa: E402

KEYS = 20000
BATCH = 1000
SHARDS = (1, 2, 4, 8)
CLIENTS = (1, 2, 4)
CFG = CacheConfig(model="bench-registry", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32",
                  modalities={"vision": ModalitySpec(page_size=16)}, device="cpu", device_bytes=1 << 20,
                  key_secret="bench")


def _settings(shards: int) -> ClusterSettings:
    # the holder is a name with no actor: no sweep in the run, or it would drop it
    return ClusterSettings(registry_name=f"bench-registry-{shards}", registry_shards=shards,
                           sweep_interval_s=3600.0, call_timeout_s=60.0)


@ray.remote(num_cpus=0)
class _Client:
    """One client process: its own router, lookups back to back for ``seconds``."""

    def __init__(self, digests: list[str]):
        self.digests = digests

    def run(self, settings_json: dict, batch: int, seconds: float, seed: int) -> tuple[int, int, list[float]]:
        router = RegistryShards(ClusterSettings(**settings_json))
        rng = random.Random(seed)
        n = len(self.digests)
        lat: list[float] = []
        keys = 0
        end = time.perf_counter() + seconds
        while True:
            start = rng.randrange(n - batch + 1)
            ask = self.digests[start:start + batch]
            t0 = time.perf_counter()
            locs = router.lookup(ask).get(60)
            t1 = time.perf_counter()
            if locs[0] is None:
                raise RuntimeError("a benchmark key missed")
            lat.append(t1 - t0)
            keys += len(ask)
            if t1 >= end:
                return len(lat), keys, lat


def _fill(settings: ClusterSettings, digests: list[str]) -> list:
    actors = [ray.remote(ContentRegistryActor).options(
        name=shard_name(settings, i), namespace=settings.namespace, max_concurrency=1000, num_cpus=0,
    ).remote(CFG.model_dump(mode="json"), settings.model_dump(mode="json"), i)
        for i in range(settings.registry_shards)]
    router = RegistryShards(settings, actors)
    info = {"name": "bench-holder", "node": "bench", "kind": "store"}
    for i in range(0, len(digests), 5000):
        items = [{"key": {"digest": d, "modality": "vision"}, "tier": "host", "num_tokens": 64,
                  "nbytes": 1 << 20} for d in digests[i:i + 5000]]
        router.add("bench-holder", items, info).get(120)
    return actors


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 s cells, shards 1 and 2, 1 and 2 clients")
    ap.add_argument("--cell-s", type=float, default=3.0, help="seconds per cell")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    shards_list, clients_list = ((1, 2), (1, 2)) if args.quick else (SHARDS, CLIENTS)
    cell_s = 1.0 if args.quick else args.cell_s
    rng = random.Random(0)
    digests = [rng.randbytes(32).hex() for _ in range(KEYS)]
    figures: dict[str, object] = {"quick": args.quick, "cell_s": cell_s, "keys": KEYS, "batch": BATCH,
                                  "cpu_load_avg_1min_start": os.getloadavg()[0]}
    rows = []
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="mmtier-bench",
             object_store_memory=200 << 20, log_to_driver=False)
    try:
        clients = [_Client.remote(digests) for _ in range(max(clients_list))]
        ray.get([c.__ray_ready__.remote() for c in clients], timeout=120)
        for shards in shards_list:
            settings = _settings(shards)
            actors = _fill(settings, digests)
            for mode, batch in (("single", 1), ("batched", BATCH)):
                for n in clients_list:
                    # a short warm-up (routers resolve their handles, workers import)
                    ray.get([c.run.remote(settings.model_dump(mode="json"), batch, 0.2, i)
                             for i, c in enumerate(clients[:n])], timeout=120)
                    load0 = os.getloadavg()[0]
                    got = ray.get([c.run.remote(settings.model_dump(mode="json"), batch, cell_s, 100 + i)
                                   for i, c in enumerate(clients[:n])], timeout=cell_s * 10 + 120)
                    load1 = os.getloadavg()[0]
                    calls = sum(g[0] for g in got)
                    keys = sum(g[1] for g in got)
                    lat = np.array([x for g in got for x in g[2]])
                    wall = max(float(np.sum(g[2])) for g in got)
                    tag = f"{mode}_s{shards}_c{n}"
                    row = {"calls_per_s": calls / wall, "keys_per_s": keys / wall,
                           "p50_ms": float(np.percentile(lat, 50)) * 1e3,
                           "p99_ms": float(np.percentile(lat, 99)) * 1e3, "load_before": load0, "load_after": load1}
                    figures.update({f"{tag}_{k}": v for k, v in row.items()})
                    rows.append((mode, shards, n, row))
                    print(f"{mode:8s} shards={shards} clients={n}: {row['calls_per_s']:9,.0f} calls/s "
                          f"{row['keys_per_s']:11,.0f} keys/s  p50 {row['p50_ms']:.2f} ms  p99 {row['p99_ms']:.2f} ms  "
                          f"load {load0:.2f}->{load1:.2f}", flush=True)
            for a in actors:
                ray.kill(a, no_restart=True)
    finally:
        ray.shutdown()
    figures["cpu_load_avg_1min_end"] = os.getloadavg()[0]
    path = write_results("registry_scale", figures, args.out)
    print(f"\nwrote {path}")
    return figures


if __name__ == "__main__":
    main()
