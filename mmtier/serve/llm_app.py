"""Start and stop a Ray Serve LLM application (``ray.serve.llm:build_openai_app``, vLLM engines
with mmtier's connectors) from a Serve config file: what ``mmtier serve`` and ``./run serve`` run,
and what a Python caller (the demo, the tests) uses::

    from .llm_app import start_llm_app, stop_llm_app
    app = start_llm_app("configs/serve-llm-cpu.yaml", port=8000)   # a fresh local Ray on 127.0.0.1
    ...  # openai.OpenAI(base_url=app.base_url, api_key="sk-local-acme")
    stop_llm_app(app)

``start_llm_app``: joins Ray at ``address`` (``"local"``: a fresh local Ray on 127.0.0.1, ended
again by ``stop_llm_app``), builds what the config names first (``model_source:
mmtier://tiny-llava``: the tiny random-weight LLaVA, ``tiny_models.ensure_tiny_llava``; the
audio and video ones of ``TINY_MODELS`` alike), starts
mmtier's cluster when the engines' connector config names one (``mmtier_cluster``: the same
``actors.start`` as ``mmtier start``), deploys every application with Serve's HTTP proxy on
``host:port``, and returns once ``GET /v1/models`` answers.

Ray and Ray Serve LLM are imported inside the functions; vLLM only where Ray Serve LLM builds
the app (the engines environment)."""

from __future__ import annotations

import copy
import importlib
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError

TINY_LLAVA = "mmtier://tiny-llava"
TINY_QWEN2_AUDIO = "mmtier://tiny-qwen2-audio"
TINY_QWEN2_VL = "mmtier://tiny-qwen2-vl"
# model_source -> (module, builder) of the tiny random-weight models a config may name
TINY_MODELS = {TINY_LLAVA: (".tiny_models", "ensure_tiny_llava"),
               TINY_QWEN2_AUDIO: (".tiny_audio", "ensure_tiny_qwen2_audio"),
               TINY_QWEN2_VL: (".tiny_video", "ensure_tiny_qwen2_vl")}
LLM_IMPORT = "ray.serve.llm"


@dataclass
class LLMApp:
    """A running application: where it answers and what to stop."""

    base_url: str                         # http://host:port/v1
    names: list[str]
    models: list[str]                     # the served model ids
    started_ray: bool                     # this process started Ray (stop_llm_app ends it)
    config: dict[str, Any] = field(repr=False, default_factory=dict)


