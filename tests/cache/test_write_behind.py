"""The write-behind to the disk tier (``mmtier.tiers.durability``): every shared group saved is
on disk within the lag, written once (an eviction or a promotion of a group already on disk
writes nothing more), found by a new cache over the same directory; a disk that is behind, full
or failing drops or fails writes, counted, and serving goes on; with no disk tier (or it turned
off) nothing changes; the writes wait for a burst of saves to go quiet, never past half the lag.
Real pools, the real disk writer (Arrow IPC, xxh3 per page)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from mmtier import TieredKVCache
from mmtier.core.groups import Tier
from mmtier.tiers.durability import HEADROOM, hold_until
from tests.cache.test_tiers import VISION_PAGE, kv, make_cfg


@pytest.fixture
def torch_backend():
    class Torch:
        def cfg(self):
            return {"attention_backend": "torch"}
    return Torch()


def cfg_of(tmp_path, torch_backend, **over):
    return make_cfg(torch_backend, tmp_path, **over)


def put_all(cache, n, tokens=50, tag="g"):
    data = {}
    for i in range(n):
        key = cache.content_key("vision", f"{tag}{i}".encode(), tenant="acme")
        data[key] = kv(tokens)
        assert cache.put(key, *data[key])
    return data


def spills(cache):
    """Writes the mover started (reads are jobs of their own)."""
    return sum(1 for op, _, _ in cache.lower.mover.started_log if op == "spill")


def files(tmp_path):
    return sorted((tmp_path / "spill").glob("*.arrow"))


def test_every_put_is_on_disk_once_within_the_lag_and_a_new_cache_finds_it(tmp_path, torch_backend):
    cfg = cfg_of(tmp_path, torch_backend, device_pages=16, host_pages=0).model_copy(
        update={"host_bytes": 0, "persist_on_close": False})
    cache = TieredKVCache(cfg)
    data = put_all(cache, 4)
    emb = cache.content_key("vision_embed", b"e0", tenant="acme")
    cache.put_embedding(emb, torch.randn(40, 16))
    assert cache.durable is not None and cache.durable.drain(30)
    c = cache.stats().counters
    assert c["durable_writes"] == 5 and c.get("durable_dropped", 0) == 0
    assert c["durable_bytes"] == 4 * 2 * VISION_PAGE + cache.cfg.spec("vision_embed").pages_for(40) * \
        cache.cfg.spec("vision_embed").page_bytes
    assert c["durable_queued"] == 0 and 0 < c["durable_lag_p50_ms"] <= c["durable_lag_p99_ms"]
    assert all(cache.index.groups[k].tier == Tier.DEVICE for k in data)        # left where they were
    assert len(files(tmp_path)) == 5
    # a second cache over the directory, the first never closed (a killed process): all there
    with TieredKVCache(cfg) as again:
        assert again.stats().counters["adopted_from_disk"] == 5
        for key, (k, v) in data.items():
            got_k, got_v = again.read_group(key)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
    cache.close()


def test_a_group_already_on_disk_is_evicted_and_promoted_without_a_second_write(tmp_path, torch_backend):
    """Device of 4 pages, no host tier: each put evicts an earlier group to disk. Each group
    was made durable first: the evictions only drop device pages (the mover takes one write a
    group, no more); a promotion back to the device keeps the file."""
    cfg = cfg_of(tmp_path, torch_backend, device_pages=4, host_pages=0).model_copy(update={"host_bytes": 0})
    with TieredKVCache(cfg) as cache:
        data = {}
        for i in range(5):
            data.update(put_all(cache, 1, tag=f"e{i}-"))
            assert cache.durable.drain(30)
        tiers = [cache.index.groups[k].tier for k in data]
        assert tiers.count(Tier.DISK) == 3 and tiers.count(Tier.DEVICE) == 2
        c = cache.stats().counters
        assert c["durable_writes"] == 5 and c["spills_to_disk"] == 3
        assert spills(cache) == 5                   # one write a group
        assert len(files(tmp_path)) == 5
        first = next(iter(data))
        with cache.lock:
            assert cache.residency.promote(cache.index.groups[first])
        assert cache.index.groups[first].tier == Tier.DEVICE
        assert cache.lower.disk.contains(first) and len(files(tmp_path)) == 5   # still durable
        for key, (k, v) in data.items():
            got_k, got_v = cache.read_group(key)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
        assert spills(cache) == 5


def test_host_groups_already_on_disk_are_spilled_by_dropping_the_host_copy(tmp_path, torch_backend):
    # demote: each put pushes the device's group to the host, whose full tier spills the oldest
    cfg = cfg_of(tmp_path, torch_backend, device_pages=2, host_pages=2, put_placement="demote")
    with TieredKVCache(cfg) as cache:
        data = {}
        for i in range(4):
            data.update(put_all(cache, 1, tag=f"h{i}-"))
            assert cache.durable.drain(30)
            cache.flush()
        assert [cache.index.groups[k].tier for k in data].count(Tier.DISK) >= 1
        c = cache.stats().counters
        assert c["durable_writes"] == 4 and c.get("spills_already_on_disk", 0) >= 1
        assert spills(cache) == 4
        for key, (k, v) in data.items():
            got_k, got_v = cache.read_group(key)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_a_disk_that_cannot_keep_up_drops_saves_counted_and_never_blocks(tmp_path, torch_backend):
    cfg = cfg_of(tmp_path, torch_backend, device_pages=64, host_pages=0).model_copy(
        update={"host_bytes": 0, "durable_lag_s": 1e-6})
    with TieredKVCache(cfg) as cache:
        t0 = time.monotonic()
        data = put_all(cache, 24)
        put_s = time.monotonic() - t0
        assert cache.durable.drain(30)
        c = cache.stats().counters
        assert c["durable_dropped"] > 0
        assert c["durable_writes"] + c["durable_dropped"] + c.get("durable_skipped", 0) == 24
        assert len(files(tmp_path)) == c["durable_writes"]
        assert put_s < 10                                     # the puts did not wait for the disk
        for key, (k, _) in data.items():                      # serving goes on from memory
            assert torch.equal(cache.read_group(key)[0], k)


def test_a_failing_disk_is_counted_logged_once_and_serving_goes_on(tmp_path, torch_backend, caplog):
    cfg = cfg_of(tmp_path, torch_backend, device_pages=16, host_pages=0).model_copy(
        update={"host_bytes": 0, "disk_free_floor_bytes": 1 << 62})         # every write refused
    with caplog.at_level(logging.WARNING, logger="mmtier.tiers.durability"), TieredKVCache(cfg) as cache:
        data = put_all(cache, 3)
        assert cache.durable.drain(30)
        c = cache.stats().counters
        assert c["durable_write_errors"] == 3 and c.get("durable_writes", 0) == 0
        assert files(tmp_path) == []
        for key, (_, v) in data.items():
            assert torch.equal(cache.read_group(key)[1], v)
    warnings = [r for r in caplog.records if "write-behind" in r.getMessage()]
    assert len(warnings) == 1 and "StorageFullError" in warnings[0].getMessage()


@pytest.mark.parametrize("over", [{"disk": False}, {"write_behind": False}])
def test_without_a_disk_tier_or_with_it_off_nothing_is_written_in_the_background(tmp_path, torch_backend, over):
    cfg = cfg_of(tmp_path, torch_backend, device_pages=16, host_pages=0, **over).model_copy(
        update={"host_bytes": 0, "persist_on_close": False})
    with TieredKVCache(cfg) as cache:
        put_all(cache, 3)
        cache.flush()
        assert cache.durable is None and cache.index.on_saved is None
        assert "durable_writes" not in cache.stats().counters
    assert files(tmp_path) == []


def test_durable_lag_and_quiet_are_validated(tmp_path, torch_backend):
    from mmtier.errors import ConfigError

    for bad in (0, -1.0, "soon"):
        with pytest.raises(ConfigError, match="durable_lag_s"):
            cfg_of(tmp_path, torch_backend, durable_lag_s=bad)
    for bad in (-0.01, 61, "soon"):
        with pytest.raises(ConfigError, match="durable_quiet_s"):
            cfg_of(tmp_path, torch_backend, durable_quiet_s=bad)


def wait_for(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return cond()


def test_the_holdback_waits_for_quiet_and_never_past_its_share_of_the_lag():
    """``hold_until``: a batch starts ``quiet_s`` after the last save, but no later than the
    oldest save's share of the lag that admission leaves free, nor than leaves the queue's
    estimated drain room twice over before the oldest save's bound."""
    assert hold_until(10.0, last_at=10.3, backlog_s=0.0, quiet_s=0.05, lag_s=1.0) == pytest.approx(10.35)
    assert hold_until(10.0, last_at=10.6, backlog_s=0.0, quiet_s=0.05, lag_s=1.0) == pytest.approx(10.0 + 1 - HEADROOM)
    assert hold_until(10.0, last_at=10.3, backlog_s=0.0, quiet_s=0.0, lag_s=1.0) == pytest.approx(10.3)
    assert hold_until(10.0, last_at=10.2, backlog_s=0.4, quiet_s=0.05, lag_s=1.0) == pytest.approx(10.0 + 1 - 0.4 / HEADROOM)
    for backlog in (0.0, 0.1, 0.3, HEADROOM):             # written by the bound at half the measured rate
        assert hold_until(10.0, last_at=11.0, backlog_s=backlog, quiet_s=5.0, lag_s=1.0) + 2 * backlog <= 11.0 + 1e-9
    assert hold_until(10.0, last_at=10.0, backlog_s=0.0, quiet_s=5.0, lag_s=1e-6) <= 10.0 + 1e-6


