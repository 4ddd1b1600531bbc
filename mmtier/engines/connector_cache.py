"""The cache an engine process embeds: one ``TieredKVCache`` per configuration per process.

vLLM builds a scheduler-side and a worker-side connector (and SGLang one backend per rank);
where they share a process they must share one cache, so that what a worker saved is what the
scheduler finds. Engines pass their connector's extra config here:

    {}                                                      # nothing: vLLM's connectors read
                                                            # the shape from the engine
                                                            # (``vllm.shape``), sizes default
    {"mmtier_host_bytes": "8GiB", "mmtier_disk_dir": "/nvme/mmtier"}   # flat sizes (or MMTIER_*)
    {"mmtier_config": "configs/llava-1.5-7b.yaml"}          # a CacheConfig YAML, or
    {"mmtier_cache": {...CacheConfig fields...}}            # the same fields inline (only sizes
                                                            # where an engine gives the shape)
    "mmtier_tenant": "acme"                                 # optional, the server-side tenant
    "mmtier_cluster": {"namespace": "mmtier", ...}          # optional: join the running cluster

``mmtier_cluster`` (or the environment variable ``MMTIER_CLUSTER``, the same mapping as JSON;
the extra config wins) makes the process's cache join the cluster that ``mmtier start`` runs:
its fields are ``ClusterSettings``'s plus ``address`` (the Ray address when the process is not
connected yet; default ``RAY_ADDRESS``, else ``"auto"``). ``open_shared`` then joins it
(``engine_link.join``: the cluster's key secret, the same model and layouts) and gives the
cache one ``EngineLink``: saved groups are written through to the node's store and published,
misses are looked up in the registry and pulled. Without it nothing here imports Ray.

Each connector that opened a cache gives it back when its engine shuts down
(``release_shared``; vLLM calls the connectors' ``shutdown`` as its workers stop). When the
last one has, a cache with a disk tier closes, which writes what its device and host tiers
still hold to disk (``persist_on_close``): an engine restarted over the same ``disk_dir``
finds what this one held. (Not at interpreter exit: Python then refuses new work to the
threads the disk tier writes with.) vLLM's own shutdown kills its workers without calling the
connectors' ``shutdown``, and a crash calls nothing: there the cache's write-behind
(``tiers.durability``) has already written every saved group, up to its lag. A cache without one stays open for a later engine of the
same process, as closing it would only lose what it holds.

``report_for`` gives each cache one ``StatsReport``: the connectors export its statistics
through their engine's metrics (vLLM: ``vllm.metrics``, on vLLM's own ``/metrics``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from ..cache import TieredKVCache
from ..config import CacheConfig
from ..errors import ConfigError
from ..stats.report import StatsReport
from .vllm.shape import EngineShape, cache_config

if TYPE_CHECKING:
    from ..cluster.link import EngineLink
    from ..cluster.settings import ClusterSettings

CLUSTER_ENV = "MMTIER_CLUSTER"

_LOCK = threading.Lock()
_CACHES: dict[str, TieredKVCache] = {}
_LINKS: dict[int, EngineLink] = {}          # id(cache) -> its link
_REPORTS: dict[int, StatsReport] = {}       # id(cache) -> the one report of its stats
_USERS: dict[int, int] = {}                 # id(cache) -> connectors that hold it open


def user_fields(extra: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The cache fields an engine's extra config gives (``mmtier_config``'s YAML or the
    ``mmtier_cache`` mapping; at most one of them), as given; ``None`` when neither is set."""
    extra = dict(extra or {})
    path, inline = extra.get("mmtier_config"), extra.get("mmtier_cache")
    if path is not None and inline is not None:
        raise ConfigError("set at most one of mmtier_config (a YAML path) or mmtier_cache (fields)",
                          ("mmtier_config", "mmtier_cache"))
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}", ("mmtier_config",)) from None
        if isinstance(data, dict) and "cache" in data and "model" not in data:
            data = data["cache"]
        if not isinstance(data, dict):
            raise ConfigError(f"config {path} must be a mapping", ("mmtier_config",))
        return data
    if inline is None:
        return None
    if isinstance(inline, CacheConfig):
        return inline.model_dump()
    if not isinstance(inline, Mapping):
        raise ConfigError(f"mmtier_cache must be a mapping, got {type(inline).__name__}", ("mmtier_cache",))
    return dict(inline)


def config_from_extra(extra: Mapping[str, Any] | None, engine: EngineShape | None = None) -> CacheConfig:
    """The ``CacheConfig`` for an engine's extra config: with ``engine`` (the shape a vLLM
    connector read from its engine) the shape comes from there and any given shape is checked
    against it (``vllm.shape.cache_config``); without, the extra config must give a whole config."""
    fields = user_fields(extra)
    if engine is not None:
        return cache_config(fields, extra, engine)
    if fields is None:
        raise ConfigError("set mmtier_config (a YAML path) or mmtier_cache (fields)",
                          ("mmtier_config", "mmtier_cache"))
    return CacheConfig(**fields)


