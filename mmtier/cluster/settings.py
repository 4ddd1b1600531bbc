"""Cluster-level settings of the Ray layer (apart from ``CacheConfig``, which is per cache)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ClusterSettings(BaseModel):
    """How the Ray layer names, places, times out and copies. Frozen; ``extra="forbid"``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = Field("mmtier", min_length=1, description="Ray namespace of every mmtier actor.")
    registry_name: str = Field("mmtier-registry", min_length=1, description="Name of the ContentRegistry actor.")
    registry_shards: int = Field(
        2, ge=1, description="Registry actors the content index is split over (registry_placement; shard 0 is "
                             "registry_name, shard i registry_name:shard<i>); 2: the most that helped "
                             "on the 2-core machine (benchmarks/results/registry_scale.json).")
    registry_placement: Literal["chain", "key"] = Field(
        "chain", description="What picks a key's registry shard: 'chain', the placement its client sends beside "
                             "it (its chain root's: every key of a prompt's chain on one shard, one call a "
                             "request); 'key', its digest (a request's keys spread over the shards). See "
                             "docs/design.md and benchmarks/results/registry_scale.json.")
    registry_cache_s: float = Field(
        0.0, ge=0, description="Seconds a client trusts a location a lookup found (0: ask every time). A stale "
                               "one costs a miss, never a wrong hit: the holder exports only the exact key.")
    device_resource: str = Field(
        "GPU", min_length=1,
        description="Node resource counted as devices. 'GPU': see gpu_pools; any other name (tests: a "
                    "custom resource) gives one CPU PagePoolActor per unit, claiming it.")
    gpu_pools: Literal["engines", "actors"] = Field(
        "engines",
        description="Who holds a GPU's pool. 'engines' (the serving layout): mmtier start leaves every GPU "
                    "to the engine that runs there and embeds its pool (a PoolHost: the Serve app's "
                    "worker, ChatEngine); 'actors': a model-less PagePoolActor claims each GPU "
                    "(num_gpus=1; a cache-only cluster, no model on those GPUs).")
    cpu_pool_bytes: int = Field(
        64 << 20, gt=0, description="Arena bytes of a CPU pool (nodes without devices, or non-GPU device resources).")
    store_bytes: int = Field(
        64 << 20, gt=0, description="Host bytes of a NodeStoreActor when the config has no host tier (host_bytes=0).")
    actor_num_cpus: float = Field(0.0, ge=0, description="CPUs each pool / store / registry actor reserves.")
    pool_concurrency: int = Field(
        4, ge=2, description="Threads per pool and store actor, so ping and inventory answer during attention.")
    pool_max_restarts: int = Field(
        0, ge=-1, description="Restarts of pool and store actors; a restarted one starts empty and re-registers.")
    call_timeout_s: float = Field(30.0, gt=0, description="Upper bound of every wait on an actor call.")
    start_timeout_s: float = Field(120.0, gt=0, description="Wait for newly created actors to answer a ping.")
    lease_ttl_s: float = Field(30.0, gt=0, description="TTL of a put claim (lease) in the registry.")
    sweep_interval_s: float = Field(2.0, gt=0, description="Seconds between the registry's liveness sweeps.")
    ping_timeout_s: float = Field(2.0, gt=0, description="A holder that does not answer a ping within this misses once.")
    sweep_misses: int = Field(
        2, ge=1, description="Consecutive missed pings after which a holder's entries leave the registry "
                             "(a dead actor leaves at once).")
    copy_after_remote_uses: int = Field(
        3, ge=0,
        description="Transfer rule: a group held only on another pool is attended remotely (partial attention "
                    "where it lives) for the first N-1 attaches from a pool; the N-th attach copies it to that "
                    "pool through the object store. 1: always copy; 0: never copy.")
