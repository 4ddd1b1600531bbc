"""The registry model (``benchmarks.cluster.registry_sim``): one shard fed Poisson single-key calls
agrees with the M/D/1 and M/M/1 formulas (utilisation and mean wait); saturation rises with
shards; the calibration fits the per-call and per-key costs back from the figures they make and
says which file it used; a run is the same for the same seed."""

from __future__ import annotations

import json

import pytest

from benchmarks.cluster.registry_sim import (
    Calibration,
    CalibrationError,
    Inputs,
    PoissonWork,
    TraceWork,
    calibrate,
    find_saturation,
    fit,
    simulate,
    with_service,
)

ONE_KEY = PoissonWork(keys=1, new=0, seed=3)
QUEUE = Calibration(call_s=8e-4, key_s=2e-4, client_s=0.0, source="test")    # service 1 ms a call


def _one_shard(rho: float, service: str, window_s: float):
    cal = with_service(QUEUE, service)
    s = cal.service_s(1)
    inp = Inputs(window_s=window_s, warmup_s=1.0, p99_bound_s=1.0, seed=5)
    return s, simulate("a", 1, rho / s, cal, inp, ONE_KEY)


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_one_shard_is_md1(rho):
    s, p = _one_shard(rho, "det", window_s=80.0)
    wq = rho * s / (2 * (1 - rho))                    # Pollaczek-Khinchine, deterministic service
    assert p.max_util == pytest.approx(rho, abs=0.02)
    assert p.mean_s - s == pytest.approx(wq, rel=0.1)


def test_one_shard_is_mm1():
    rho = 0.6
    s, p = _one_shard(rho, "exp", window_s=120.0)
    wq = rho * s / (1 - rho)
    assert p.max_util == pytest.approx(rho, abs=0.03)
    assert p.mean_s - s == pytest.approx(wq, rel=0.12)


def test_saturation_rises_with_shards():
    cal = Calibration(call_s=3e-4, key_s=7e-6, client_s=1e-3, source="test")
    inp = Inputs(window_s=1.0, seed=1)
    work = PoissonWork(keys=16, new=4, seed=2)
    sat = {n: find_saturation("c", 8, cal, inp, work, n, start=100.0, bisect=4).rate for n in (1, 4, 16)}
    assert sat[1] > 0
    assert sat[4] > 1.5 * sat[1]
    assert sat[16] > 1.5 * sat[4]


def test_fit_recovers_the_costs():
    call, key, frac = 3e-4, 7e-6, 0.25
    rtt = (call + key) / frac
    cal = fit(1 / rtt, 1000 / (call + 1000 * key), 1000, frac, "test")
    assert cal.call_s == pytest.approx(call, rel=1e-9)
    assert cal.key_s == pytest.approx(key, rel=1e-9)
    assert cal.client_s == pytest.approx(rtt - call - key, rel=1e-9)
    with pytest.raises(CalibrationError):
        fit(1 / rtt, 1000 / (call + 1000 * key), 1000, 0.0, "test")
    with pytest.raises(CalibrationError):          # a batched call faster than one single call's server share
        fit(100.0, 1e9, 1000, 1.0, "test")


def test_calibrate_prefers_registry_scale(tmp_path):
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"registry_single_lookups_per_s": 790.0, "registry_lookups_per_s": 130000.0, "date": "d1"}))
    from_cluster = calibrate(tmp_path, 0.25)
    assert from_cluster.source.startswith("cluster.json")
    (tmp_path / "registry_scale.json").write_text(json.dumps({"shards": 4, "date": "d2"}))
    assert "without these figures" in calibrate(tmp_path, 0.25).source
    (tmp_path / "registry_scale.json").write_text(json.dumps(
        {"single_lookups_per_s": 1580.0, "batched_lookups_per_s": 260000.0, "batch_keys": 500, "date": "d2"}))
    scaled = calibrate(tmp_path, 0.25)
    assert scaled.source.startswith("registry_scale.json")
    assert scaled.call_s + scaled.key_s == pytest.approx(0.25 / 1580.0)
    assert scaled.call_s + 500 * scaled.key_s == pytest.approx(500 / 260000.0)
    (tmp_path / "cluster.json").unlink()
    (tmp_path / "registry_scale.json").unlink()
    with pytest.raises(CalibrationError):
        calibrate(tmp_path, 0.25)


def test_trace_cache_and_bad_lines(tmp_path):
    work = TraceWork([(0.0, [1, 2, 3]), (1.0, [1, 2, 4]), (10.0, [1, 5])], "t")
    assert work.first.tolist() == [3, 1, 1]
    prep = work.prepare(rate_per_engine=work.rate, cache_s=5.0)      # trace time = wall time
    assert [k.tolist() for k in prep.needed] == [[1, 2, 3], [4], [1, 5]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"hash_ids": [2]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        TraceWork.load(bad)


def test_same_seed_same_run():
    cal = Calibration(call_s=3e-4, key_s=7e-6, client_s=1e-3, source="test")
    inp = Inputs(window_s=0.5, seed=9)
    work = PoissonWork(keys=8, new=2, seed=4)
    runs = [simulate(d, 16, 2000.0, cal, inp, work, 4) for d in ("c", "d", "e") for _ in range(2)]
    assert runs[0] == runs[1] and runs[2] == runs[3] and runs[4] == runs[5]
    with pytest.raises(ValueError):
        simulate("z", 16, 2000.0, cal, inp, work, 4)


def test_shared_media_is_a_second_call_by_chain():
    """Design e: a request's chain is one call; a shared media group (``media_share`` of the
    requests) is one more on its own key's shard, unless it falls on the chain's."""
    cal = Calibration(call_s=3e-4, key_s=7e-6, client_s=1e-3, source="test")
    work = PoissonWork(keys=30, new=0, seed=6)
    calls = {}
    for share in (0.0, 0.3):
        p = simulate("e", 1, 4.0, cal, Inputs(window_s=200.0, seed=2, media_share=share), work, 64)
        calls[share] = p.calls_per_s * 200.0 / p.lookups
    assert calls[0.0] <= 1.0
    assert 1.0 + 0.3 * 63 / 64 - 0.1 < calls[0.3] < 1.0 + 0.3 + 0.1, calls
    # key-hash shards: the media key is one more key among ~30 spread over 64 shards
    c = simulate("c", 1, 4.0, cal, Inputs(window_s=200.0, seed=2, media_share=0.3), work, 64)
    assert c.calls_per_s * 200.0 / c.lookups > 15