def test_a_burst_of_saves_is_written_only_once_it_goes_quiet(tmp_path, torch_backend):
    """Quiet of 2 s, lag of 60 s: nothing is copied or written while the saves keep coming;
    every file is written at least the quiet after the last save began, none dropped, without
    a flush asking for it."""
    quiet = 2.0
    cfg = cfg_of(tmp_path, torch_backend, device_pages=16, host_pages=0).model_copy(
        update={"host_bytes": 0, "persist_on_close": False, "durable_lag_s": 60.0, "durable_quiet_s": quiet})
    with TieredKVCache(cfg) as cache:
        data = {}
        for i in range(6):
            before_last = time.time_ns()
            data.update(put_all(cache, 1, tag=f"b{i}-"))
            assert cache.stats().counters.get("durable_writes", 0) == 0 and files(tmp_path) == []
        assert wait_for(lambda: cache.stats().counters.get("durable_writes", 0) == 6)
        c = cache.stats().counters
        assert c.get("durable_dropped", 0) == 0 and c["durable_lag_p50_ms"] >= 1000 * quiet
        written = files(tmp_path)
        assert len(written) == 6
        assert all(f.stat().st_mtime_ns >= before_last + quiet * 1e9 for f in written)
        for key, (k, v) in data.items():
            got_k, got_v = cache.read_group(key)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_a_continuous_stream_of_saves_is_still_written_within_the_lag_bound(tmp_path, torch_backend):
    """Saves every 50 ms for 3 s never go quiet for the 5 s holdback: the writes start anyway,
    by half of the 2 s lag after the oldest save waiting, while the saves go on; every save is
    written, none dropped, none later than the bound."""
    lag = 2.0
    cfg = cfg_of(tmp_path, torch_backend, device_pages=128, host_pages=0).model_copy(
        update={"host_bytes": 0, "persist_on_close": False, "durable_lag_s": lag, "durable_quiet_s": 5.0})
    with TieredKVCache(cfg) as cache:
        data, gaps, last = {}, [], time.monotonic()
        end = last + 3.0
        while time.monotonic() < end:
            data.update(put_all(cache, 1, tag=f"s{len(data)}-"))
            time.sleep(0.05)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
        during = cache.stats().counters.get("durable_writes", 0)
        assert max(gaps) < 5.0                            # the stream never went quiet
        assert during > 0 and len(files(tmp_path)) >= during
        assert cache.durable.drain(30)
        c = cache.stats().counters
        assert c["durable_writes"] == len(data) and c.get("durable_dropped", 0) == 0
        assert c["durable_lag_max_ms"] <= 1000 * lag


