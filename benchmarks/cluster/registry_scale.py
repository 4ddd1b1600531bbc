"""Registry lookups vs shards and client processes (``python -m benchmarks.cluster.registry_scale [--quick]``).

On a fresh local Ray (loopback): for each shard count (1, 2, 4, 8) the registry's shards are
created (``ContentRegistryActor``, as ``start()`` makes them) and filled with ``KEYS`` groups at
one holder; then 1, 2 and 4 client processes (Ray actors, each its own process, each with its
own ``RegistryShards`` router, as an engine has) look keys up at once for ``CELL_S`` seconds:

- ``single``: one key per call (an engine's miss of one group), back to back;
- ``batched``: ``BATCH`` keys per call (a scheduler step's misses), one call per shard concerned,
  sent at once and awaited together;
- ``requests_chain`` / ``requests_key``: one request's keys per lookup, with the registry placed
  by chain (``registry_placement="chain"``, the default) or by key hash: a prompt's chain of
  ``CHAIN_LEN`` blocks (each key derived from the one before, as the engines derive them) and, in
  ``MEDIA_SHARE`` of the requests, one shared media group (a content key, a root of its own).
  Per cell also the calls a request made (``calls_per_request``).

``--ab N``: only the requests, 4 and 8 shards, 2 clients, chain and key cells alternated ``N``
times (both placements' shards up at once, so the machine's load moves over both alike); their
medians go to ``registry_scale_ab.json``.

Per cell: calls/s and keys/s (and requests/s) summed over the clients, the p50 and p99 of one call's latency as
the clients saw it, and the machine's 1-minute load before and after. The model
(``registry_model``) is calibrated from this file: ``single_lookups_per_s`` (one client, one
shard, one key a call) and ``batched_lookups_per_s`` (4 clients, one shard, ``batch_keys`` a call). No client cache
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
from mmtier.content import KeyMaker, split_address, tenant_salt  # noqa: E402

KEYS = 20000
BATCH = 1000
SHARDS = (1, 2, 4, 8)
CLIENTS = (1, 2, 4)
CHAINS = 600                # distinct prompts the clients draw requests from
CHAIN_LEN = (8, 52)         # blocks a prompt's chain (uniform: mean 30, the Mooncake trace's 30.5)
MEDIA = 100                 # shared media groups (content keys)
MEDIA_SHARE = 0.3           # requests that carry one of them
CFG = CacheConfig(model="bench-registry", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32",
                  modalities={"vision": ModalitySpec(page_size=16)}, device="cpu", device_bytes=1 << 20,
                  key_secret="bench")


def _settings(shards: int, placement: str = "chain") -> ClusterSettings:
    # the holder is a name with no actor: no sweep in the run, or it would drop it
    return ClusterSettings(registry_name=f"bench-registry-{shards}-{placement}", registry_shards=shards,
                           registry_placement=placement, sweep_interval_s=3600.0, call_timeout_s=60.0)


def _requests(rng: random.Random) -> tuple[list[list[str]], list[str]]:
    """Realistic requests' keys (a derived chain, sometimes a shared media root) and every key."""
    maker, salt = KeyMaker(CFG.model, CFG.key_secret), tenant_salt(CFG.key_secret, "bench")
    layout = CFG.spec("vision").layout_fields()
    media = [maker.derive(modality="vision", layout=layout, media=rng.randbytes(32), tenant_salt=salt).address
             for _ in range(MEDIA)]
    requests = []
    for _ in range(CHAINS):
        parent, keys = None, []
        for _ in range(rng.randint(*CHAIN_LEN)):
            parent = maker.derive(modality="vision", layout=layout, media=rng.randbytes(32), tenant_salt=salt,
                                  parent=parent)
            keys.append(parent.address)         # digest@placement: what a client asks with
        requests.append(keys + ([rng.choice(media)] if rng.random() < MEDIA_SHARE else []))
    return requests, media + [k for r in requests for k in r if k not in media]


