"""Which engine the Serve app runs, picked by ``model.kind`` and loaded (``model_api.py`` is its
interface, ``chat_model.py`` the engine behind it), and the cluster's cache built for it.

- ``load_engine``: the engine with its weights on a device (a worker);
- ``load_frontend``: the part of it the ingress needs (processors, no weights, no pool);
- ``engine_cache_config``: the engine's ``CacheConfig`` (its layout: layers, heads, modalities);
- ``app_cache_config``: the cluster's ``CacheConfig`` for a ``ServeAppConfig``: the layout from
  the model, the budgets and the key secret from the app's ``cache`` args.

It sits above the configuration (``config.py``) and the engines: the configuration is data and
imports no engine, so the imports run one way.
"""

from __future__ import annotations

import os
from typing import Any

from ..config import CacheConfig, require_key_secret
from ..errors import ConfigError
from .config import CacheArgs, ModelArgs, ServeAppConfig
from .model_api import Frontend, TurnEngine


def load_engine(model: ModelArgs, device: str = "cpu") -> TurnEngine:
    """The engine of ``model.kind`` with its weights on ``device`` (a worker)."""
    from .chat_model import HFEngine

    return HFEngine.load(model, device)


def load_frontend(model: ModelArgs) -> Frontend:
    """What the ingress needs of the engine: no weights, no pool."""
    from .chat_model import HFFrontend

    return HFFrontend.load(model)


def engine_cache_config(model: ModelArgs, **overrides: Any) -> CacheConfig:
    """The cluster's ``CacheConfig`` for ``model`` (every pool and store of the app uses it)."""
    from .chat_model import hf_cache_config

    return hf_cache_config(model, **overrides)


def cache_args_config(cache: CacheArgs, model: ModelArgs) -> CacheConfig:
    """The cluster's cache for ``model`` (its layout from the model, budgets from ``cache``)."""
    extra: dict[str, Any] = {"device": cache.device, "eviction_policy": cache.eviction_policy}
    secret = os.environ.get(cache.key_secret_env) if cache.key_secret_env else None
    if secret:
        extra["key_secret"] = secret
    elif cache.key_secret_env and not cache.allow_default_key_secret:
        raise ConfigError(f"cache.key_secret_env: environment variable {cache.key_secret_env} "
                          "is not set (it holds the cache's key secret)", ("cache.key_secret_env",))
    cfg = engine_cache_config(model, device_bytes=cache.device_bytes, host_bytes=cache.host_bytes,
                              shares=cache.shares, **extra)
    require_key_secret(cfg, cache.allow_default_key_secret,
                       "set cache.key_secret_env to an environment variable that holds one")
    return cfg


def app_cache_config(app: ServeAppConfig) -> CacheConfig:
    """The cluster's ``CacheConfig`` of the app (``ConfigError`` on the public default key secret
    unless ``cache.allow_default_key_secret``)."""
    return cache_args_config(app.cache, app.model)
