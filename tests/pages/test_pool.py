"""PagePool against a model (random operation sequences) and DeviceArena carving / memory layout."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mmtier.cache import TieredKVCache
from mmtier.config import CacheConfig
from mmtier.errors import CapacityError, ConfigError, MMTierError
from mmtier.pages.pool import DeviceArena, PagePool, resolve_arena_bytes

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def cfg_of(modalities, *, device_bytes=1 << 20, dtype="float32", layers=2, heads=2, head_dim=8):
    return CacheConfig(model="m", num_layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype=dtype,
                       modalities=modalities, device="cpu", device_bytes=device_bytes)


TINY = cfg_of({"text": {"page_size": 2}}, layers=1, heads=1, head_dim=4).modalities["text"]   # 64 B pages


def make_pool(num_pages: int, spec=TINY) -> PagePool:
    return PagePool(spec, torch.zeros(num_pages * spec.page_bytes, dtype=torch.uint8))


def free_ids(pool: PagePool) -> list[int]:
    """Drain the free list (allocate everything) and give it back: the set of free ids."""
    ids = pool.allocate(pool.num_free)
    pool.free(ids)
    return ids


# ------------------------------------------------------------------------ model-based tests
class PoolMachine(RuleBasedStateMachine):
    """The pool against a dict page -> refcount; every call that raises leaves both unchanged."""

    @initialize(num_pages=st.integers(0, 12))
    def setup(self, num_pages):
        self.pool = make_pool(num_pages)
        self.n = num_pages
        self.refs: dict[int, int] = {}

    def _held(self) -> list[int]:
        return sorted(self.refs)

    @rule(n=st.integers(0, 14))
    def allocate(self, n):
        free_before = self.pool.num_free
        if n > free_before:
            with pytest.raises(CapacityError):
                self.pool.allocate(n)
            assert self.pool.num_free == free_before          # nothing taken
            return
        ids = self.pool.allocate(n)
        assert len(ids) == n and len(set(ids)) == n
        for p in ids:
            assert 0 <= p < self.n
            assert p not in self.refs, f"page {p} handed out twice"
            self.refs[p] = 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data):
        ids = data.draw(st.lists(st.sampled_from(self._held()), min_size=1, max_size=4))   # repeats count
        self.pool.incref(ids)
        for p in ids:
            self.refs[p] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data):
        ids = data.draw(st.lists(st.sampled_from(self._held()), min_size=1, max_size=4, unique=True))
        self.pool.free(ids)
        for p in ids:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                del self.refs[p]

    @precondition(lambda self: self.n > len(self.refs))
    @rule(data=st.data())
    def free_of_free_page_raises(self, data):
        unheld = [p for p in range(self.n) if p not in self.refs]
        bad = data.draw(st.sampled_from(unheld))
        ids = [*self._held()[:2], bad]
        with pytest.raises(MMTierError):
            self.pool.free(ids)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def duplicate_free_raises(self, data):
        p = data.draw(st.sampled_from(self._held()))
        with pytest.raises(MMTierError):
            self.pool.free([p, p])

    @precondition(lambda self: self.n > len(self.refs))
    @rule(data=st.data())
    def incref_of_free_page_raises(self, data):
        bad = data.draw(st.sampled_from([p for p in range(self.n) if p not in self.refs]))
        with pytest.raises(MMTierError):
            self.pool.incref([*self._held()[:1], bad])

    @invariant()
    def counts_exact(self):
        assert self.pool.num_free == self.n - len(self.refs)
        assert self.pool.num_used == len(self.refs)
        assert self.pool.page_bytes_used() == len(self.refs) * TINY.page_bytes
        for p in range(self.n):
            assert self.pool.refcount(p) == self.refs.get(p, 0)

    def teardown(self):
        # no page lost: the free ids and the held ids partition the pool
        free = free_ids(self.pool)
        assert sorted(free + list(self.refs)) == list(range(self.n))


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestPoolModel = PoolMachine.TestCase


@pytest.mark.parametrize("seed", range(3))
def test_seeded_random_loop(seed):
    rng = random.Random(seed)
    n = 200
    pool = make_pool(n)
    refs: dict[int, int] = {}
    for _ in range(3000):
        op = rng.random()
        held = list(refs)
        if op < 0.4:
            k = rng.randint(0, 30)
            if k > pool.num_free:
                with pytest.raises(CapacityError):
                    pool.allocate(k)
            else:
                for p in pool.allocate(k):
                    assert p not in refs
                    refs[p] = 1
        elif op < 0.6 and held:
            ids = rng.sample(held, min(len(held), rng.randint(1, 8)))
            pool.incref(ids)
            for p in ids:
                refs[p] += 1
        elif held:
            ids = rng.sample(held, min(len(held), rng.randint(1, 8)))
            pool.free(ids)
            for p in ids:
                refs[p] -= 1
                if not refs[p]:
                    del refs[p]
        assert pool.num_free == n - len(refs)
    assert all(pool.refcount(p) == refs.get(p, 0) for p in range(n))
    assert sorted(free_ids(pool) + list(refs)) == list(range(n))


# ---------------------------------------------------------------------- exact pool behaviour
def test_allocation_order_and_lifo_reuse():
    pool = make_pool(6)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1])
    assert pool.allocate(2) == [1, 3]          # the last freed page comes back first
    pool.free([0, 2])
    assert pool.num_free == 4 and pool.refcount(0) == 0 and pool.refcount(1) == 1


def test_capacity_error_takes_nothing():
    pool = make_pool(4)
    pool.allocate(3)
    with pytest.raises(CapacityError):
        pool.allocate(2)
    assert pool.num_free == 1 and pool.allocate(1) == [3]
    with pytest.raises(CapacityError):
        pool.allocate(1)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.allocate(0) == []


def test_double_free_raises_and_changes_nothing():
    pool = make_pool(4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(MMTierError):
        pool.free([a])
    with pytest.raises(MMTierError):
        pool.free([b, a])                      # b is untouched by the failed call
    assert pool.refcount(b) == 1 and pool.num_free == 3
    pool.incref([b])
    with pytest.raises(MMTierError):
        pool.free([b, b])                      # duplicates in one call are refused ...
    assert pool.refcount(b) == 2               # ... and change nothing
    pool.free([b])
    pool.free([b])
    assert pool.num_free == 4
    pool.free([])                              # a no-op


def test_out_of_range_page_is_refused_and_changes_nothing():
    pool = make_pool(4)
    (a,) = pool.allocate(1)
    with pytest.raises(MMTierError):
        pool.free([a, 4])
    with pytest.raises(MMTierError):
        pool.incref([a, 99])
    assert pool.refcount(a) == 1 and pool.num_free == 3


def test_negative_page_id_is_refused():
    """numpy / list indexing would wrap -1 to page n-1: the pool must refuse it instead."""
    pool = make_pool(4)
    pool.allocate(4)
    with pytest.raises(MMTierError):
        pool.free([-1])
    with pytest.raises(MMTierError):
        pool.incref([-1])
    assert pool.refcount(3) == 1 and pool.num_free == 0
    with pytest.raises(CapacityError):
        pool.allocate(1)


def test_incref_with_repeated_id_counts_each_occurrence():
    pool = make_pool(4)
    (p,) = pool.allocate(1)
    pool.incref([p, p])
    assert pool.refcount(p) == 3
    for _ in range(3):
        pool.free([p])
    assert pool.refcount(p) == 0 and pool.num_free == 4


# -------------------------------------------------------------------------------- the arena
def test_arena_shares_explicit_and_equal_split():
    cfg = cfg_of({"text": {"page_size": 16, "share": 0.5}, "vision": {"page_size": 64},
                  "audio": {"page_size": 32}}, device_bytes=1 << 20)
    arena = DeviceArena(cfg)
    plan = cfg.pool_bytes(1 << 20)
    assert plan == {"text": 1 << 19, "vision": 1 << 18, "audio": 1 << 18}
    for name, spec in cfg.modalities.items():
        assert arena[name].num_pages == plan[name] // spec.page_bytes
        assert arena[name].num_free == arena[name].num_pages and arena[name].spec is spec
    assert arena.nbytes <= 1 << 20 and arena.device == torch.device("cpu")
    even = DeviceArena(cfg_of({"a": {"page_size": 16}, "b": {"page_size": 16}}, device_bytes=1 << 20))
    assert even["a"].num_pages == even["b"].num_pages == (1 << 19) // even["a"].spec.page_bytes


def test_arena_bytes_override_and_resolution():
    cfg = cfg_of({"text": {"page_size": 16}}, device_bytes=1 << 20)
    assert resolve_arena_bytes(cfg) == 1 << 20
    small = DeviceArena(cfg, arena_bytes=cfg.modalities["text"].page_bytes * 3)
    assert small["text"].num_pages == 3
    # a pool that would get no page is refused when the arena is built (issue 34: it used to build
    # and fail in the middle of a request with "0 free of 0")
    with pytest.raises(ConfigError, match="'text' pool gets 10 .* less than one page") as err:
        DeviceArena(cfg, arena_bytes=10)
    assert "device_bytes" in err.value.fields and "modalities.text" in err.value.fields
    full = DeviceArena(cfg, arena_bytes=cfg.modalities["text"].page_bytes)
    assert full["text"].num_pages == 1
    full["text"].allocate(1)
    with pytest.raises(CapacityError):
        full["text"].allocate(1)


def test_a_modality_pool_of_zero_pages_is_refused_before_anything_is_built(tmp_path):
    """A Whisper-like cache whose device_bytes leave the audio pool no page: ConfigError at
    construction, naming the pool and the bytes one page needs; no disk file is created."""
    cfg = CacheConfig(model="m", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", device="cpu",
                      modalities={"text": {"page_size": 16, "share": 0.9}, "audio": {"page_size": 64, "share": 0.1}},
                      device_bytes=24 << 10, disk_dir=str(tmp_path / "spill"), disk_free_floor_bytes=0)
    with pytest.raises(ConfigError, match=r"'audio' pool .* less than one page \(\d+ bytes: 64 tokens\)"):
        TieredKVCache(cfg)
    assert not (tmp_path / "spill").exists() or not any((tmp_path / "spill").iterdir())


def test_views_are_page_major():
    cfg = cfg_of({"text": {"page_size": 16}, "vision": {"page_size": 64, "head_dim": 12, "dtype": "bfloat16"},
                  "emb": {"kind": "embedding", "page_size": 64, "width": 24}},
                 dtype="float16", layers=3, heads=2, head_dim=8)
    arena = DeviceArena(cfg)
    t, v, e = arena["text"], arena["vision"], arena["emb"]
    assert t.view.shape == (t.num_pages, 3, 2, 16, 2, 8) and t.view.dtype == torch.float16
    assert v.view.shape == (v.num_pages, 3, 2, 64, 2, 12) and v.view.dtype == torch.bfloat16
    assert e.view.shape == (e.num_pages, 64, 24) and e.view.dtype == torch.float16
    for pool in (t, v, e):
        assert pool.num_pages > 2 and pool.device == torch.device("cpu")


def _ranges(arena: DeviceArena):
    base = arena.storage.data_ptr()
    out = {}
    for name, pool in arena.pools.items():
        if pool.num_pages == 0:
            continue
        start = pool.view.data_ptr() - base
        out[name] = (start, start + pool.num_pages * pool.spec.page_bytes)
    return out


specs_st = st.fixed_dictionaries({
    "page_size": st.sampled_from([1, 3, 16, 60, 64]),
    "head_dim": st.sampled_from([4, 8, 12, 80]),
    "dtype": st.sampled_from(["float32", "float16", "bfloat16"]),
})


@FAST
@given(st.lists(specs_st, min_size=1, max_size=4), st.integers(0, 1 << 18), st.booleans())
def test_pools_are_disjoint_inside_the_arena(specs, nbytes, with_share):
    mods = {f"m{i}": dict(s) for i, s in enumerate(specs)}
    if with_share:
        mods["m0"]["share"] = 0.4
    cfg = cfg_of(mods, layers=1, heads=1)
    plan = cfg.pool_bytes(nbytes)
    try:
        arena = DeviceArena(cfg, arena_bytes=nbytes)
    except ConfigError as err:       # a pool left without a page is refused, and only such a one
        name = err.fields[1].removeprefix("modalities.")
        assert plan[name] < cfg.modalities[name].page_bytes + 256
        return
    assert all(pool.num_pages >= 1 for pool in arena.pools.values())
    spans = sorted(_ranges(arena).values())
    for (_, e0), (s1, _) in zip(spans, spans[1:]):
        assert e0 <= s1, "pools overlap"
    assert all(0 <= s and e <= arena.storage.numel() for s, e in spans)
    for name, pool in arena.pools.items():
        # alignment (256 B) comes out of the pool's share: at most one page plus 255 B less
        used = pool.num_pages * pool.spec.page_bytes
        assert used <= plan[name] and plan[name] - used < pool.spec.page_bytes + 256
        if pool.num_pages:
            assert (pool.view.data_ptr() - arena.storage.data_ptr()) % 256 == 0
            assert pool.view.untyped_storage().data_ptr() == arena.storage.untyped_storage().data_ptr()


def test_arena_never_exceeds_its_budget():
    cfg = cfg_of({"a": {"page_size": 3, "share": 0.5}, "b": {"page_size": 3}},
                 layers=1, heads=1, head_dim=5, dtype="float16")
    assert cfg.modalities["a"].page_bytes == 60
    arena = DeviceArena(cfg, arena_bytes=1000)
    assert arena.storage.numel() <= 1000


def test_writes_to_one_pool_leave_the_others_unchanged():
    cfg = cfg_of({"text": {"page_size": 16}, "vision": {"page_size": 64, "head_dim": 12},
                  "audio": {"page_size": 3, "dtype": "float16"},
                  "emb": {"kind": "embedding", "page_size": 8, "width": 5}}, device_bytes=1 << 18)
    arena = DeviceArena(cfg)
    gen = torch.Generator().manual_seed(0)
    for target in arena.pools:
        for pool in arena.pools.values():
            pool.view.fill_(7)
        before = {n: p.view.clone() for n, p in arena.pools.items()}
        arena[target].view.copy_(torch.randn(arena[target].view.shape, generator=gen))
        for name, pool in arena.pools.items():
            if name == target:
                assert not torch.equal(pool.view, before[name])
            else:
                assert torch.equal(pool.view, before[name]), f"writing {target} changed {name}"
    # pages of one pool are disjoint too: writing page i changes only page i
    text = arena["text"].view
    text.zero_()
    text[3] = 1
    assert text.flatten(1).sum(1).nonzero().flatten().tolist() == [3]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_one_page_is_one_contiguous_chunk(dtype):
    cfg = cfg_of({"text": {"page_size": 16}, "vision": {"page_size": 60, "head_dim": 80},
                  "emb": {"kind": "embedding", "page_size": 64, "width": 96}}, dtype=dtype, device_bytes=1 << 21)
    arena = DeviceArena(cfg)
    for pool in arena.pools.values():
        view, pb = pool.view, pool.spec.page_bytes
        assert view.is_contiguous()
        for i in range(pool.num_pages):
            page = view[i]
            assert page.is_contiguous() and page.numel() * page.element_size() == pb
        if pool.num_pages > 1:
            assert view[1].data_ptr() - view[0].data_ptr() == pb
            assert view[pool.num_pages - 1].data_ptr() - view[0].data_ptr() == (pool.num_pages - 1) * pb
        # one flat byte copy of a page round-trips the page
        if pool.num_pages:
            view[0].copy_(torch.randn(view[0].shape).to(view.dtype))
            raw = view[0].view(-1).view(torch.uint8).clone()
            view[1 % pool.num_pages].view(-1).view(torch.uint8).copy_(raw)
            assert torch.equal(view[1 % pool.num_pages], view[0])
