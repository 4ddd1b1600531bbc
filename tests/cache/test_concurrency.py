"""The cache under threads: the lock covers bookkeeping only, copies race nothing, room is made
all or nothing.

- Attention is computed outside the cache's lock and a spill that makes room is awaited outside
  it: while one thread's disk read or spill is held back (an event, never a sleep), other
  threads' calls finish.
- A prefetch in flight against a promotion, and a background spill against an attention over
  the same host group: deterministic interleavings (the mover held by events), the answers
  equal to the float64 oracle and the host bytes all accounted for.
- ``make_room`` that fails half-way (a host tier or a disk budget that refuses the second
  group) leaves every group, page and byte where it was.
- 8 threads doing put / attach / attention / release on a small device pool over host and disk
  tiers (a put that finds every page read or moved by others waits, bounded, and goes on):
  every answer equals the oracle, no deadlock (a watchdog with a timeout), nothing left behind
  at the end (pages, host bytes, files).
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import faulthandler
import random
import sys
import threading
from pathlib import Path

import pytest
import torch

from mmtier import CacheConfig, ModalitySpec, TieredKVCache
from mmtier.attention.planner import AttentionPlanner
from mmtier.cache.engine_surface import EngineSurface
from mmtier.cache.group_index import GroupIndex
from mmtier.cache.keys import CacheKeys
from mmtier.cache.sequences import Sequences
from mmtier.cache.shared_groups import SharedGroups
from mmtier.core.groups import Tier
from mmtier.errors import CapacityError, UnknownKeyError
from mmtier.tiers.residency import Residency
from tests.support.composed import check_facade
from tests.support.oracle import Logical, oracle_attention, rel_err

L, H, D = 2, 2, 32
HQ = 4                                   # GQA 2
TOKEN_BYTES = 2 * L * H * D * 4          # K and V, all layers, float32
VISION_PAGE = 32 * TOKEN_BYTES
WAIT = 30.0                              # bound of every wait in these tests


def make_cfg(tmp_path, device_pages=4, host_pages=4, disk=True, **over) -> CacheConfig:
    base = dict(
        model="tiny-threads", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
        modalities={"text": ModalitySpec(page_size=16, share=0.5),
                    "vision": ModalitySpec(page_size=32, share=0.5)},
        device="cpu", device_bytes=2 * device_pages * VISION_PAGE + 64,
        host_bytes=host_pages * VISION_PAGE, disk_dir=(tmp_path / "spill") if disk else None,
        disk_bytes=64 << 20, disk_free_floor_bytes=0)
    base.update(over)
    return CacheConfig(**base)


def image_kv(i: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g)


def check(cache, seq, logical: Logical, layer: int, n_q: int = 2) -> None:
    """The cache's causal attention for the last ``n_q`` positions equals the oracle's."""
    q = torch.randn(n_q, HQ, D)
    k, v, pos = logical.gathered(layer)
    q_pos = torch.arange(k.shape[0] - n_q, k.shape[0])
    out = cache.attention(seq, layer, q)
    ref, _ = oracle_attention(q, q_pos, k, v, pos)
    assert rel_err(out, ref) < 1e-4


def host_accounted(cache) -> None:
    """Every host byte belongs to a group the cache counts on the host (none lost)."""
    with cache.lock:
        cache.lower.apply_completions()
        on_host = sum(g.nbytes for g in cache.index.groups.values() if g.tier == Tier.HOST)
        on_host += sum(s.group.nbytes for t in cache.seqs.tables.values() for s in t.segments
                       if s.group.tier == Tier.HOST and s.group.key is None)
        assert cache.lower.host.used_bytes == on_host


def cascade(cache, n=4):
    """``n`` images of 2 pages put in order on a 4-page device and 4-page host: the first ones
    go down (the second host spill runs in the background)."""
    keys = [cache.content_key("vision", f"img{i}".encode()) for i in range(n)]
    for i, key in enumerate(keys):
        cache.put(key, *image_kv(i))
    return keys


def run_bounded(fn, timeout=WAIT / 3):
    """Run ``fn`` on a thread: ``True`` when it finished within ``timeout`` (its exception, if
    any, raised here), ``False`` when it is still running."""
    box: dict[str, BaseException] = {}

    def target():
        try:
            fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if "error" in box:
        raise box["error"]
    return not t.is_alive()


# ---------------------------------------------------------------------- the lock's scope
def test_attention_over_disk_runs_outside_the_lock_and_changes_no_thread_setting(tmp_path, monkeypatch):
    with TieredKVCache(make_cfg(tmp_path, host_pages=0)) as cache:
        keys = cascade(cache, 3)                          # images 0 on disk, 1 and 2 on the device
        cache.flush()
        assert cache.index.groups[keys[0]].tier == Tier.DISK
        seq, logical = cache.create_sequence(), Logical()
        for i in (1, 2, 0):                               # 1, 2 referenced: 0 cannot come up
            cache.attach(seq, keys[i])
            logical.add(*image_kv(i), f"img{i}")
        assert cache.index.groups[keys[0]].tier == Tier.DISK
        disk = cache.lower.disk
        reading, go = threading.Event(), threading.Event()
        real_get_layer = disk.get_layer

        def held_get_layer(key, *a, **kw):
            if key == keys[0]:
                reading.set()
                assert go.wait(WAIT)
            return real_get_layer(key, *a, **kw)

        monkeypatch.setattr(disk, "get_layer", held_get_layer)
        calls = []
        monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
        worker = concurrent.futures.ThreadPoolExecutor(1)
        try:
            answer = worker.submit(check, cache, seq, logical, 1)
            assert reading.wait(WAIT)                     # the attention is reading the disk group
            other = cache.create_sequence()
            assert run_bounded(lambda: (cache.stats(), cache.contains(keys[1]),
                                        cache.append(other, "text", *image_kv(9, n=8)))), \
                "a call waited for another thread's attention (lock held)"
            assert not answer.done()
        finally:
            go.set()
        answer.result(WAIT)
        worker.shutdown()
        assert calls == []                                # no process-wide thread changes per call


def test_a_spill_that_makes_room_is_awaited_outside_the_lock(tmp_path, monkeypatch):
    with TieredKVCache(make_cfg(tmp_path, host_pages=0, write_behind=False)) as cache:   # the spill's own write is held
        keys = cascade(cache, 2)                          # the device is full
        seq, logical = cache.create_sequence(), Logical()
        cache.attach(seq, keys[1])
        logical.add(*image_kv(1), "img1")
        disk = cache.lower.disk
        writing, go = threading.Event(), threading.Event()
        real_put = disk.put_async

        async def held_put(key, *a, **kw):
            if key == keys[0]:
                writing.set()
                await asyncio.get_running_loop().run_in_executor(None, go.wait, WAIT)
            return await real_put(key, *a, **kw)

        monkeypatch.setattr(disk, "put_async", held_put)
        worker = concurrent.futures.ThreadPoolExecutor(1)
        try:
            put = worker.submit(cache.put, cache.content_key("vision", b"needs-room"), *image_kv(7))
            assert writing.wait(WAIT)                     # image 0 is being spilled to make room
            assert run_bounded(lambda: (check(cache, seq, logical, 0), cache.stats())), \
                "a call waited for another thread's spill (lock held)"
            assert not put.done()
        finally:
            go.set()
        assert put.result(WAIT) is True
        worker.shutdown()
        assert cache.index.groups[keys[0]].tier == Tier.DISK
        check(cache, seq, logical, 1)


def test_a_run_released_while_read_keeps_its_pages_until_the_reader_is_done(tmp_path, monkeypatch):
    """A sequence's own text run fills the text pool; its attention is held at the kernel while
    another thread releases the sequence and asks for text pages: they are refused (typed), the
    reader's answer equals the oracle, and once it is done the pages are free again."""
    import mmtier.attention.plan as plan_module

    with TieredKVCache(make_cfg(tmp_path, host_pages=0, disk=False)) as cache:
        pool = cache.pools["text"]
        seq, logical = cache.create_sequence(), Logical()
        k, v = torch.randn(L, pool.num_pages * 16, H, D), torch.randn(L, pool.num_pages * 16, H, D)
        cache.append(seq, "text", k, v)
        logical.add(k, v, "text")
        assert pool.num_free == 0
        computing, go = threading.Event(), threading.Event()
        real = plan_module.paged_attention

        def held(*a, **kw):
            computing.set()
            assert go.wait(WAIT)
            return real(*a, **kw)

        monkeypatch.setattr(plan_module, "paged_attention", held)
        worker = concurrent.futures.ThreadPoolExecutor(1)
        try:
            answer = worker.submit(check, cache, seq, logical, 1)
            assert computing.wait(WAIT)
            other = cache.create_sequence()
            assert run_bounded(lambda: cache.release(seq))
            with pytest.raises(CapacityError):            # the pages are the reader's until it is done
                cache.append(other, "text", torch.randn(L, 4, H, D), torch.randn(L, 4, H, D))
            assert pool.num_free == 0
        finally:
            go.set()
        answer.result(WAIT)
        worker.shutdown()
        assert pool.num_free == pool.num_pages
        cache.append(other, "text", torch.randn(L, 4, H, D), torch.randn(L, 4, H, D))


