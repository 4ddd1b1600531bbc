"""``mmtier demo`` (its default: the openai client against Ray Serve LLM over vLLM with mmtier's
connectors, beside the same engine without mmtier) end to end, ``--quick``, in a subprocess with
its own local Ray on 127.0.0.1. Runs in the engines environment (``./run engines``); elsewhere
it is skipped with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

try:
    import openai  # noqa: F401
    import ray.serve.llm  # noqa: F401
    import vllm  # noqa: F401
except ImportError as exc:
    pytest.skip(f"needs the engines environment (vLLM, ray.serve.llm, openai; ./run engines): {exc}",
                allow_module_level=True)

pytestmark = pytest.mark.ray


def test_demo_quick_serves_later_turns_from_mmtier_with_the_same_answers(tmp_path):
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "MMTIER_MODELS": str(tmp_path / "models")}
    proc = subprocess.run([sys.executable, "-m", "mmtier.cli", "demo", "--quick", "--out", str(tmp_path),
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "answers equal the engine without mmtier: PASSED" in out, out
    report = json.loads((tmp_path / "demo_serving.json").read_text())
    assert report["check_mismatches"] == 0 and report["check_turns"] == report["conversations"] * report["turns"]
    # later turns carry the history: mmtier serves it; the plain engine caches nothing
    assert report["cached_tokens__later_turns"] > 0 and report["cached_tokens_plain__all_turns"] == 0
    assert report["cached_tokens__first_turns"] <= report["prompt_tokens__first_turns"]
    assert report["images_sent"] > 0
    assert any(k.startswith("cluster_") and v > 0 for k, v in report.items() if "_groups__" in k)
    assert all(not isinstance(v, (dict, list)) for v in report.values())
