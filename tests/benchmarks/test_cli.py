"""Every benchmark through the command users run, ``mmtier bench NAME --quick``, in one
subprocess (one local Ray for the benchmarks that start one), writing into a temporary folder:
each must finish, write its JSON with the figures it promises, and leave ``benchmarks/results/``
and ``benchmarks/RESULTS.md`` alone. Quick runs are sized for seconds; their figures are not
judged here (speed is measured by the full runs, never asserted in tests)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmtier.cli import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]

# The figures each benchmark promises (its headline figures in benchmarks/report.py and the
# ones its docstring names), each a finite number in a quick run on a CPU.
PROMISED = {
    "alloc": ("alloc_free_pages_per_s_batched", "alloc_free_pages_per_s_single",
              "cpu_paged_over_sdpa_decode", "cpu_paged_over_sdpa_prefill", "max_abs_diff_vs_sdpa"),
    "kernels": ("cpu_paged_over_contiguous", "cpu_bandwidth_fraction", "cpu_copy_bandwidth_gbs",
                "cpu_decode_ctx2048_pools3_paged_over_contiguous"),
    "spill": ("spill_over_raw_write", "restore_over_raw_read", "spill_over_torch_save",
              "restore_over_torch_load", "warm_restart_s_per_10k_files", "spill_via_mover_gbps"),
    "eviction": ("min_avoided_over_lru__lru", "min_block_hit_over_lru__bimodal_lru",
                 "cache_parity_mismatches", "target_min_over_lru__dip",
                 "target_lift_over_asked__adaptive_slru", "op_cost_over_lru__arc", "op_cost_growth__s3fifo"),
    "cluster": ("registry_lookups_per_s", "registry_single_lookups_per_s", "remote_over_local_attention",
                "remote_fetch_over_object_store", "copy_gb_per_s"),
    "long_context": ("decode_over_overlap_floor", "decode_over_summed_floor", "max_rel_err"),
    "multiturn": ("ttft_speedup_vs_dense", "memory_sharing_over_without", "encoder_runs_avoided_fraction",
                  "ttft_cache_p50_s", "ttft_dense_p95_s"),
    "connector_copy": ("save_over_plain_copy", "load_over_plain_copy", "plain_copy_gbs"),
    "hf_generate": ("tiny_warm_over_dynamic_ttft", "tiny_cold_over_dynamic_tpot", "batch_over_single"),
}
PLOTS = ("eviction", "multiturn")          # benchmarks that draw their own PNG
# Checks of correctness a quick run still makes (against an oracle / the dense model).
CORRECT = {
    "alloc": lambda d: d["max_abs_diff_vs_sdpa"] < 1e-3,
    "long_context": lambda d: d["max_rel_err"] < 8e-3,          # the preset's bf16 output
    "hf_generate": lambda d: d["tiny_tokens_match"] is True and d["batch_max_abs_diff"] <= 1e-5,
    "multiturn": lambda d: d["tokens_match"] is True,
    "eviction": lambda d: d["cache_parity_mismatches"] == 0 and d.get("independent_replay_mismatches", 0) == 0,
}


def _digest(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p).encode() + p.read_bytes())
    return h.hexdigest()


def _committed() -> str:
    return _digest([ROOT / "benchmarks" / "RESULTS.md", *(ROOT / "benchmarks" / "results").rglob("*.*")])


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-quick")
    before = _committed()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "MMTIER_BENCH_DIR": str(out), "PYTHONPATH": os.pathsep.join(
               p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "mmtier.cli", "bench", *BENCHMARKS, "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return proc, out, before


def test_every_benchmark_has_promised_figures():
    assert set(PROMISED) == set(BENCHMARKS)


@pytest.mark.ray
def test_quick_suite_runs_and_leaves_committed_results_alone(quick_run):
    proc, out, before = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert _committed() == before
    page = (out / "RESULTS.md").read_text()
    assert all(f"`{name}`" in page or name in page for name in BENCHMARKS)


@pytest.mark.ray
@pytest.mark.parametrize("name", BENCHMARKS)
def test_quick_benchmark_writes_its_figures(quick_run, name):
    proc, out, _ = quick_run
    assert f"[mmtier bench] {name}: " in proc.stderr, proc.stderr[-5000:]
    data = json.loads((out / f"{name}.json").read_text())
    assert data["machine"] and data["date"]
    for key in PROMISED[name]:
        value = data.get(key)
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), \
            f"{name}.{key} = {value!r}"
    assert all(not isinstance(v, (dict, list)) for v in data.values())
    if name in CORRECT:
        assert CORRECT[name](data), data
    if name in PLOTS:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