# ---------------------------------------------------------------------- copies vs the cache
def test_promote_never_races_a_prefetch_in_flight(tmp_path, monkeypatch):
    """A prefetch has read its group and is held before it lands; meanwhile the group is
    attached (a promotion would read it again and move it up) and attended. The host copy the
    prefetch makes must end as the group's, never as bytes no group accounts for."""
    # demote: the cascade pushes the first image down to disk
    with TieredKVCache(make_cfg(tmp_path, put_placement="demote")) as cache:
        keys = cascade(cache, 6)
        cache.flush()
        first = keys[0]
        assert cache.index.groups[first].tier == Tier.DISK
        disk = cache.lower.disk
        landed, go = threading.Event(), threading.Event()
        real_get = disk.get_async

        async def held_get(key, *a, out=None, **kw):
            got = await real_get(key, *a, out=out, **kw)
            if key == first and out is not None:          # the prefetch's restore into host slots
                landed.set()
                await asyncio.get_running_loop().run_in_executor(None, go.wait, WAIT)
            return got

        monkeypatch.setattr(disk, "get_async", held_get)
        try:
            assert cache.prefetch(first)
            assert landed.wait(WAIT)
            seq, logical = cache.create_sequence(), Logical()
            cache.attach(seq, first)
            logical.add(*image_kv(0), "img0")
            check(cache, seq, logical, 0)
        finally:
            go.set()
        cache.flush()
        host_accounted(cache)
        check(cache, seq, logical, 1)
        cache.release(seq)
        cache.flush()
        host_accounted(cache)


