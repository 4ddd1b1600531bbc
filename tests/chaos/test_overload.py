"""Scenario 3: overload. Many concurrent sequences (threads) push the device pools, the host
tier and the disk past capacity.

Injected: 8 threads x 60 requests against a cache of 8 device pages per pool, a host tier of 8
pages and a disk tier on an 8 MiB tmpfs with a 2 MiB free-space floor (a real filesystem that
fills; without root, a 6 MiB ``disk_bytes`` budget on the ordinary disk instead). A request
creates a sequence, appends text, stores or reuses 1-3 images of 1-3 pages (media drawn from 300,
so both hits and misses), attaches them, sometimes attends, and releases.

Asserted: every failure is a typed ``MMTierError`` (``CapacityError`` -> the request falls back
to recompute, counted); every hit read back is byte-exact; the process is not killed (peak RSS
growth bounded); the filesystem never drops below the floor (sampled every 5 ms from a monitor
thread); cache-call latency p50 / p99 / max are reported and max is bounded.

``DiskTier`` counts the bytes of every write in flight against the floor (two concurrent writes
with room for one: ``test_concurrent_writes_keep_the_free_space_floor``), so the overload test
asserts the floor itself, with no allowance for writes in flight. The checks are not vacuous: the
run must read hits back (byte-exact), attend, spill to disk and, on the tmpfs, reach the floor.
"""

from __future__ import annotations

import os
import random
import resource
import subprocess
import threading
import time

import pytest
import torch

from mmtier import CapacityError, TieredKVCache
from mmtier.errors import CorruptDataError, MMTierError, UnknownKeyError

from .conftest import D, L, fingerprint, make_cfg, media, seeded_kv, tmp_files

pytestmark = pytest.mark.chaos