def load_serve_config(config: str | Path | dict) -> dict[str, Any]:
    """A Serve config (``applications``, ``http_options``) from a file or a mapping (copied)."""
    if isinstance(config, dict):
        doc = copy.deepcopy(config)
    else:
        try:
            doc = yaml.safe_load(Path(config).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read {config}: {exc}") from None
    if not isinstance(doc, dict) or not doc.get("applications"):
        raise ConfigError(f"{config if not isinstance(config, dict) else 'the config'}: a Serve config needs "
                          "an 'applications' list", ("applications",))
    return doc


def is_serve_llm(doc: dict[str, Any]) -> bool:
    """Whether a Serve config's applications are Ray Serve LLM ones."""
    return any(str(a.get("import_path", "")).startswith(LLM_IMPORT) for a in doc.get("applications") or [])


def llm_configs(args: dict[str, Any]) -> list[Any]:
    """An application's LLM configs: ``build_openai_app``'s ``llm_configs``, or
    ``build_pd_openai_app``'s ``prefill_config`` and ``decode_config`` (P/D: prefill and decode
    on different engines, mmtier carrying the KV, ``mmtier.engines.vllm.pd``)."""
    return [*(args.get("llm_configs") or []),
            *(args[k] for k in ("prefill_config", "decode_config") if args.get(k) is not None)]


def resolve_models(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with every ``model_source: mmtier://tiny-llava`` (or ``mmtier://tiny-qwen2-audio``,
    ``mmtier://tiny-qwen2-vl``: ``TINY_MODELS``) replaced by the built model's path."""
    for app in doc["applications"]:
        for llm in llm_configs(app.get("args") or {}):
            loading = llm.get("model_loading_config") if isinstance(llm, dict) else None
            tiny = TINY_MODELS.get(loading.get("model_source")) if isinstance(loading, dict) else None
            if tiny is not None:
                module, builder = tiny
                loading["model_source"] = str(getattr(importlib.import_module(module, __package__), builder)())
    return doc


def start_llm_app(config: str | Path | dict, *, port: int | None = None, host: str | None = None,
                  address: str = "local", ready_timeout_s: float = 900.0) -> LLMApp:
    """Deploy the config's applications and return once ``GET /v1/models`` answers."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")    # Ray binds 127.0.0.1 locally
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    doc = resolve_models(load_serve_config(config))
    http = dict(doc.get("http_options") or {})
    http["host"] = host or http.get("host", "127.0.0.1")
    http["port"] = int(port if port is not None else http.get("port", 8000))
    started = False
    if not ray.is_initialized():
        kw = {"_node_ip_address": "127.0.0.1", "include_dashboard": False} if address == "local" else {}
        ray.init(address=address, namespace="mmtier", log_to_driver=False, **kw)
        started = True
    try:
        _start_cluster(doc)
        serve.start(http_options=http, proxy_location=doc.get("proxy_location", "EveryNode"))
        names, models = [], []
        for app in doc["applications"]:
            module, _, attr = str(app["import_path"]).partition(":")
            builder = getattr(importlib.import_module(module), attr)
            args = app.get("args") or {}
            name = app.get("name", "default")
            serve.run(builder(args), name=name, route_prefix=app.get("route_prefix", "/"), blocking=False)
            names.append(name)
            models += list(dict.fromkeys(m["model_loading_config"]["model_id"] for m in llm_configs(args)
                                         if isinstance(m, dict)))    # P/D: one model id, two engines
        base = f"http://{http['host']}:{http['port']}/v1"
        wait_ready(base, ready_timeout_s)
    except BaseException:
        _shutdown(started)
        raise
    return LLMApp(base, names, models, started, doc)


def stop_llm_app(app: LLMApp) -> None:
    """Delete the applications and Serve; end Ray where ``start_llm_app`` started it."""
    from ray import serve

    for name in app.names:
        try:
            serve.delete(name)
        except Exception:                 # already gone: shutting down is what is asked
            pass
    _shutdown(app.started_ray)


def wait_ready(base_url: str, timeout_s: float) -> None:
    """Until ``GET /v1/models`` answers (200, or 401 from an ingress that wants a key)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base_url + "/models", timeout=10) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                return
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(1.0)
    raise TimeoutError(f"{base_url}/models did not answer within {timeout_s:.0f} s ({last})")


def _start_cluster(doc: dict[str, Any]) -> None:
    """mmtier's actors (what ``mmtier start`` creates), when an LLM config's connectors name
    ``mmtier_cluster``: the cache its engines embed, with the key secret from
    ``MMTIER_KEY_SECRET`` (the public default only where the ingress allows it). Each such
    ``mmtier_cluster`` without an ``address`` gets this Ray's GCS address, so the engines'
    processes join this cluster and no other (``ray.init("auto")`` could find another one)."""
    import ray

    from ..config import KEY_SECRET_ENV, CacheConfig, require_key_secret
    from ..engines.connector_cache import cluster_from_extra, config_from_extra

    started = False
    for app in doc["applications"]:
        args = app.get("args") or {}
        ingress = ((args.get("ingress_cls_config") or {}).get("ingress_extra_kwargs") or {})
        for llm in llm_configs(args):
            kwargs = (llm.get("engine_kwargs") or {}) if isinstance(llm, dict) else {}
            extras = [(kwargs.get(k) or {}).get(f"{p}_connector_extra_config")
                      for k, p in (("kv_transfer_config", "kv"), ("ec_transfer_config", "ec"))]
            for extra in extras:
                if isinstance(extra, dict) and isinstance(extra.get("mmtier_cluster"), dict):
                    extra["mmtier_cluster"].setdefault("address", ray.get_runtime_context().gcs_address)
            extra = extras[0]
            cluster = cluster_from_extra(extra) if isinstance(extra, dict) else None
            if cluster is None or started:
                continue
            from .. import cluster as mmtier_cluster

            cfg = config_from_extra(extra)
            if os.environ.get(KEY_SECRET_ENV):
                cfg = CacheConfig(**{**cfg.model_dump(), "key_secret": os.environ[KEY_SECRET_ENV]})
            require_key_secret(cfg, bool(ingress.get("allow_default_key_secret")), f"set {KEY_SECRET_ENV}")
            mmtier_cluster.start(cfg, cluster[0])
            started = True


def _shutdown(started_ray: bool) -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        if started_ray:
            ray.shutdown()