def test_a_background_spill_never_takes_the_host_copy_an_attention_reads(tmp_path, monkeypatch):
    """Image 0 sits on the host, unreferenced, its background spill in flight; the device is
    held by referenced groups, so attaching image 0 leaves it below. Held: the moment the mover
    would drop the host copy (before the cache learns of the spill). The attention over it must
    still equal the oracle (it failed with "host copy vanished")."""
    # demote: the cascade pushes images 0 and 1 down to the host, 0 on to disk
    with TieredKVCache(make_cfg(tmp_path, put_placement="demote")) as cache:
        host = cache.lower.host
        removed, go = threading.Event(), threading.Event()
        real_remove = host.remove

        def held_remove(key):
            done = real_remove(key)
            if threading.current_thread().name.startswith("mmtier-mover"):
                removed.set()
                assert go.wait(WAIT)
            return done

        monkeypatch.setattr(host, "remove", held_remove)
        keys = cascade(cache, 4)                          # 0, 1 on the host; 0 spilling
        with cache.lock:
            spilling = list(cache.lower._spilling.values())
        assert len(spilling) == 1 and cache.index.groups[keys[0]].busy == 1
        spilling[0].add_done_callback(lambda f: removed.set())
        try:
            holder = cache.create_sequence()
            cache.attach(holder, keys[2])
            cache.attach(holder, keys[3])
            assert removed.wait(WAIT)                     # written; the host copy would go now
            seq, logical = cache.create_sequence(), Logical()
            cache.attach(seq, keys[0])
            logical.add(*image_kv(0), "img0")
            assert cache.index.groups[keys[0]].tier != Tier.DEVICE
            check(cache, seq, logical, 0)
        finally:
            go.set()
        cache.flush()
        check(cache, seq, logical, 1)
        host_accounted(cache)


