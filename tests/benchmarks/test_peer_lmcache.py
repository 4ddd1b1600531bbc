"""The short form of ``benchmarks/peers/peer_lmcache.py`` (mmtier's side, ``peer_lmcache_mmtier``) that
CI runs: every operation the benchmark times runs on small groups and reads back exactly the
bytes it stored, the puts into the full device pool are written around it (no demotion), and
the simple calls (``read_group(key)``, no ``out=``) answer what the batched / ``out=`` ones
answer. (LMCache's side needs its own environment, ``./run peers``; the figures are in
``benchmarks/RESULTS.md``.)"""

from __future__ import annotations

import pytest

from benchmarks.peers.peer_lmcache import PAIRS, SIMPLE
from benchmarks.peers.peer_lmcache_mmtier import MMTierSide

GROUPS = 6


@pytest.fixture(scope="module")
def side(tmp_path_factory):
    s = MMTierSide(groups=GROUPS, layers=2, heads=2, head_dim=64, chunk=64, seed=3,
                   workdir=str(tmp_path_factory.mktemp("peer")), device_groups=2, host_groups=2)
    yield s
    s.close()


@pytest.mark.parametrize("rnd", [0, 1])
def test_every_timed_operation_runs_and_reads_back_the_bytes_stored(side, rnd):
    answers = {}
    for _, m_op, _, r_op in PAIRS:
        for op in (m_op, r_op):
            if op is None:
                continue
            ans = getattr(side, op)()
            assert ans["s"] > 0
            assert ans.get("equal", True) is True, op
            answers[op] = ans
    put = answers["cache_put_host"]
    cfg = side.cache_host.cfg                  # the cache as a user makes it: placement not named
    assert "put_placement" not in cfg.model_fields_set and cfg.put_placement == "auto"
    # the pool held two groups; every later put went around it (round 0) and, with the pool
    # still full of the first round's two, every put of the next round did (no demotion at all)
    assert put["demotions"] == 0
    assert put["written_around"] == (GROUPS - 2 if rnd == 0 else GROUPS)
    # this round's groups still on the host (the host tier holds a round's bytes: the policy
    # may let some of them go for the last round's groups the reads made hot)
    assert 0 < answers["cache_get_host"]["groups"] <= put["written_around"]
    for simple, batched in SIMPLE.items():
        assert answers[simple]["groups"] == answers[batched]["groups"] > 0
    assert answers["cache_cold_read"]["groups"] >= GROUPS - 4      # the small host tier spilled the rest


def test_demote_placement_makes_the_two_copies_the_benchmark_compares_against(tmp_path):
    s = MMTierSide(groups=4, layers=2, heads=2, head_dim=64, chunk=64, seed=4, workdir=str(tmp_path),
                   put_placement="demote")
    try:
        put = s.cache_put_host()
        assert put["demotions"] == 2 and put["written_around"] == 0
        assert s.cache_get_host()["equal"] and s.cache_get_host_simple()["equal"]
    finally:
        s.close()