@ray.remote(num_cpus=0)
class _Client:
    """One client process: its own router, lookups back to back for ``seconds``."""

    def __init__(self, digests: list[str], requests: list[list[str]]):
        self.digests, self.requests = digests, requests

    def run_requests(self, settings_json: dict, seconds: float, seed: int) -> tuple[int, int, list[float], int]:
        """One request's keys per lookup: (requests, keys, latencies, calls made)."""
        router = RegistryShards(ClusterSettings(**settings_json))
        rng = random.Random(seed)
        lat: list[float] = []
        keys = calls = 0
        end = time.perf_counter() + seconds
        while True:
            ask = rng.choice(self.requests)
            t0 = time.perf_counter()
            pending = router.lookup(ask)
            locs = pending.get(60)
            t1 = time.perf_counter()
            if any(loc is None for loc in locs):
                raise RuntimeError("a benchmark key missed")
            lat.append(t1 - t0)
            keys += len(ask)
            calls += len(pending.refs)
            if t1 >= end:
                return len(lat), keys, lat, calls

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


def _wire(address: str) -> dict[str, str]:
    """An item's key as a holder reports it: its digest and, beside it, its placement."""
    digest, place = split_address(address)
    return {"digest": digest, "modality": "vision", **({"place": place} if place else {})}


def _fill(settings: ClusterSettings, addresses: list[str]) -> list:
    actors = [ray.remote(ContentRegistryActor).options(
        name=shard_name(settings, i), namespace=settings.namespace, max_concurrency=1000, num_cpus=0,
    ).remote(CFG.model_dump(mode="json"), settings.model_dump(mode="json"), i)
        for i in range(settings.registry_shards)]
    router = RegistryShards(settings, actors)
    info = {"name": "bench-holder", "node": "bench", "kind": "store"}
    for i in range(0, len(addresses), 5000):
        items = [{"key": _wire(a), "tier": "host", "num_tokens": 64, "nbytes": 1 << 20}
                 for a in addresses[i:i + 5000]]
        router.add("bench-holder", items, info).get(120)
    return actors


def _cell(clients: list, settings_json: dict, batch: int, cell_s: float) -> dict:
    """One cell: ``clients`` at once for ``cell_s`` (``batch`` 0: one request's keys a lookup)."""
    def go(seconds: float, seed: int) -> list:
        if batch:
            return ray.get([c.run.remote(settings_json, batch, seconds, seed + i) for i, c in enumerate(clients)],
                           timeout=seconds * 10 + 120)
        return ray.get([c.run_requests.remote(settings_json, seconds, seed + i) for i, c in enumerate(clients)],
                       timeout=seconds * 10 + 120)
    go(0.2, 0)                      # a short warm-up (routers resolve their handles, workers import)
    load0 = os.getloadavg()[0]
    got = go(cell_s, 100)
    load1 = os.getloadavg()[0]
    calls = sum(g[0] for g in got)
    keys = sum(g[1] for g in got)
    lat = np.array([x for g in got for x in g[2]])
    wall = max(float(np.sum(g[2])) for g in got)
    row = {"calls_per_s": calls / wall, "keys_per_s": keys / wall,
           "p50_ms": float(np.percentile(lat, 50)) * 1e3, "p99_ms": float(np.percentile(lat, 99)) * 1e3,
           "load_before": load0, "load_after": load1}
    if not batch:               # a lookup is a request; its calls are the shards it reached
        shard_calls = sum(g[3] for g in got)
        row.update(requests_per_s=calls / wall, calls_per_request=shard_calls / calls,
                   calls_per_s=shard_calls / wall)
    return row