# ---------------------------------------------------------------------- room, all or nothing
@pytest.mark.parametrize("refusing", ["host", "disk"])
def test_making_room_that_fails_half_way_changes_nothing(tmp_path, refusing):
    """Room for a 4-page image means demoting both referenced 2-page images; the lower tier
    takes the first and refuses the second (a host tier of 2 pages without disk, or a disk
    budget of one image without host): the first comes back, nothing moved."""
    over = (dict(host_pages=2, disk=False) if refusing == "host"
            else dict(host_pages=0, disk_bytes=2 * VISION_PAGE))
    with TieredKVCache(make_cfg(tmp_path, **over)) as cache:
        keys = cascade(cache, 2)
        seq, logical = cache.create_sequence(), Logical()
        for i, key in enumerate(keys):
            cache.attach(seq, key)
            logical.add(*image_kv(i), f"img{i}")
        pool = cache.pools["vision"]
        pages = {k: list(cache.index.groups[k].pages) for k in keys}
        before = cache.stats()
        big = cache.content_key("vision", b"big")
        with pytest.raises(CapacityError):
            cache.put(big, *image_kv(5, n=128))
        assert not cache.contains(big)
        assert {k: list(cache.index.groups[k].pages) for k in keys} == pages
        assert all(cache.index.groups[k].tier == Tier.DEVICE and cache.index.groups[k].busy == 0 for k in keys)
        assert pool.num_used == 4
        after = cache.stats()
        assert after.counters.get("spills", 0) == before.counters.get("spills", 0)
        if refusing == "host":
            assert cache.lower.host.used_bytes == 0
        else:
            assert cache.lower.disk.used_bytes == 0 and cache.lower.disk.inventory() == []
            assert [p for p in (tmp_path / "spill").rglob("*") if p.is_file()] == []
        check(cache, seq, logical, 1)


# ---------------------------------------------------------------------- eight threads
THREADS, ROUNDS, IMAGES = 8, 10, 12


def _conversation(cache, rng: random.Random, tally: dict, lock: threading.Lock) -> None:
    for _ in range(ROUNDS):
        seq, logical = cache.create_sequence(tenant="acme"), Logical()
        try:
            n = rng.randrange(3, 20)
            k, v = torch.randn(L, n, H, D), torch.randn(L, n, H, D)
            cache.append(seq, "text", k, v)
            logical.add(k, v, "text")
            for i in rng.sample(range(IMAGES), 2):
                key = cache.content_key("vision", f"shared{i}".encode(), tenant="acme")
                for _attempt in range(5):                 # dropped between put and attach: again
                    if not cache.contains(key):
                        cache.put(key, *image_kv(i))
                    try:
                        cache.attach(seq, key)
                        break
                    except UnknownKeyError:
                        continue
                else:
                    raise AssertionError(f"image {i} could not be attached")
                logical.add(*image_kv(i), f"img{i}")
                check(cache, seq, logical, rng.randrange(L), n_q=rng.randrange(1, 4))
                with lock:
                    tally["checked"] += 1
        finally:
            cache.release(seq)


