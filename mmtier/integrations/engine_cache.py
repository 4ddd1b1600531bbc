"""The cache an engine process embeds: one ``TieredKVCache`` per configuration per process.

vLLM builds a scheduler-side and a worker-side connector (and SGLang one backend per rank);
where they share a process they must share one cache, so that what a worker saved is what the
scheduler finds. Engines pass their connector's extra config here:

    {"mmtier_config": "configs/llava-1.5-7b.yaml"}          # a CacheConfig YAML, or
    {"mmtier_cache": {...CacheConfig fields...}}            # the same fields inline
    "mmtier_tenant": "acme"                                 # optional, the server-side tenant
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

from ..cache import TieredKVCache
from ..config import CacheConfig
from ..errors import ConfigError

_LOCK = threading.Lock()
_CACHES: dict[str, TieredKVCache] = {}


def config_from_extra(extra: Mapping[str, Any] | None) -> CacheConfig:
    """The ``CacheConfig`` named by an engine's extra config (exactly one of the two fields)."""
    extra = dict(extra or {})
    path, inline = extra.get("mmtier_config"), extra.get("mmtier_cache")
    if (path is None) == (inline is None):
        raise ConfigError("set exactly one of mmtier_config (a YAML path) or mmtier_cache (fields)",
                          ("mmtier_config", "mmtier_cache"))
    if path is not None:
        return CacheConfig.from_yaml(path)
    if isinstance(inline, CacheConfig):
        return inline
    if not isinstance(inline, Mapping):
        raise ConfigError(f"mmtier_cache must be a mapping, got {type(inline).__name__}", ("mmtier_cache",))
    return CacheConfig(**inline)


def tenant_from_extra(extra: Mapping[str, Any] | None) -> str | None:
    tenant = (extra or {}).get("mmtier_tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise ConfigError("mmtier_tenant must be a non-empty string", ("mmtier_tenant",))
    return tenant


def shared_cache(cfg: CacheConfig) -> TieredKVCache:
    """This process's cache for ``cfg``, opened on first use (a warm restart over its disk_dir)."""
    name = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    with _LOCK:
        cache = _CACHES.get(name)
        if cache is None or cache._closed:
            cache = _CACHES[name] = TieredKVCache(cfg)
        return cache


def close_shared() -> None:
    """Close every cache this process opened through ``shared_cache`` (tests, shutdown)."""
    with _LOCK:
        caches = list(_CACHES.values())
        _CACHES.clear()
    for cache in caches:
        cache.close()
