"""Mover: many spills and restores in flight with checksums compared end to end, priorities,
the bytes-in-flight bound, source holds and release hooks, close waiting for copies."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch

from mmtier.errors import CapacityError, ClosedError, ShapeError, UnknownKeyError
from mmtier.storage import DiskTier, HostTier, Mover, Priority
from tests.storage.test_helpers import CFG, MODEL, key, page_sums, rand_pages, same_bytes

TEXT, VISION = CFG.spec("text"), CFG.spec("vision")
TIMEOUT = 60


@pytest.fixture
def tiers(tmp_path):
    host = HostTier(64 * VISION.page_bytes, pin_memory=False)
    disk = DiskTier(tmp_path, model=MODEL, capacity_bytes=1 << 30, chunk_bytes=4 * VISION.page_bytes)
    yield host, disk
    host.close()
    disk.close()


def test_many_spills_and_restores_in_flight(tiers):
    host, disk = tiers
    mover = Mover(host, disk, model=MODEL, max_inflight_bytes=6 * VISION.page_bytes, workers=4)
    sums, spills = {}, []
    for i in range(24):
        spec = VISION if i % 3 else TEXT
        n = 1 + i % 5
        pages = rand_pages(spec, n, seed=1000 + i)
        k = key(spec.name, i)
        sums[i] = (k, spec, page_sums(pages))
        host.put(k, spec, n * spec.page_size, pages)
        spills.append(mover.spill(k, spec, n * spec.page_size, remove_from_host=True))
    for f in concurrent.futures.as_completed(spills, timeout=TIMEOUT):
        f.result()
    assert host.used_bytes == 0 and disk.stats()["groups"] == 24
    restores = {i: mover.restore(k, spec) for i, (k, spec, _) in sums.items()}
    for i, f in restores.items():
        entry = f.result(timeout=TIMEOUT)
        assert entry is not None and page_sums(entry.gather()) == sums[i][2]
    st = mover.stats()
    assert st["peak_inflight_bytes"] <= 6 * VISION.page_bytes and st["failed"] == 0
    mover.close()


def test_restore_queued_after_spills_runs_first(tiers):
    host, disk = tiers
    mover = Mover(host, disk, model=MODEL, max_inflight_bytes=VISION.page_bytes)
    r = key("vision", 100)
    disk.put(r, VISION, 64, rand_pages(VISION, 1, seed=1))
    spills = []
    with mover.paused():
        for i in range(4):
            k = key("vision", i)
            spills.append(mover.spill(k, VISION, 64, rand_pages(VISION, 1, seed=i)))
        pf = mover.prefetch(key("vision", 101), VISION)  # not on disk: resolved at once, None
        restore = mover.restore(r, VISION)
    assert pf.result(timeout=TIMEOUT) is None
    assert restore.result(timeout=TIMEOUT) is not None
    for f in spills:
        f.result(timeout=TIMEOUT)
    order = [(op, p) for op, p, _ in mover.started_log]
    assert order == [("load", Priority.RESTORE)] + [("spill", Priority.SPILL)] * 4
    mover.close()


def test_prefetch_before_spill_and_restore_joins_prefetch(tiers):
    host, disk = tiers
    mover = Mover(host, disk, model=MODEL, max_inflight_bytes=VISION.page_bytes)
    a, b = key("vision", 1), key("vision", 2)
    disk.put(a, VISION, 64, rand_pages(VISION, 1, seed=1))
    disk.put(b, VISION, 64, rand_pages(VISION, 1, seed=2))
    with mover.paused():
        s = mover.spill(key("vision", 3), VISION, 64, rand_pages(VISION, 1, seed=3))
        pa_ = mover.prefetch(a, VISION)
        pb = mover.prefetch(b, VISION)
        rb = mover.restore(b, VISION)  # joins b's prefetch and lifts it to RESTORE
    assert rb is pb
    for f in (s, pa_, pb):
        f.result(timeout=TIMEOUT)
    assert [(op, p, k) for op, p, k in mover.started_log] == [
        ("load", Priority.RESTORE, b), ("load", Priority.PREFETCH, a), ("spill", Priority.SPILL, key("vision", 3))]
    assert mover.stats()["joined"] == 1
    mover.close()


def test_bytes_in_flight_bound(tiers):
    host, disk = tiers
    bound = 10
    mover = Mover(host, disk, model=MODEL, max_inflight_bytes=bound, workers=8)
    lock = threading.Lock()
    state = {"bytes": 0, "jobs": 0, "peak_shared": 0, "most_jobs": 0, "alone": []}

    def job(nbytes):
        def run():
            with lock:
                state["bytes"] += nbytes
                state["jobs"] += 1
                state["most_jobs"] = max(state["most_jobs"], state["jobs"])
                if state["jobs"] > 1:
                    state["peak_shared"] = max(state["peak_shared"], state["bytes"])
                else:
                    state["alone"].append(nbytes)
            time.sleep(0.01)  # hold the copy "in flight" a moment
            with lock:
                state["bytes"] -= nbytes
                state["jobs"] -= 1
            return nbytes
        return run

    sizes = [3, 4, 2, 5, 1, 6, 3, 3, 2, 4, 10, 12, 1, 1]
    with mover.paused():
        futs = [mover.submit(job(n), priority=Priority.SPILL, nbytes=n) for n in sizes]
    assert [f.result(timeout=TIMEOUT) for f in futs] == sizes
    assert state["most_jobs"] >= 3 and state["peak_shared"] <= bound
    assert 12 in state["alone"]  # larger than the bound: runs, but alone
    assert mover.peak_inflight_bytes == 12
    mover.close()


def test_spill_holds_host_slots_until_written(tiers):
    host, disk = tiers
    mover = Mover(host, disk, model=MODEL, max_inflight_bytes=1 << 30)
    k = key("vision", 1)
    pages = rand_pages(VISION, 8, seed=5)
    host.put(k, VISION, 8 * 64, pages)
    with mover.paused():
        fut = mover.spill(k, VISION, 8 * 64)
        host.remove(k)  # the owner drops it at once: the slots stay held
        assert host.used_bytes == 8 * VISION.page_bytes
        with pytest.raises(CapacityError):  # ... so they cannot be handed out again
            host.put(key("vision", 2), VISION, 57 * 64, rand_pages(VISION, 57, seed=6))
    fut.result(timeout=TIMEOUT)
    assert same_bytes(disk.get(k, VISION, MODEL), pages)
    mover.close()
    assert host.used_bytes == 0


def test_release_hook_runs_once_before_the_future_resolves(tiers):
    host, disk = tiers
    mover = Mover(host, disk, model=MODEL, max_inflight_bytes=1 << 30)
    calls = []
    pages = rand_pages(VISION, 2, seed=7)
    fut = mover.spill(key("vision", 1), VISION, 128, pages, release=lambda: calls.append(fut.done()))
    fut.result(timeout=TIMEOUT)
    assert calls == [False]
    bad = mover.spill(key("vision", 2), VISION, 64, pages,  # wrong page count: the job fails
                      release=lambda: calls.append("released"))
    with pytest.raises(ShapeError):
        bad.result(timeout=TIMEOUT)
    assert calls[-1] == "released"
    with pytest.raises(UnknownKeyError):
        mover.spill(key("vision", 3), VISION, 64, release=lambda: calls.append("unknown"))
    assert calls[-1] == "unknown"
    mover.close()


def test_corrupt_restore_is_none_and_frees_the_reservation(tiers, tmp_path):
    host, disk = tiers
    mover = Mover(host, disk, model=MODEL, max_inflight_bytes=1 << 30)
    k = key("vision", 1)
    e = disk.put(k, VISION, 64 * 3, rand_pages(VISION, 3, seed=8))
    path = tmp_path / e.files[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert mover.restore(k, VISION).result(timeout=TIMEOUT) is None
    assert host.used_bytes == 0 and not host.contains(k) and disk.stats()["corrupt_reads"] == 1
    mover.close()


def test_fetch_many_reads_groups_back_to_back(tiers, tmp_path):
    """One job for several groups (a chunked one among them): their pages land in order in one
    new tensor; a missing group and a corrupt one are flagged, the others are exact."""
    host, disk = tiers
    mover = Mover(host, disk, model=MODEL, max_inflight_bytes=1 << 30)
    sizes = [3, 6, 1, 2]                                  # 6 pages: two files of 4 + 2
    pages = [rand_pages(VISION, n, seed=30 + i) for i, n in enumerate(sizes)]
    keys = [key("vision", 40 + i) for i in range(len(sizes))]
    for k, p in zip(keys, pages):
        disk.put(k, VISION, p.shape[0] * VISION.page_size, p)
    got, ok = mover.fetch_many(keys, VISION).result(timeout=TIMEOUT)
    assert ok == [True] * 4 and got.shape[0] == sum(sizes)
    assert same_bytes(got, torch.cat(pages))
    bad = tmp_path / disk.info(keys[1]).files[1]
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 4
    bad.write_bytes(bytes(raw))
    ghost = key("vision", 99)
    got, ok = mover.fetch_many([keys[0], keys[1], ghost, keys[3]], VISION).result(timeout=TIMEOUT)
    assert ok == [True, False, False, True] and got.shape[0] == 3 + 6 + 0 + 2
    assert same_bytes(got[:3], pages[0]) and same_bytes(got[9:], pages[3])
    assert disk.stats()["corrupt_reads"] == 1 and not disk.contains(keys[1])
    mover.close()


def test_close_waits_for_in_flight_and_refuses_new_jobs(tiers):
    host, disk = tiers
    mover = Mover(host, disk, model=MODEL, max_inflight_bytes=2 * VISION.page_bytes)
    futs = [mover.spill(key("vision", i), VISION, 128, rand_pages(VISION, 2, seed=i)) for i in range(8)]
    mover.close(timeout=TIMEOUT)
    assert all(f.done() and f.exception() is None for f in futs)
    assert disk.stats()["groups"] == 8
    with pytest.raises(ClosedError):
        mover.spill(key("vision", 9), VISION, 64, rand_pages(VISION, 1, seed=9))


def test_close_without_drain_cancels_queued(tiers):
    host, disk = tiers
    mover = Mover(host, disk, model=MODEL, max_inflight_bytes=VISION.page_bytes)
    released = []
    with mover.paused():
        futs = [mover.spill(key("vision", i), VISION, 64, rand_pages(VISION, 1, seed=i),
                            release=lambda i=i: released.append(i)) for i in range(4)]
        mover.close(timeout=TIMEOUT, drain=False)
    assert all(f.cancelled() for f in futs) and sorted(released) == [0, 1, 2, 3]
