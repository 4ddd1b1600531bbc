"""The ``mmtier`` command: ``demo --quick`` end to end (a subprocess with its own local Ray on
127.0.0.1), ``--help`` of every command, and the deployment configs it reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mmtier.cli import demo_run_dir, format_status, load_start_config, main
from mmtier.config import DEFAULT_KEY_SECRET
from mmtier.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("demo", "start", "status", "bench", "serve")


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help(command):
    args = ["--help"] if command is None else [command, "--help"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    if command is None:
        assert all(c in result.output for c in COMMANDS)


def test_demo_run_dirs_are_fresh_and_ignored(tmp_path):
    first = demo_run_dir(tmp_path / "runs")
    first.mkdir(parents=True)
    second = demo_run_dir(tmp_path / "runs")
    assert first.parent == second.parent == tmp_path / "runs" and first.name.startswith("demo-")
    assert second != first and not second.exists()
    ignored = subprocess.run(["git", "check-ignore", "-q", "runs/demo-x/demo_serving.json"], cwd=ROOT)
    assert ignored.returncode == 0, "runs/ must be git-ignored: a demo leaves the clone clean"


def test_bench_rejects_unknown_names():
    result = CliRunner().invoke(main, ["bench", "no-such-benchmark"])
    assert result.exit_code == 2 and "unknown benchmark" in result.output


def test_start_config_from_serve_yaml_and_presets(monkeypatch):
    monkeypatch.setenv("MMTIER_KEY_SECRET", "s3cret-from-env")
    cfg, settings = load_start_config(ROOT / "configs" / "serve.yaml")
    assert cfg.model.startswith("chat:hf:qwen2_vl") and settings.namespace == "mmtier"   # the HF chat model
    assert {"text", "vision", "transcript", "audio"} <= set(cfg.modalities)
    assert cfg.key_secret == "s3cret-from-env"
    cfg, _ = load_start_config(ROOT / "configs" / "tiny-mm.yaml")
    assert cfg.model == "tiny-mm" and cfg.key_secret == "s3cret-from-env"
    cfg, settings = load_start_config(ROOT / "configs" / "serve-llm-vllm.yaml")   # the engines' own cache
    assert cfg.model == "Qwen/Qwen2.5-VL-7B-Instruct" and cfg.key_secret == "s3cret-from-env"
    assert "vision_embed" in cfg.modalities and settings.device_resource == "mmtier_pool"
    cfg, settings = load_start_config(ROOT / "configs" / "serve-llm-cpu-pd.yaml")   # P/D: prefill_config's
    assert cfg.model == "tiny-llava-vllm" and settings.device_resource == "mmtier_pool"


@pytest.mark.parametrize("name", ["serve.yaml", "tiny-mm.yaml"])
def test_start_refuses_the_default_key_secret_without_the_dev_flag(monkeypatch, name):
    monkeypatch.delenv("MMTIER_KEY_SECRET", raising=False)
    with pytest.raises(ConfigError) as err:
        load_start_config(ROOT / "configs" / name)
    want = ("cache.key_secret_env",) if name == "serve.yaml" else ("key_secret",)
    assert err.value.fields == want and "MMTIER_KEY_SECRET" in str(err.value)
    cfg, _ = load_start_config(ROOT / "configs" / name, allow_default_secret=True)
    assert cfg.key_secret == DEFAULT_KEY_SECRET
    result = CliRunner().invoke(main, ["start", "--config", str(ROOT / "configs" / name)])
    assert result.exit_code == 1 and "MMTIER_KEY_SECRET" in result.output


def test_serve_app_refuses_the_default_key_secret_unless_allowed(monkeypatch):
    from mmtier.serve.config import ServeAppConfig
    from mmtier.serve.engine_loader import app_cache_config

    monkeypatch.delenv("MMTIER_KEY_SECRET", raising=False)
    args = {"api_keys": {"k": "acme"}}
    with pytest.raises(ConfigError) as err:
        app_cache_config(ServeAppConfig.parse(args))
    assert err.value.fields == ("key_secret",)
    allowed = ServeAppConfig.parse({**args, "cache": {"allow_default_key_secret": True}})
    assert app_cache_config(allowed).key_secret == DEFAULT_KEY_SECRET
    monkeypatch.setenv("MY_SECRET", "from-env")
    from_env = ServeAppConfig.parse({**args, "cache": {"key_secret_env": "MY_SECRET"}})
    assert app_cache_config(from_env).key_secret == "from-env"


def test_deployment_configs():
    from mmtier.serve.config import ServeAppConfig

    serve_cfg = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    app = serve_cfg["applications"][0]
    assert app["import_path"] == "mmtier.serve.app:build_app"
    ServeAppConfig.parse(app["args"]).key_table()

    svc = yaml.safe_load((ROOT / "configs" / "kuberay-rayservice.yaml").read_text())
    assert svc["kind"] == "RayService" and svc["spec"]["rayClusterConfig"]["authOptions"]["mode"] == "token"
    inline = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]
    parsed = ServeAppConfig.parse(inline["args"])
    assert parsed.api_keys_env and not parsed.api_keys          # keys come from a Secret

    cluster = yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())
    starts = " ".join(cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in starts and "mmtier start --config" in starts
    assert any("pip install" in c and "mmtier" in c for c in cluster["setup_commands"])


def test_format_status_table():
    pool = {"tiers": {"device": {"vision": {"groups": 2, "pages": 4, "bytes": 4 << 20, "capacity_bytes": 8 << 20}}},
            "counters": {"attaches": 5, "puts": 2, "evictions": 1},
            "by_modality": {"vision": {"attaches": 5, "puts": 2, "evictions": 1}}}
    store = {"tiers": {"host": {"vision": {"groups": 1, "pages": 2, "bytes": 2 << 20, "capacity_bytes": 64 << 20}},
                       "disk": {"vision": {"groups": 1, "pages": 3, "bytes": 3 << 20, "capacity_bytes": 1 << 30},
                                "audio": {"groups": 1, "pages": 5, "bytes": 5 << 20, "capacity_bytes": 1 << 30}}},
             "counters": {"puts": 1}, "by_modality": {}}
    text = format_status({"mmtier-pool:abcdef0123456789:cpu0": pool, "mmtier-store:abcdef0123456789": store},
                         {"keys": 3, "copies": 3, "bytes": 6 << 20, "holders": 2}, "tiny-mm")
    assert "pool" in text and "store" in text and "4.0/8.0" in text
    actors, mods = text.split("\n\n")
    assert "disk MiB" in actors and actors.splitlines()[-1].split()[5] == "8.0"   # the store's disk
    rows = {line.split()[0]: line.split() for line in mods.splitlines()[2:]}
    assert mods.splitlines()[0].split()[:7] == ["modality", "device", "MiB", "host", "MiB", "disk", "MiB"]
    assert rows["vision"][1:4] == ["4.0", "2.0", "3.0"] and rows["vision"][-1] == "0.60"   # (5 - 2) / 5
    assert rows["audio"][1:4] == ["0.0", "0.0", "5.0"] and rows["audio"][-1] == "-"


@pytest.mark.ray
def test_demo_quick_end_to_end(tmp_path):
    """The transformers demo (``--engine transformers``; the default, vLLM's, runs in the engines
    environment: ``tests/demo/test_serving.py``)."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    committed = {p: p.read_bytes() for p in (ROOT / "benchmarks" / "results").glob("demo.*")}
    # no --out, run from a scratch folder: the report lands in its runs/demo-<time>/, nothing committed moves
    proc = subprocess.run([sys.executable, "-m", "mmtier.cli", "demo", "--engine", "transformers", "--quick",
                           "--no-progress"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p: p.read_bytes() for p in committed} == committed
    (run_dir,) = (tmp_path / "runs").glob("demo-*")
    tmp_path = run_dir
    out = proc.stdout
    for heading in ("media by modality", "bytes per tier", "spills", "restores",
                    "time per turn", "with cache", "without cache"):
        assert heading in out, out
    assert "tokens equal the dense path (DynamicCache + sdpa): PASSED" in out
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["dense_check_passed"] is True and report["dense_check_mismatches"] == 0
    assert report["turns"] == report["dense_check_turns"] > 0
    assert report["model"].startswith("qwen2_vl + whisper")
    assert report["span_hits"] > 0 and report["prompt_tokens_cached"] > 0          # later turns attach
    assert report["encoder_runs_cache"] < report["encoder_runs_nocache"]
    assert report["max_lookup_calls_per_turn"] <= 1 and report["max_publish_calls_per_turn"] <= 1
    assert report["spilled_groups_freed"] > 0 and report["host_bytes"] > 0
    # a video turn in every conversation: its segments' tower outputs reused, fewer tower runs
    assert report["video_placements"] > 0 and report["video_hits"] + report["video_embedding_hits"] > 0
    assert report["video_encoder_runs"] < report["video_encoder_runs_dense"] and "video" in out
    assert all(not isinstance(v, (dict, list)) for v in report.values())   # flat, like the benchmarks
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.ray
def test_start_leaves_a_gpu_node_s_gpu_to_its_engine(tmp_path):
    """``mmtier start`` on a fresh local Ray whose one node declares a GPU (a resource Ray
    schedules by; no device is touched): the registry and the node's store, no model-less pool
    actor, and the GPU still free for the engine that will hold its pool (the old start gave it
    to a ``PagePoolActor``, so a Serve worker asking ``num_gpus=1`` could not be scheduled)."""
    ray = pytest.importorskip("ray")
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text((ROOT / "configs" / "tiny-mm.yaml").read_text()
                   + "\ncluster:\n  namespace: mmtier-gpu-layout\n  start_timeout_s: 120\n")
    ray.init(address="local", num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False,
             namespace="mmtier-gpu-layout")
    try:
        result = CliRunner().invoke(main, ["start", "--config", str(cfg), "--allow-default-secret"])
        assert result.exit_code == 0, result.output
        assert "GPU pools held by engines" in result.output
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == "mmtier-gpu-layout"}
        assert "mmtier-registry" in names and any(n.startswith("mmtier-store") for n in names), names
        assert not any(n.startswith("mmtier-pool") for n in names), names
        assert ray.available_resources().get("GPU") == 1.0
    finally:
        from mmtier.cluster import shutdown
        from mmtier.cluster.settings import ClusterSettings

        shutdown(ClusterSettings(namespace="mmtier-gpu-layout"))
        ray.shutdown()
