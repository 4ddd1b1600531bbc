"""Smoke test of the transformers benchmark: the tiny model only, into a temporary folder."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from benchmarks.engines import hf_generate  # noqa: E402


def test_hf_generate_quick_writes_figures(tmp_path):
    hf_generate.main(["--quick", "--models", "tiny", "--context", "32", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "hf_generate.json").read_text())
    assert data["tiny_tokens_match"] is True and data["runs"] >= 5
    for arm in ("dynamic", "cold", "warm"):
        for what in ("ttft", "tpot"):
            assert 0 < data[f"tiny_{arm}_{what}_best_s"] <= data[f"tiny_{arm}_{what}_s"] \
                <= data[f"tiny_{arm}_{what}_worst_s"]
    assert data["batch_max_abs_diff"] <= 1e-5 and data["batch_over_single"] > 0
