"""The ``mmtier`` command.

- ``mmtier demo [--quick] [--out DIR]``: the main job: interleaved multi-turn multimodal chats
  sent with the openai client to vLLM's OpenAI API server with and without mmtier's connectors
  (prefix caching on in both, a KV pool smaller than the conversations, mmtier's server restarted
  midway), a table per phase, a JSON report and a chart (``--engine transformers``: Qwen2-VL +
  Whisper through mmtier's own chat engine on an embedded local Ray);
- ``mmtier start --config FILE [--address auto] [--allow-default-secret]``: start mmtier on a
  running cluster (the key secret from ``MMTIER_KEY_SECRET`` or the Serve config's
  ``cache.key_secret_env``; the public default only with the flag);
- ``mmtier status [--address auto]``: its actors, tiers and hit ratios, as tables;
- ``mmtier bench [NAME ...] [--quick] [--out DIR]``: the benchmark suite, then ``RESULTS.md``;
- ``mmtier serve --config FILE [--address local] [--port N]``: the Ray Serve application of a
  Serve config: mmtier's (``configs/serve.yaml``) or a Ray Serve LLM one, the OpenAI-compatible
  API over vLLM with mmtier's connectors (``configs/serve-llm-cpu.yaml``, ``serve-llm-vllm.yaml``).

Ray is imported inside the commands, so ``--help`` is quick.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import click

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")    # Ray binds 127.0.0.1 locally
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# the suite's names (each writes NAME.json) and their modules, benchmarks/GROUP/NAME.py
BENCHMARK_MODULES = {"alloc": "benchmarks.pages.alloc", "kernels": "benchmarks.kernels.kernels",
                     "spill": "benchmarks.storage.spill", "eviction": "benchmarks.eviction.eviction",
                     "cluster": "benchmarks.cluster.cluster", "long_context": "benchmarks.kernels.long_context",
                     "multiturn": "benchmarks.cache.multiturn", "hf_generate": "benchmarks.engines.hf_generate",
                     "connector_copy": "benchmarks.engines.connector_copy"}
BENCHMARKS = tuple(BENCHMARK_MODULES)
DEFAULT_OUT = Path("benchmarks") / "results"
DEMO_RUNS = Path("runs")                       # each demo's report, chart and logs (git-ignored)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """mmtier: a tiered, modality-aware, paged KV-cache store for multimodal LLM serving on Ray."""


# ---------------------------------------------------------------------- demo
@main.command()
@click.option("--engine", type=click.Choice(["vllm", "transformers"]), default="vllm", show_default=True,
              help="vllm: the openai client against vLLM's OpenAI API server with and without mmtier's "
                   "connectors (the engines environment); transformers: mmtier's own chat engine actor "
                   "(Qwen2-VL + Whisper).")
@click.option("--quick", is_flag=True, help="A smaller workload with the same checks.")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory of the JSON report, the PNG chart (and, for vllm, the engines' log and requests); "
                   "default runs/demo-<UTC time>/ (git-ignored). The committed figures are refreshed only "
                   "with --out benchmarks/results.")
@click.option("--tenants", type=click.IntRange(1, 16), help="transformers: tenants (default 3; --quick 2).")
@click.option("--conversations", type=click.IntRange(1, 64),
              help="Conversations (vllm: in all, default 10, --quick 4; transformers: per tenant, default 3, --quick 2).")
@click.option("--turns", type=click.IntRange(1, 16), help="Turns per conversation (default 5 / 3 for transformers; --quick 3 / 2).")
@click.option("--seed", type=int, default=0, show_default=True, help="Workload and model seed.")
@click.option("--no-media", is_flag=True, help="vllm: without the audio and video part.")
@click.option("--no-progress", is_flag=True, help="No progress lines.")
def demo(engine: str, quick: bool, out: Path, tenants: int | None, conversations: int | None, turns: int | None,
         seed: int, no_media: bool, no_progress: bool) -> None:
    """Run multi-turn multimodal chats through mmtier on an embedded local Ray.

    vllm (default): interleaved multi-turn conversations (a shared system prompt, images reused
    across turns and conversations, PNG / JPEG data URLs) sent with the openai client to two
    vLLM OpenAI API servers on 127.0.0.1, both with vLLM's prefix cache on and a KV pool smaller
    than the working set: vLLM alone, and vLLM with mmtier's KV and encoder-cache connectors
    (a page pool, host and disk tiers), restarted midway; then audio clips and videos on tiny
    Qwen2-Audio / Qwen2-VL servers the same way; every answer must be equal. Prints per phase
    cached prompt tokens, paired time to first token and encoder runs, and per modality (text,
    image, audio, video) items sent, tower runs and cached tokens; engine logs go to a file.

    transformers: mmtier's own chat engine (a small random-weight Qwen2-VL and Whisper through
    mmtier's adapter, in an engine actor that holds its pool), with audio and video, spills to
    disk and to the node store, checked against DynamicCache recomputing each conversation."""
    kw = {k: v for k, v in {"tenants": tenants, "conversations": conversations, "turns": turns}.items()
          if v is not None}
    out = out if out is not None else demo_run_dir()
    if engine == "vllm":
        from .demo.chart import plot_serving
        from .demo.serving import ServingDemoSpec, format_serving_report, run_serving_demo

        if tenants is not None:
            raise click.UsageError("--tenants applies to --engine transformers (the vLLM demo's conversations "
                                   "share one system prompt and image catalogue)")
        if no_media:
            kw["media"] = None
        spec = ServingDemoSpec.quick(seed=seed, **kw) if quick else ServingDemoSpec(seed=seed, **kw)
        report = run_serving_demo(spec, out, progress=not no_progress)
        json_path = out / "demo_serving.json"
        json_path.write_text(json.dumps(report.figures, indent=1, sort_keys=True, default=str))
        png_path = plot_serving(report, out / "demo_serving.png")
        click.echo(format_serving_report(report, json_path, png_path))
    else:
        from .demo.chat import DemoSpec, run_demo
        from .demo.report import format_report, plot, write_json

        spec = DemoSpec.quick(seed=seed, **kw) if quick else DemoSpec(seed=seed, **kw)
        report = run_demo(spec, progress=not no_progress)
        json_path = write_json(report, out / "demo.json")
        png_path = plot(report, out / "demo.png")
        click.echo(format_report(report, json_path, png_path))
    if not report.passed:
        click.echo("check FAILED: an answer differs from the engine without mmtier", err=True)
        sys.exit(1)


def demo_run_dir(root: Path = DEMO_RUNS) -> Path:
    """A fresh run folder for one demo (``runs/demo-<UTC time>``): a demo never rewrites the
    committed figures unless told to."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path, n = root / f"demo-{stamp}", 1
    while path.exists():
        n += 1
        path = root / f"demo-{stamp}-{n}"
    return path


