"""Smoke test of the multi-turn benchmark: a tiny replay end to end into a temporary folder."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from benchmarks.cache import multiturn


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
    for arm in ("cache", "dense"):
        assert 0 < data[f"ttft_{arm}_p50_s"] <= data[f"ttft_{arm}_p95_s"]
        assert data[f"ttft_{arm}_p50_s__turn0"] > 0
    # one round: the headline is that round's summed dense TTFT over the cache's
    assert data["ttft_speedup_vs_dense_n"] == 1
    assert data["ttft_speedup_vs_dense"] == pytest.approx(
        data["ttft_dense_mean_s"] / data["ttft_cache_mean_s"])
    for key in ("memory_sharing_over_without", "memory_sharing_over_without_text",
                "encoder_runs_avoided_fraction", "hit_ratio_text", "machine", "date"):
        assert key in data
    # a tenant's conversations share their system prompt's span (one prefix); nothing is stored twice
    assert 0 < data["memory_sharing_over_without_text"] <= 1.0
    assert 0 < data["memory_sharing_over_without"] <= 1.0


def test_dense_check_reports_a_wrong_answer():
    from mmtier.chat.dense import dense_chat
    from mmtier.chat.model import ChatModel

    chat = ChatModel.tiny(seed=0)
    media = multiturn.Media(seed=0)
    turn = multiturn.Turn(0, "acme", 0, 0, ("hi ", media.image(3), "?"), multiturn.Counter(vision=1))
    want = dense_chat(chat, [list(turn.items)], 2)[0]
    good = multiturn.Record(turn, answer=list(want), first={"dense": want[0]})
    assert multiturn.dense_check(chat, [turn], [good], 2) == []
    wrong = (want[0] + 1) % 256
    bad = multiturn.Record(turn, answer=[wrong, want[1]], first={"dense": wrong})
    lines = multiturn.dense_check(chat, [turn], [bad], 2)
    assert len(lines) == 2 and "cache" in lines[0] and "dense first token" in lines[1]


def test_paired_summary_is_the_median_of_the_pairs():
    from benchmarks._common import paired_rounds, ratio_figures, spread

    order = []
    got = paired_rounds({"a": lambda: order.append("a") or 2.0, "b": lambda: order.append("b") or 4.0}, 4)
    assert got == {"a": [2.0] * 4, "b": [4.0] * 4}
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]          # rotated each round
    fig = ratio_figures("x_over_y", [1.0, 3.0, 2.0, 9.0, 4.0], [1.0, 1.0, 1.0, 1.0, 2.0], higher_is_better=True)
    assert (fig["x_over_y"], fig["x_over_y_best"], fig["x_over_y_worst"], fig["x_over_y_n"]) == (2.0, 9.0, 1.0, 5)
    assert fig["x_over_y_pairs"].count(";") == 4
    s = spread([5.0, 1.0, 3.0])
    assert (s.median, s.best, s.worst) == (3.0, 1.0, 5.0)
    with pytest.raises(ValueError):
        ratio_figures("z", [1.0], [1.0, 2.0], higher_is_better=False)


def test_overlap_floor_is_the_largest_resource_and_the_sum_beside_it():
    from benchmarks.kernels.floors import Floors

    f = Floors({"memory": 0.1, "disk": 0.5}, compute_s=0.3)
    assert (f.overlap_s, f.summed_s, f.bound) == (0.5, 0.6, "disk")
    g = Floors({"memory": 0.1, "disk": 0.2}, compute_s=0.7)
    assert (g.overlap_s, g.bound) == (0.7, "compute")


def test_long_context_preset_config_is_the_shipped_preset_with_its_own_layers(tmp_path):
    from benchmarks.kernels import long_context as lc

    cfg = lc.build_config(12_000, "qwen2.5-vl-7b", 2, "cpu", tmp_path / "spill", reserve=4 << 30)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype) == (2, 4, 128, "bfloat16")
    assert set(cfg.modalities) == {"text", "vision", "video"}
    assert all(cfg.spec(m).num_layers == 2 for m in cfg.modalities)
    assert cfg.disk_free_floor_bytes == 4 << 30
    assert lc.token_bytes("qwen2.5-vl-7b", 28) == 56 * 1024
    free = lc.shutil.disk_usage(tmp_path).free
    if free > 5 << 30:
        n = lc.max_tokens(tmp_path, "qwen2.5-vl-7b", 28, reserve=4 << 30)
        assert 0 < n * 56 * 1024 <= free - (4 << 30)


def test_connector_copy_quick_restores_the_bytes_and_reports_ratios(tmp_path):
    from benchmarks.engines import connector_copy

    fig = connector_copy.main(["--quick", "--repeat", "5", "--out", str(tmp_path)])    # raises if a load is wrong
    data = json.loads((tmp_path / "connector_copy.json").read_text())
    assert data["quick"] is True and data["threads"] == 1
    for key in ("plain_copy_gbs", "save_gbs", "load_gbs", "save_block_groups_gbs"):
        assert data[key] > 0
    # paired rounds: a ratio is the median of its rounds' ratios (plain copy time over save time)
    for name in ("save_over_plain_copy", "load_over_plain_copy"):
        pairs = [float(p.split("=")[1]) for p in fig[f"{name}_pairs"].split("; ")]
        assert len(pairs) == fig[f"{name}_n"] == 5
        assert fig[name] == pytest.approx(statistics.median(pairs), abs=1e-3)
        assert fig[f"{name}_worst"] <= fig[name] <= fig[f"{name}_best"]