THREADS, REQUESTS, MEDIA = 8, 60, 300
FS_BYTES, FLOOR, INFLIGHT = 8 << 20, 2 << 20, 256 << 10


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        yield mnt, False
        return
    try:
        yield mnt, True
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _free(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _tokens(i: int) -> int:
    return 20 + (i * 37) % 70                  # 20..89 tokens: 1-3 vision pages


def test_overload_gives_typed_errors_bounded_latency_and_keeps_the_floor(small_fs, figures, backend):
    mnt, is_tmpfs = small_fs
    cfg = make_cfg(mnt, device_pages=8, host_pages=8, **backend.cfg(),
                   disk_bytes=(64 << 20) if is_tmpfs else (6 << 20),
                   disk_free_floor_bytes=FLOOR if is_tmpfs else 0, max_inflight_bytes=INFLIGHT)
    expect = {i: fingerprint(*seeded_kv(i, _tokens(i))) for i in range(MEDIA)}
    lat: list[float] = []
    tally = {"requests": 0, "capacity_fallbacks": 0, "evicted_fallbacks": 0, "corrupt_fallbacks": 0, "hits": 0,
             "verified_reads": 0, "puts": 0, "attentions": 0, "served_wrong": 0}
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()
    min_free = [_free(mnt)]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def monitor():
        while not stop.wait(0.005):
            min_free[0] = min(min_free[0], _free(mnt))

    def timed(fn, *a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            with lock:
                lat.append(time.perf_counter() - t0)

    def worker(w: int, cache: TieredKVCache):
        rng = random.Random(w)
        for _ in range(REQUESTS):
            seq = timed(cache.create_sequence, f"tenant-{w % 2}")
            try:
                timed(cache.append, seq, "text", *seeded_kv(rng.randrange(1 << 30), rng.randint(4, 30)))
                for _ in range(rng.randint(1, 3)):
                    i = rng.randrange(MEDIA)
                    key = timed(cache.content_key, "vision", media(i), tenant=f"tenant-{w % 2}")
                    if timed(cache.contains, key):
                        with lock:
                            tally["hits"] += 1
                        try:
                            got = fingerprint(*timed(cache.read_group, key))
                        except (UnknownKeyError, CorruptDataError):
                            got = None                # evicted meanwhile, or a corrupt copy: a miss
                        if got is not None:
                            with lock:
                                tally["verified_reads"] += 1
                                tally["served_wrong"] += got != expect[i]
                    else:
                        timed(cache.put, key, *seeded_kv(i, _tokens(i)))
                        with lock:
                            tally["puts"] += 1
                    timed(cache.attach, seq, key)
                if rng.random() < 0.3:
                    out = timed(cache.attention, seq, rng.randrange(L), torch.randn(2, 4, D))
                    assert torch.isfinite(out).all()
                    with lock:
                        tally["attentions"] += 1
            except (CapacityError, UnknownKeyError) as exc:
                # no room even after eviction, or the group was evicted between put and attach:
                # the request recomputes (typed, nothing half-done)
                with lock:
                    tally["capacity_fallbacks" if isinstance(exc, CapacityError) else "evicted_fallbacks"] += 1
            except CorruptDataError:
                with lock:
                    tally["corrupt_fallbacks"] += 1
            except MMTierError as exc:     # typed but unexpected here: fail the test
                errors.append(exc)
            except BaseException as exc:   # untyped: a bug
                errors.append(exc)
            finally:
                timed(cache.release, seq)
                with lock:
                    tally["requests"] += 1

    t_start = time.perf_counter()
    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    with TieredKVCache(cfg) as cache:
        threads = [threading.Thread(target=worker, args=(w, cache)) for w in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a worker hung"
        cache.flush()
        c = cache.stats().counters
        for pool in cache.pools.values():          # every request released: only cached groups hold pages
            assert pool.num_used == sum(len(g.pages) for g in cache.index.groups.values()
                                        if g.tier.name == "DEVICE" and g.modality == pool.spec.name)
    stop.set()
    mon.join(5)
    wall = time.perf_counter() - t_start
    assert not errors, errors[:3]
    assert tally["requests"] == THREADS * REQUESTS and tally["served_wrong"] == 0
    assert tally["verified_reads"] > 0 and tally["puts"] > 0 and tally["attentions"] > 0, tally
    assert tmp_files(mnt) == []
    rss_growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert rss_growth_mib < 1024
    lat.sort()
    p50, p99, mx = lat[len(lat) // 2], lat[int(len(lat) * 0.99)], lat[-1]
    assert mx < 30.0, f"a cache call took {mx:.1f} s"
    pressure = c.get("spills", 0) + c.get("evictions", 0)
    assert pressure > 0 and c.get("spills_to_disk", 0) > 0
    assert c.get("corrupt_reads", 0) == 0 and tally["corrupt_fallbacks"] == 0
    if is_tmpfs:
        assert min_free[0] >= FLOOR, f"free space fell to {min_free[0]} (floor {FLOOR})"
        assert c.get("disk_floor_refusals", 0) + c.get("disk_full_errors", 0) > 0, "the floor was never reached"
    figures.update(threads=THREADS, requests=tally["requests"], calls=len(lat), wall_s=round(wall, 1),
                   p50_ms=round(p50 * 1e3, 2), p99_ms=round(p99 * 1e3, 2), max_ms=round(mx * 1e3, 1),
                   tmpfs=is_tmpfs, min_free_kib=min_free[0] >> 10, floor_kib=FLOOR >> 10,
                   floor_overshoot_kib=max(0, FLOOR - min_free[0]) >> 10,
                   rss_growth_mib=round(rss_growth_mib), spills=c.get("spills", 0),
                   evictions=c.get("evictions", 0), spill_failures=c.get("spill_failures", 0),
                   floor_refusals=c.get("disk_floor_refusals", 0), full_errors=c.get("disk_full_errors", 0),
                   **{k: v for k, v in tally.items() if k != "requests"})


def test_concurrent_writes_keep_the_free_space_floor(small_fs):
    """Two spills in flight at once, with room above the floor for exactly one of them."""
    import asyncio

    from mmtier.storage import DiskTier

    mnt, is_tmpfs = small_fs
    if not is_tmpfs:
        pytest.skip("needs a tmpfs (root) for exact free-space figures")
    cfg = make_cfg(None)
    spec = cfg.spec("vision")
    with TieredKVCache(make_cfg(None)) as cache:
        keys = [cache.content_key("vision", media(i)) for i in range(2)]
    need = 4 * spec.page_bytes + 4096
    floor = _free(mnt) - need - 4 * 4096                   # room for one group, not two
    disk = DiskTier(mnt, model=cfg.model, capacity_bytes=1 << 30, free_floor_bytes=floor)

    async def both():
        return await asyncio.gather(*(disk.put_async(k, spec, 4 * spec.page_size,
                                                     torch.randn(4, *spec.page_shape)) for k in keys),
                                    return_exceptions=True)

    asyncio.run(both())
    disk.close()
    assert _free(mnt) >= floor, f"{floor - _free(mnt)} bytes below the floor"