# ---------------------------------------------------------------------- start / status
def _connect_ray(address: str, namespace: str) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, log_to_driver=False)


def load_start_config(path: Path, allow_default_secret: bool = False):
    """``(CacheConfig, ClusterSettings)`` from a cache preset (``configs/*.yaml``, optionally
    with a ``cluster:`` section of ClusterSettings), from a Serve config whose first
    application is mmtier's (the cache its ``args`` describe: the reference model's), or from a
    Ray Serve LLM config (``ray.serve.llm``: the cache its vLLM engines embed, from the first
    LLM config's ``kv_connector_extra_config``, and its ``mmtier_cluster`` settings), so the
    cluster runs exactly the cache the engines join.

    The key secret: a Serve config's ``cache.key_secret_env``; otherwise the environment
    variable ``MMTIER_KEY_SECRET`` (a secret does not belong in a config file). ``ConfigError``
    when that leaves the public default secret, unless ``allow_default_secret`` (local runs)."""
    import yaml

    from .cluster.settings import ClusterSettings
    from .config import KEY_SECRET_ENV, CacheConfig, require_key_secret
    from .errors import ConfigError

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping")
    llm = [a for a in data.get("applications") or [] if str(a.get("import_path", "")).startswith("ray.serve.llm")]
    if llm:
        cfg, settings = _serve_llm_start_config(llm[0], path)
    elif "applications" in data:
        from .serve.config import ServeAppConfig
        from .serve.engine_loader import app_cache_config

        apps = [a for a in data["applications"] or []
                if str(a.get("import_path", "")).startswith("mmtier.serve")]
        if not apps:
            raise ConfigError(f"{path}: no application with import_path mmtier.serve.app:build_app")
        args = ServeAppConfig.parse(apps[0].get("args") or {})
        if allow_default_secret:
            args = args.model_copy(update={"cache": args.cache.model_copy(update={"allow_default_key_secret": True})})
        return app_cache_config(args), args.settings()
    else:
        settings = ClusterSettings(**(data.pop("cluster", None) or {}))
        cfg = CacheConfig(**dict(data.get("cache", data)))
    if os.environ.get(KEY_SECRET_ENV):
        cfg = CacheConfig(**{**cfg.model_dump(), "key_secret": os.environ[KEY_SECRET_ENV]})
    require_key_secret(cfg, allow_default_secret, f"set {KEY_SECRET_ENV}")
    return cfg, settings