def test_eight_threads_put_attach_attend_release_equal_the_oracle_and_leak_nothing(tmp_path):
    cfg = make_cfg(tmp_path, device_pages=6, host_pages=4, disk_bytes=24 * 2 * VISION_PAGE)
    spill = tmp_path / "spill"
    with TieredKVCache(cfg) as cache:
        tally = {"checked": 0}
        lock = threading.Lock()
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            try:
                _conversation(cache, random.Random(seed), tally, lock)
            except BaseException as exc:                  # surfaced below, with its traceback
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)                                   # the watchdog: a deadlock fails here
        if any(t.is_alive() for t in threads):
            faulthandler.dump_traceback(file=sys.stderr)
            pytest.fail("threads still running after 120 s: a deadlock")
        if errors:
            raise errors[0]
        assert tally["checked"] == THREADS * ROUNDS * 2  # every answer, each equal to the oracle
        cache.flush()
        host_accounted(cache)
        assert cache.stats().sequences == 0
        for pool in cache.pools.values():                 # only cached groups hold device pages
            held = sum(len(g.pages) for g in cache.index.groups.values()
                       if g.tier == Tier.DEVICE and g.modality == pool.spec.name)
            assert pool.num_used == held
        assert all(g.pins == 0 and g.busy == 0 and g.refs == 0 for g in cache.index.groups.values())
        with cache.lock:                                 # evict everything the policy's way
            for g in list(cache.index.groups.values()):
                cache.residency.drop(g)
        cache.flush()
        assert all(p.num_free == p.num_pages for p in cache.pools.values())
        assert cache.lower.host.used_bytes == 0
        assert cache.lower.disk.used_bytes == 0 and cache.lower.disk.inventory() == []
        assert [p for p in spill.rglob("*") if p.is_file()] == []
        assert not cache.lower.staging._out
        c = cache.stats().counters
        assert c.get("corrupt_reads", 0) == 0 and c.get("spills", 0) > 0


# ---------------------------------------------------------------------- structure
@pytest.mark.parametrize("module", ["tiers/lower.py", "attention/streaming.py", "attention/plan.py"])
def test_what_the_cache_composes_does_not_import_it(module):
    tree = ast.parse((Path(__file__).parents[2] / "mmtier" / module).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "cache" not in imported and "mmtier.cache" not in imported
    reaches = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and isinstance(n.value, ast.Attribute) and n.value.attr == "cache"}
    assert reaches == set()


def test_the_cache_is_a_facade_over_parts_that_do_not_import_it(tmp_path):
    """``TieredKVCache`` has no base class: it holds parts, one file each, that own their state;
    none of them imports the facade (or the package re-exporting it): a cycle."""
    check_facade(TieredKVCache, [CacheKeys, GroupIndex, Residency, Sequences, SharedGroups,
                                 AttentionPlanner, EngineSurface], min_parts=7,
                 reexported_by=("mmtier.cache", "cache"))
    cache = TieredKVCache(make_cfg(tmp_path))
    parts = [cache.keyer, cache.index, cache.residency, cache.seqs, cache.shared, cache.planner, cache.engine]
    assert [type(p) for p in parts] == [CacheKeys, GroupIndex, Residency, Sequences, SharedGroups,
                                        AttentionPlanner, EngineSurface]
    cache.close()
    contract = ("create_sequence", "append", "content_key", "prefix_key", "contains", "put",
                "attach", "attention", "attention_state", "put_embedding", "get_embedding",
                "release", "stats", "close", "__enter__", "__exit__")
    assert all(callable(getattr(TieredKVCache, name, None)) for name in contract)