def tenant_from_extra(extra: Mapping[str, Any] | None) -> str | None:
    tenant = (extra or {}).get("mmtier_tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise ConfigError("mmtier_tenant must be a non-empty string", ("mmtier_tenant",))
    return tenant


def cluster_from_extra(extra: Mapping[str, Any] | None) -> tuple[ClusterSettings, str | None] | None:
    """``(settings, address)`` from ``mmtier_cluster`` (or ``$MMTIER_CLUSTER``); ``None`` when
    neither is set (the cache stays the process's own)."""
    raw = (extra or {}).get("mmtier_cluster")
    if raw is None and os.environ.get(CLUSTER_ENV):
        try:
            raw = json.loads(os.environ[CLUSTER_ENV])
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{CLUSTER_ENV} is not JSON: {exc}", (CLUSTER_ENV,)) from None
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"mmtier_cluster must be a mapping, got {type(raw).__name__}", ("mmtier_cluster",))
    fields = dict(raw)
    address = fields.pop("address", None)
    if address is not None and (not isinstance(address, str) or not address):
        raise ConfigError("mmtier_cluster.address must be a non-empty string", ("mmtier_cluster.address",))
    from ..cluster.settings import ClusterSettings  # pydantic only: no Ray import

    try:
        return ClusterSettings(**fields), address
    except ValidationError as exc:
        names = tuple("mmtier_cluster." + ".".join(str(p) for p in e["loc"]) for e in exc.errors())
        raise ConfigError(f"mmtier_cluster: {exc.errors()[0]['msg']}", names) from None


def lookup_only(cfg: CacheConfig) -> CacheConfig:
    """``cfg`` for a process that only makes keys and looks them up (vLLM's scheduler when
    its worker runs in another process): the same model, secret and layouts, so the same keys,
    but a one-page CPU arena and no host or disk tier, so it never allocates device memory nor
    opens the tiers the worker owns (two processes over one ``disk_dir``)."""
    page = max(cfg.spec(name).page_bytes for name in cfg.modalities)
    mods = {name: spec.model_copy(update={"share": None}) for name, spec in cfg.modalities.items()}
    return cfg.model_copy(update={"device": "cpu", "device_bytes": (2 * page + 256) * len(mods),
                                  "host_bytes": 0, "disk_dir": None, "modalities": mods})


def open_shared(extra: Mapping[str, Any] | None, *, lookup: bool = False, engine: EngineShape | None = None
                ) -> tuple[TieredKVCache, EngineLink | None]:
    """This process's cache for an engine's extra config and, when it names a cluster, the
    cache's link to it (one per cache and process: vLLM's connector roles and SGLang's
    backends share both); ``None`` for the link otherwise. ``lookup``: a process that only
    makes and looks up keys (``lookup_only``). ``engine``: the shape of the engine the cache
    serves (``vllm.shape.engine_shape``), which fills and checks the config's."""
    cfg = config_from_extra(extra, engine)
    if lookup:
        cfg = lookup_only(cfg)
    cluster = cluster_from_extra(extra)
    if cluster is None:
        return shared_cache(cfg), None
    from ..cluster.link import EngineLink, join  # Ray, only on this path

    cfg, transport = join(cfg, *cluster)
    cache = shared_cache(cfg)
    with _LOCK:
        link = _LINKS.get(id(cache))
        if link is None or link.cache is not cache:
            link = _LINKS[id(cache)] = EngineLink(cache, transport)
        return cache, link


def shared_cache(cfg: CacheConfig) -> TieredKVCache:
    """This process's cache for ``cfg``, opened on first use (a warm restart over its disk_dir)."""
    name = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    with _LOCK:
        cache = _CACHES.get(name)
        if cache is None or cache.closed:
            cache = _CACHES[name] = TieredKVCache(cfg)
            _USERS[id(cache)] = 0
        _USERS[id(cache)] += 1
        return cache


def release_shared(cache: TieredKVCache) -> bool:
    """A connector of ``cache`` is done with it (its engine shuts down). The last one closes a
    cache that has a disk tier (its groups are written there: ``persist_on_close``) and its
    link; ``True`` when it closed."""
    with _LOCK:
        users = _USERS.get(id(cache), 0) - 1
        if users > 0 or cache.cfg.disk_dir is None or cache.closed:
            _USERS[id(cache)] = max(users, 0)
            return False
        _USERS.pop(id(cache), None)
        for name, held in list(_CACHES.items()):
            if held is cache:
                del _CACHES[name]
        link = _LINKS.pop(id(cache), None)
        _REPORTS.pop(id(cache), None)
    if link is not None:
        link.close()
    cache.close()
    return True


def report_for(cache: TieredKVCache) -> StatsReport:
    """The one ``StatsReport`` of ``cache`` in this process: connectors that share the cache
    (vLLM's scheduler and worker in one process) share it, so each event is reported once."""
    with _LOCK:
        report = _REPORTS.get(id(cache))
        if report is None or report.cache is not cache:
            report = _REPORTS[id(cache)] = StatsReport(cache)
        return report


def open_count() -> int:
    """The caches this process has open through ``shared_cache``."""
    with _LOCK:
        return len(_CACHES)


def open_counters() -> list[dict[str, int]]:
    """The counters of each cache this process has open through ``shared_cache`` (a benchmark
    reads the write-behind's writes, bytes and lag quantiles from outside the engine)."""
    with _LOCK:
        caches = list(_CACHES.values())
    return [dict(cache.stats().counters) for cache in caches]


def close_shared() -> None:
    """Close every cache this process opened through ``shared_cache`` (tests, shutdown)."""
    with _LOCK:
        caches = list(_CACHES.values())
        links = list(_LINKS.values())
        _CACHES.clear()
        _LINKS.clear()
        _REPORTS.clear()
        _USERS.clear()
    for link in links:
        link.close()
    for cache in caches:
        cache.close()