def test_a_flush_and_a_close_skip_the_holdback(tmp_path, torch_backend):
    """A holdback of a minute and a lag of an hour: a flush writes the saves at once, and so
    does a close (the saves after the flush), nothing dropped."""
    cfg = cfg_of(tmp_path, torch_backend, device_pages=16, host_pages=0).model_copy(
        update={"host_bytes": 0, "persist_on_close": False, "durable_lag_s": 3600.0, "durable_quiet_s": 60.0})
    cache = TieredKVCache(cfg)
    put_all(cache, 2, tag="f")
    assert cache.durable.drain(10) and cache.stats().counters["durable_writes"] == 2     # flush's wait
    put_all(cache, 2, tag="c")
    cache.durable.close(timeout=10)
    assert len(files(tmp_path)) == 4 and cache.stats().counters["durable_writes"] == 4
    cache.close()


def test_device_pages_are_copied_without_the_lock_and_the_group_stays_put_meanwhile(tmp_path, torch_backend):
    """The write-behind copies a device group's pages with the cache's lock let go, so saves and
    reads go on meanwhile; the group is pinned for that time: not dropped, not evicted, its pages
    not reused, and the copy is its bytes. Once copied it is an ordinary group again."""
    cfg = cfg_of(tmp_path, torch_backend, device_pages=4, host_pages=0).model_copy(
        update={"host_bytes": 0, "persist_on_close": False})
    cache = TieredKVCache(cfg)
    lower, copies = cache.lower, []
    real = lower.snapshot
    key, other = (cache.content_key("vision", t, tenant="acme") for t in (b"first", b"other"))
    first_kv, other_kv = kv(50), kv(50)

    def in_the_window(group):            # another thread's work, inside the copy's window
        if group.key != key:
            return real(group)
        assert not cache.residency.lock.held()
        assert cache.drop_unreferenced([key]) == []          # pinned: it stays
        assert cache.put(other, *other_kv)                   # a save goes on
        got = cache.read_group(other)                        # and a read
        assert torch.equal(got[0], other_kv[0]) and torch.equal(got[1], other_kv[1])
        copies.append(real(group))
        return copies[-1]

    lower.snapshot = in_the_window
    assert cache.put(key, *first_kv)
    assert cache.durable.drain(30)
    lower.snapshot = real
    assert len(copies) == 1                     # pages [n, layers, 2, page, heads, dim] -> tokens
    snap = copies[0].permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :50]
    assert torch.equal(snap[:, 0], first_kv[0]) and torch.equal(snap[:, 1], first_kv[1])
    c = cache.stats().counters
    assert c["durable_writes"] == 2 and c.get("durable_write_errors", 0) == 0
    assert sorted(f.name.split("-")[1] for f in files(tmp_path)) == sorted([key.hex, other.hex])
    assert cache.drop_unreferenced([key]) == [key]           # unpinned again
    assert cache.pools["vision"].num_free == 4 - 2          # its pages let go
    cache.close()