def _ab(reps: int, cell_s: float, out) -> dict:
    """Chain vs key placement, cells alternated ``reps`` times (the load moves over both alike)."""
    requests, request_keys = _requests(random.Random(0))
    figures: dict[str, object] = {"reps": reps, "cell_s": cell_s, "clients": 2,
                                  "cpu_load_avg_1min_start": os.getloadavg()[0]}
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="mmtier-bench",
             object_store_memory=200 << 20, log_to_driver=False)
    try:
        clients = [_Client.remote([], requests) for _ in range(2)]
        ray.get([c.__ray_ready__.remote() for c in clients], timeout=120)
        for shards in (4, 8):
            sets = {p: _settings(shards, p) for p in ("chain", "key")}
            actors = [a for st in sets.values() for a in _fill(st, request_keys)]
            got: dict[str, list[dict]] = {"chain": [], "key": []}
            for _ in range(reps):
                for p, st in sets.items():
                    got[p].append(_cell(clients, st.model_dump(mode="json"), 0, cell_s))
            for p, rows in got.items():
                for f in ("requests_per_s", "calls_per_request", "p99_ms"):
                    vals = [r[f] for r in rows]
                    figures[f"ab_s{shards}_{p}_{f}"] = float(np.median(vals))
                    figures[f"ab_s{shards}_{p}_{f}_min"] = float(min(vals))
                    figures[f"ab_s{shards}_{p}_{f}_max"] = float(max(vals))
                figures[f"ab_s{shards}_{p}_load"] = ",".join(f"{r['load_before']:.1f}" for r in rows)
            figures[f"ab_s{shards}_chain_over_key_requests"] = (
                figures[f"ab_s{shards}_chain_requests_per_s"] / figures[f"ab_s{shards}_key_requests_per_s"])
            print(f"shards={shards}: chain {figures[f'ab_s{shards}_chain_requests_per_s']:,.0f} req/s, "
                  f"key {figures[f'ab_s{shards}_key_requests_per_s']:,.0f} req/s (medians of {reps})", flush=True)
            for a in actors:
                ray.kill(a, no_restart=True)
    finally:
        ray.shutdown()
    figures["cpu_load_avg_1min_end"] = os.getloadavg()[0]
    path = write_results("registry_scale_ab", figures, out)
    print(f"wrote {path}")
    return figures


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 s cells, shards 1 and 2, 1 and 2 clients")
    ap.add_argument("--cell-s", type=float, default=3.0, help="seconds per cell")
    ap.add_argument("--ab", type=int, default=0, help="only chain vs key alternated this many times")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if args.ab:
        return _ab(args.ab, args.cell_s, args.out)
    shards_list, clients_list = ((1, 2), (1, 2)) if args.quick else (SHARDS, CLIENTS)
    cell_s = 1.0 if args.quick else args.cell_s
    rng = random.Random(0)
    digests = [rng.randbytes(32).hex() for _ in range(KEYS)]
    requests, request_keys = _requests(rng)
    figures: dict[str, object] = {"quick": args.quick, "cell_s": cell_s, "keys": KEYS, "batch": BATCH, "batch_keys": BATCH,
                                  "chains": CHAINS, "chain_len": f"{CHAIN_LEN[0]}-{CHAIN_LEN[1]}", "media": MEDIA,
                                  "media_share": MEDIA_SHARE,
                                  "request_keys_mean": float(np.mean([len(r) for r in requests])),
                                  "cpu_load_avg_1min_start": os.getloadavg()[0]}
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="mmtier-bench",
             object_store_memory=200 << 20, log_to_driver=False)
    try:
        clients = [_Client.remote(digests, requests) for _ in range(max(clients_list))]
        ray.get([c.__ray_ready__.remote() for c in clients], timeout=120)
        for shards in shards_list:
            for placement in ("chain", "key"):
                settings = _settings(shards, placement)
                sj = settings.model_dump(mode="json")
                # random digests place alike either way: the per-key modes run once per shard count
                actors = _fill(settings, request_keys + (digests if placement == "chain" else []))
                modes = (("single", 1), ("batched", BATCH), ("requests_chain", 0)) if placement == "chain" \
                    else (("requests_key", 0),)
                for mode, batch in modes:
                    for n in clients_list:
                        row = _cell(clients[:n], sj, batch, cell_s)
                        figures.update({f"{mode}_s{shards}_c{n}_{k}": v for k, v in row.items()})
                        print(f"{mode:14s} shards={shards} clients={n}: {row['calls_per_s']:9,.0f} calls/s "
                              f"{row['keys_per_s']:11,.0f} keys/s {row.get('requests_per_s', 0):7,.0f} req/s "
                              f"{row.get('calls_per_request', 0):5.2f} calls/req  p50 {row['p50_ms']:.2f} ms  "
                              f"p99 {row['p99_ms']:.2f} ms  load {row['load_before']:.2f}->{row['load_after']:.2f}",
                              flush=True)
                for a in actors:
                    ray.kill(a, no_restart=True)
        # the model's calibration (registry_model): one shard's sequential single-key round trip
        # and its pipelined rate of BATCH-key calls from 4 clients
        figures["single_lookups_per_s"] = figures.get("single_s1_c1_calls_per_s")
        figures["batched_lookups_per_s"] = figures.get(f"batched_s1_c{max(clients_list)}_keys_per_s")
    finally:
        ray.shutdown()
    figures["cpu_load_avg_1min_end"] = os.getloadavg()[0]
    path = write_results("registry_scale", figures, args.out)
    print(f"\nwrote {path}")
    return figures


if __name__ == "__main__":
    main()