def _serve_llm_start_config(app: dict, path: Path):
    """The cache and cluster settings a Ray Serve LLM application's vLLM engines name."""
    from .cluster.settings import ClusterSettings
    from .engines.connector_cache import cluster_from_extra, config_from_extra
    from .errors import ConfigError
    from .serve.llm_app import llm_configs

    try:
        extra = llm_configs(app["args"])[0]["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]
    except (KeyError, IndexError, TypeError):
        raise ConfigError(f"{path}: the first LLM config has no engine_kwargs.kv_transfer_config."
                          "kv_connector_extra_config naming mmtier's cache") from None
    cluster = cluster_from_extra(extra)
    return config_from_extra(extra), cluster[0] if cluster is not None else ClusterSettings()


@main.command()
@click.option("--config", "config", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A cache preset (configs/*.yaml) or a Serve config (configs/serve.yaml).")
@click.option("--address", default="auto", show_default=True, help="Ray address of the running cluster.")
@click.option("--allow-default-secret", is_flag=True,
              help="Local / development only: run with the public default key secret.")
def start(config: Path, address: str, allow_default_secret: bool) -> None:
    """Start mmtier on a running Ray cluster: registry, a store per node, a CPU pool on each node
    without a GPU. A GPU is left to the engine that runs there and holds its pool (the serving
    layout, cluster.gpu_pools: engines); cluster.gpu_pools: actors gives each GPU a model-less
    pool actor instead. Idempotent: run it again after nodes join. The key secret comes from
    MMTIER_KEY_SECRET (a preset) or the Serve config's cache.key_secret_env."""
    from . import cluster
    from .errors import ConfigError

    try:
        cfg, settings = load_start_config(config, allow_default_secret)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    _connect_ray(address, settings.namespace)
    try:
        report = cluster.start(cfg, settings)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"mmtier on {len(report.nodes)} node(s), namespace {settings.namespace!r}, model {cfg.model}, "
               f"GPU pools held by {settings.gpu_pools}")
    rows = [(n, "created") for n in report.created] + [(n, "existing") for n in report.existing]
    click.echo(_table(("actor", "state"), sorted(rows, key=lambda r: r[0])))


@main.command()
@click.option("--address", default="auto", show_default=True, help="Ray address of the running cluster.")
@click.option("--namespace", default="mmtier", show_default=True, help="mmtier's Ray namespace.")
def status(address: str, namespace: str) -> None:
    """Actors, tiers and hit ratios of mmtier on a running cluster, as tables."""
    from . import cluster

    _connect_ray(address, namespace)
    settings = cluster.ClusterSettings(namespace=namespace)
    try:
        cc = cluster.connect(settings)
    except ValueError:
        raise click.ClickException(f"mmtier is not running in namespace {namespace!r} "
                                   "(mmtier start --config ...)") from None
    try:
        per_actor = cc.actor_stats()
        reg = cc.registry_stats()
    finally:
        cc.close()
    click.echo(format_status(per_actor, reg, cc.cfg.model))


def format_status(per_actor: dict[str, dict], registry: dict[str, int], model: str) -> str:
    """Two tables under a registry line: actors (bytes per tier, groups, attaches), modalities
    (device, host and disk bytes summed over actors; attaches, puts, hit ratio).

    Hit ratio of a modality: attaches of groups that were already stored over all attaches
    (``(attaches - puts) / attaches`` summed over pools): each group is put once and attached
    at every use."""
    mib = lambda b: f"{b / 2**20:.1f}"
    tier_names = ("device", "host", "disk")
    rows, by_mod = [], {}
    mod_bytes: dict[str, dict[str, int]] = {}
    for name, st in sorted(per_actor.items()):
        kind, _, rest = name.partition(":")
        node, _, dev = rest.partition(":")
        tiers = st.get("tiers", {})
        used = {t: sum(u["bytes"] for u in per.values()) for t, per in tiers.items()}
        cap = {t: max((u["capacity_bytes"] for u in per.values()), default=0) for t, per in tiers.items()}
        c = st.get("counters", {})
        rows.append((kind.removeprefix("mmtier-"), node[:12], dev or "-",
                     f"{mib(used.get('device', 0))}/{mib(cap.get('device', 0))}" if "device" in tiers else "-",
                     f"{mib(used.get('host', 0))}" if "host" in tiers else "-",
                     f"{mib(used.get('disk', 0))}" if "disk" in tiers else "-",
                     sum(u["groups"] for per in tiers.values() for u in per.values()),
                     c.get("attaches", 0), c.get("puts", 0), c.get("evictions", 0)))
        for t, per in tiers.items():
            for m, u in per.items():
                mb = mod_bytes.setdefault(m, dict.fromkeys(tier_names, 0))
                mb[t] = mb.get(t, 0) + u["bytes"]
        for m, cm in st.get("by_modality", {}).items():
            agg = by_mod.setdefault(m, [0, 0, 0])
            agg[0] += cm.get("attaches", 0)
            agg[1] += cm.get("puts", 0)
            agg[2] += cm.get("evictions", 0)
    out = [f"mmtier ({model}): {len(per_actor)} actors; registry: {registry.get('keys', 0)} keys, "
           f"{registry.get('copies', 0)} copies, {mib(registry.get('bytes', 0))} MiB, "
           f"{registry.get('holders', 0)} holders",
           _table(("actor", "node", "device", "device MiB", "host MiB", "disk MiB", "groups", "attaches",
                   "puts", "evictions"), rows), ""]
    mrows = []
    for m in sorted(set(by_mod) | set(mod_bytes)):
        a, p, e = by_mod.get(m, (0, 0, 0))
        mb = mod_bytes.get(m, {})
        mrows.append((m, *(mib(mb.get(t, 0)) for t in tier_names), a, p, e,
                      f"{max(a - p, 0) / a:.2f}" if a else "-"))
    out.append(_table(("modality", "device MiB", "host MiB", "disk MiB", "attaches", "puts", "evictions",
                       "hit ratio"), mrows))
    return "\n".join(out)


def _table(header: tuple, rows: list[tuple]) -> str:
    cells = [tuple(str(x) for x in header)] + [tuple(str(x) for x in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(cells[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in cells[1:]])


# ---------------------------------------------------------------------- bench
@main.command()
@click.argument("names", nargs=-1)
@click.option("--quick", is_flag=True, help="Smaller sizes (seconds per benchmark; a check that it runs).")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Results folder (default benchmarks/results, whose RESULTS.md is then regenerated; "
                   "another folder gets its own RESULTS.md).")
def bench(names: tuple[str, ...], quick: bool, out: Path | None) -> None:
    """Run the benchmark suite (default: all of NAMES below), then regenerate
    benchmarks/RESULTS.md. NAMES: alloc kernels spill eviction cluster long_context multiturn
    hf_generate."""
    from tqdm import tqdm

    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise click.BadParameter(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}",
                                 param_hint="NAMES")
    try:
        report = importlib.import_module("benchmarks.report")
    except ModuleNotFoundError:
        raise click.ClickException("the benchmarks package is not importable: run from the "
                                   "repository root (./run bench)") from None
    argv = (["--quick"] if quick else []) + (["--out", str(out)] if out is not None else [])
    failed = []
    bar = tqdm(names or BENCHMARKS, desc="benchmarks", unit="bench")
    for name in bar:
        bar.set_postfix_str(name)
        t0 = time.perf_counter()
        try:
            importlib.import_module(BENCHMARK_MODULES[name]).main(argv)
        except Exception as exc:          # one failing benchmark does not stop the suite
            failed.append(name)
            tqdm.write(f"[mmtier bench] {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        else:
            tqdm.write(f"[mmtier bench] {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    report.main(["--results", str(out)] if out is not None else [])
    if failed:
        raise click.ClickException(f"failed: {', '.join(failed)}")


# ---------------------------------------------------------------------- serve
@main.command()
@click.option("--config", "config", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A Serve config file: mmtier's app (configs/serve.yaml) or a Ray Serve LLM one "
                   "(configs/serve-llm-cpu.yaml, configs/serve-llm-vllm.yaml).")
@click.option("--address", default="auto", show_default=True,
              help="Ray address; 'local' starts a local Ray on 127.0.0.1 for a try-out.")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="HTTP port (default: the config's http_options.port, else 8000).")
@click.option("--detach", is_flag=True, help="Deploy and return (the app keeps running on the cluster).")
def serve(config: Path, address: str, port: int | None, detach: bool) -> None:
    """Deploy the Serve application(s) of a Serve config file (like `serve run FILE`).

    A Ray Serve LLM config (import_path ray.serve.llm:build_openai_app) is an OpenAI-compatible
    API over vLLM engines with mmtier's connectors: the tiny LLaVA it names is built first when
    missing, mmtier's cluster started when its connectors name one, and the command returns
    once GET /v1/models answers (see mmtier.serve.llm_app)."""
    import yaml

    from .errors import ConfigError

    try:
        doc = yaml.safe_load(config.read_text())
    except yaml.YAMLError as exc:
        raise click.ClickException(f"cannot read {config}: {exc}") from None
    if not isinstance(doc, dict) or not doc.get("applications"):
        raise click.ClickException(f"{config}: a Serve config needs an 'applications' list")
    if detach and address == "local":
        raise click.BadParameter("a local Ray ends with this process: use --detach with a running cluster",
                                 param_hint="--detach")
    from .serve.llm_app import is_serve_llm

    if is_serve_llm(doc):
        _serve_llm(doc, address, port, detach)
        return
    import ray
    from ray import serve as rs

    if not ray.is_initialized():
        kw = {"_node_ip_address": "127.0.0.1", "include_dashboard": False} if address == "local" else {}
        ray.init(address=address, namespace="mmtier", log_to_driver=False, **kw)
    http = doc.get("http_options") or {"host": "127.0.0.1", "port": 8000}
    if port is not None:
        http = {**http, "port": port}
    rs.start(http_options=http, proxy_location=doc.get("proxy_location", "EveryNode"))
    for app in doc["applications"]:
        module, _, attr = str(app["import_path"]).partition(":")
        builder = getattr(importlib.import_module(module), attr)
        try:
            target = builder(app.get("args") or {})
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
        rs.run(target, name=app.get("name", "default"), route_prefix=app.get("route_prefix", "/"),
               blocking=False)
        click.echo(f"deployed {app.get('name', 'default')} at http://{http.get('host', '127.0.0.1')}:"
                   f"{http.get('port', 8000)}{app.get('route_prefix', '/')}")
    if not detach:
        _serve_until_interrupted(rs.shutdown)


def _serve_llm(doc: dict, address: str, port: int | None, detach: bool) -> None:
    """A Ray Serve LLM config: the OpenAI-compatible app over vLLM with mmtier's connectors."""
    from .errors import ConfigError
    from .serve.llm_app import start_llm_app, stop_llm_app

    t0 = time.perf_counter()
    try:
        app = start_llm_app(doc, port=port, address=address)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"ready in {time.perf_counter() - t0:.0f} s: OpenAI API at {app.base_url} "
               f"(models: {', '.join(app.models)})")
    if not detach:
        _serve_until_interrupted(lambda: stop_llm_app(app))


def _serve_until_interrupted(stop) -> None:
    """Serve until SIGINT (Ctrl-C) or SIGTERM (a service manager's stop), then ``stop()``."""
    import signal

    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):    # set explicitly: a background job inherits SIGINT ignored
        signal.signal(sig, lambda *_: done.set())
    click.echo("serving; Ctrl-C to stop")
    done.wait()
    click.echo("stopping")
    stop()


if __name__ == "__main__":
    main()
