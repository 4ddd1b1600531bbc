"""``mmtier demo`` (its default: the openai client against vLLM's OpenAI API server with vLLM's
prefix cache on and a small KV pool, beside the same server with mmtier's connectors, restarted
midway) end to end with ``--quick``, and ``benchmarks/engines/serving_load.py --quick`` (a few requests
at one rate against both servers), each in a subprocess. Runs in the engines environment
(``./run engines``); elsewhere it is skipped with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

try:
    import openai  # noqa: F401
    import vllm  # noqa: F401
except ImportError as exc:
    pytest.skip(f"needs the engines environment (vLLM, openai; ./run engines): {exc}", allow_module_level=True)


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "MMTIER_MODELS": os.environ.get("MMTIER_MODELS", str(tmp_path / "models"))}


def test_demo_quick_answers_equal_through_a_restart(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mmtier.cli", "demo", "--quick", "--out", str(tmp_path),
                           "--no-progress"], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "answers equal the engine without mmtier: PASSED" in out, out
    assert '"POST /v1/chat/completions' not in out + proc.stderr          # HTTP logs go to the file
    report = json.loads((tmp_path / "demo_serving.json").read_text())
    assert report["check_mismatches"] == 0 and report["check_turns"] == report["conversations"] * report["turns"]
    for phase in ("first_turns", "later_before_restart", "later_after_restart"):
        assert report[f"requests__{phase}"] > 0
        assert report[f"answers_equal__{phase}"] == report[f"requests__{phase}"]
    # vLLM's pool holds a fraction of the conversations; the restart found mmtier's disk tier
    assert report["working_set_tokens"] > 2 * report["vllm_kv_tokens"]
    # a plain stop (SIGTERM, vLLM's default shutdown: no cache closed): the write-behind's files
    assert report["caches_closed_at_restart"] == 0 and report["disk_files_at_restart"] > 0
    assert report["cached_tokens_mmtier__later_after_restart"] > report["cached_tokens_plain__later_after_restart"]
    # the four modalities: audio and video on their own tiny models, items reused, answers equal
    assert report["text__requests"] > 0 and report["image__requests"] > 0
    for medium in ("audio", "video"):
        sent, distinct = report[f"{medium}__items_sent"], report[f"{medium}__items_distinct"]
        assert report[f"{medium}__answers_equal"] == report[f"{medium}__requests"] > 0
        assert sent > distinct                                    # an item recurs across turns and users
        assert 0 < report[f"{medium}__encoder_runs_mmtier"] <= distinct   # the tower ran on each item at most once
        assert report[f"{medium}__cached_tokens_mmtier"] > report[f"{medium}__cached_tokens_plain"]
    assert report["media_turns"] == report["audio__requests"] + report["video__requests"]
    for m in ("text", "image", "audio", "video"):
        assert any(line.startswith(m) for line in out.splitlines()), out
    assert all(not isinstance(v, (dict, list)) for v in report.values())
    assert (tmp_path / "demo_serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serving_load_quick_runs_against_both_servers(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.engines.serving_load", "--quick", "--out", str(tmp_path),
                           "--engines-python", sys.executable], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((tmp_path / "serving_load.json").read_text())
    for name in ("plain", "mmtier"):
        assert figures[f"completed_{name}__r1"] == "6/6", figures
        assert figures[f"prompt_tokens_per_s_{name}__r1"] > 0
        assert 0 < figures[f"ttft_p50_s_{name}__r1"] <= figures[f"ttft_p99_s_{name}__r1"] < 90
    # the second turns carry the first ones (and the shared system prompt)
    assert figures["hit_ratio_mmtier__r1"] > 0
