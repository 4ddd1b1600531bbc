"""Smoke test of the multi-turn benchmark: a tiny replay end to end into a temporary folder."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import multiturn
from mmtier.models import Image, Text


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)     # main() sets one intra-op thread


def test_multiturn_quick_writes_figures_and_plot(tmp_path):
    fig = multiturn.main(["--quick", "--turns", "3", "--active", "2", "--new-tokens", "2",
                          "--out", str(tmp_path)])
    data = json.loads((tmp_path / "multiturn.json").read_text())
    assert (tmp_path / "multiturn.png").stat().st_size > 0
    assert (tmp_path / "multiturn_trace_quick.arrow").exists()
    assert data["tokens_match"] is True and fig["tokens_match"] is True
    assert data["turns"] == 3 and data["conversations"] >= 1 and data["cache_evictions"] == 0
    for key in ("ttft_cache_s", "ttft_recompute_s", "ttft_dense_s"):
        assert data[key] > 0
    assert data["ttft_speedup"] == pytest.approx(data["ttft_recompute_s"] / data["ttft_cache_s"])
    for key in ("memory_sharing_over_without", "memory_sharing_over_without_text",
                "encoder_runs_avoided_fraction", "hit_ratio_text", "machine", "date"):
        assert key in data
    assert data["memory_sharing_over_without_text"] == 1.0     # text is never shared


def test_dense_check_reports_a_wrong_answer():
    turn = multiturn.Turn(0, "acme", 0, 0, (Text("hi "), Image(bytes(range(256)) * 12), Text("?")),
                          multiturn.Counter(vision=1))
    want = multiturn.ReferenceModel(seed=0).chat_dense([list(turn.items)], 2)[0]
    good = multiturn.Record(turn, answer=list(want), first={"recompute": want[0], "dense": want[0]})
    assert multiturn.dense_check([turn], [good], 2) == []
    bad = multiturn.Record(turn, answer=[(want[0] + 1) % 256, want[1]],
                           first={"recompute": want[0], "dense": (want[0] + 1) % 256})
    lines = multiturn.dense_check([turn], [bad], 2)
    assert len(lines) == 2 and "cache" in lines[0] and "dense first token" in lines[1]


def test_connector_copy_quick_restores_the_bytes_and_reports_ratios(tmp_path, monkeypatch):
    import benchmarks._common as common
    from benchmarks import connector_copy

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    fig = connector_copy.main(["--quick", "--repeat", "5"])    # raises if a load is wrong
    data = json.loads((tmp_path / "connector_copy.json").read_text())
    assert data["quick"] is True and data["threads"] == 1
    for key in ("plain_copy_gbs", "save_gbs", "load_gbs", "save_block_groups_gbs"):
        assert data[key] > 0
    assert fig["save_over_plain_copy"] == pytest.approx(fig["save_gbs"] / fig["plain_copy_gbs"])
