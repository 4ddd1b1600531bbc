"""The serving-load benchmark's reductions: what it reports of the write-behind (from the
engines' cache counters) and of the peak throughput, on made-up inputs whose answers are known."""

from __future__ import annotations

import math

from benchmarks.engines.serving_load import PAIRS, durable_figures, peak_throughput, sustainable


def test_durable_figures_sum_the_caches_and_take_the_worst_lag():
    kv = {"durable_writes": 40, "durable_bytes": 4_000_000, "durable_dropped": 2, "durable_write_errors": 0,
          "durable_lag_p50_ms": 12, "durable_lag_p99_ms": 90, "durable_lag_max_ms": 130}
    enc = {"durable_writes": 5, "durable_bytes": 500_000, "durable_dropped": 0, "durable_write_errors": 1,
           "durable_lag_p50_ms": 3, "durable_lag_p99_ms": 210, "durable_lag_max_ms": 220}
    out = durable_figures([enc, kv], completed=9)
    assert out["durable_writes"] == 45 and out["durable_bytes"] == 4_500_000
    assert out["durable_dropped"] == 2 and out["durable_write_errors"] == 1
    assert out["durable_bytes_per_request"] == 500_000
    assert out["durable_lag_p50_ms"] == 12                 # the busiest cache's median
    assert (out["durable_lag_p99_ms"], out["durable_lag_max_ms"]) == (210, 220)
    assert math.isnan(durable_figures([kv], completed=0)["durable_bytes_per_request"])


def test_the_durability_pair_names_its_figures_after_its_engines():
    ref, test = PAIRS["durability"]
    rows = {ref: [{"rate": 1.0, "completed_per_s": 2.0}, {"rate": 2.0, "completed_per_s": 3.0}],
            test: [{"rate": 1.0, "completed_per_s": 2.0}, {"rate": 2.0, "completed_per_s": 2.7}]}
    out = peak_throughput(rows, ref, test)
    assert out[f"peak_completed_{test}_over_{ref}"] == 0.9
    assert set(peak_throughput({"plain": rows[ref], "mmtier": rows[test]})) == {
        "peak_completed_per_s_plain", "peak_completed_per_s_mmtier", "peak_completed_mmtier_over_plain"}


def test_sustainable_needs_every_request_completed_within_the_bound():
    rows = [{"rate": 1.0, "ttft_p99_s": 0.5, "completed": 10, "sent": 10},
            {"rate": 2.0, "ttft_p99_s": 0.9, "completed": 9, "sent": 10},
            {"rate": 4.0, "ttft_p99_s": 3.0, "completed": 10, "sent": 10}]
    assert sustainable(rows, 1.0) == 1.0 and sustainable(rows, 5.0) == 4.0 and sustainable(rows, 0.1) == 0.0


def test_requests_arrive_interleaved_and_a_limit_keeps_the_first_turns():
    from benchmarks.engines.serving_load import LoadSpec, interleaved, trace

    spec = LoadSpec.quick()
    system, convs = trace(spec, seed=1)
    assert system["role"] == "system" and len(convs) == spec.conversations
    assert all(len(turns) == spec.turns for turns in convs)
    lo, hi = spec.answer_range
    assert all(lo <= t.answer_tokens <= hi for turns in convs for t in turns)
    assert interleaved(convs, 100) == [(c, i) for i in range(spec.turns) for c in range(spec.conversations)]
    assert interleaved(convs, 4) == [(0, 0), (1, 0), (2, 0), (0, 1)]
    assert interleaved([[], convs[0]], 10) == [(1, 0), (1, 1)]
