"""HostTier: page-major slabs, byte accounting, holds, two-phase puts, in-place attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mmtier.attention.kernels import build_paged_kv, paged_attention
from mmtier.errors import (
    CapacityError,
    ClosedError,
    DTypeError,
    MMTierError,
    ShapeError,
    UnknownModalityError,
)
from mmtier.storage import HostTier
from tests.storage.test_helpers import CFG, key, rand_pages, same_bytes

TEXT, VISION, AUDIO, EMBED = (CFG.spec(m) for m in ("text", "vision", "audio", "vision_embed"))


@pytest.mark.parametrize("spec", [TEXT, VISION, AUDIO, EMBED], ids=lambda s: s.name)
def test_put_get_round_trip_is_bit_exact(spec):
    host = HostTier(64 * spec.page_bytes, pin_memory=False)
    pages = rand_pages(spec, 5, seed=1)
    k = key(spec.name, 1)
    entry = host.put(k, spec, 5 * spec.page_size - 3, pages)
    assert host.contains(k) and host.get(k) is entry
    assert entry.num_pages == 5 and entry.num_tokens == 5 * spec.page_size - 3
    assert same_bytes(entry.gather(), pages)
    view, ids = entry.view()
    assert view.shape == (64, *spec.page_shape) and ids.dtype == torch.int32
    assert same_bytes(view[ids.long()], pages)
    assert host.used_bytes == 5 * spec.page_bytes
    assert host.free_bytes == 59 * spec.page_bytes


def test_put_from_page_ids_of_a_page_major_view():
    pool = rand_pages(TEXT, 12, seed=2)
    ids = [7, 3, 4, 5, 11, 0]
    host = HostTier(16 * TEXT.page_bytes, pin_memory=False)
    entry = host.put(key("text", 1), TEXT, 6 * 16, pool, page_ids=ids)
    assert same_bytes(entry.gather(), pool[ids])


def test_put_is_idempotent_per_key():
    host = HostTier(8 * TEXT.page_bytes, pin_memory=False)
    k = key("text", 1)
    a = host.put(k, TEXT, 32, rand_pages(TEXT, 2, seed=3))
    b = host.put(k, TEXT, 32, rand_pages(TEXT, 2, seed=4))
    assert a is b and host.used_bytes == 2 * TEXT.page_bytes


def test_capacity_error_changes_nothing():
    host = HostTier(4 * TEXT.page_bytes, pin_memory=False)
    host.put(key("text", 1), TEXT, 48, rand_pages(TEXT, 3, seed=5))
    before = host.stats()
    with pytest.raises(CapacityError):
        host.put(key("text", 2), TEXT, 32, rand_pages(TEXT, 2, seed=6))
    after = host.stats()
    assert after.pop("capacity_rejects") == before.pop("capacity_rejects") + 1
    assert after == before and not host.contains(key("text", 2))
    host.put(key("text", 3), TEXT, 16, rand_pages(TEXT, 1, seed=7))  # the last page still fits


def test_budget_is_shared_across_specs():
    host = HostTier(3 * VISION.page_bytes, pin_memory=False)
    host.put(key("vision", 1), VISION, 128, rand_pages(VISION, 2, seed=8))
    n_text = VISION.page_bytes // TEXT.page_bytes
    host.put(key("text", 1), TEXT, n_text * 16, rand_pages(TEXT, n_text, seed=9))
    assert host.free_bytes == 0
    with pytest.raises(CapacityError):
        host.put(key("audio", 1), AUDIO, 32, rand_pages(AUDIO, 1, seed=10))


def test_bad_input_raises_typed_errors_and_changes_nothing():
    host = HostTier(8 * TEXT.page_bytes, pin_memory=False)
    with pytest.raises(ShapeError):
        host.put(key("text", 1), TEXT, 48, rand_pages(TEXT, 2, seed=1))
    with pytest.raises(DTypeError):
        host.put(key("text", 1), TEXT, 32, rand_pages(TEXT, 2, seed=1).float())
    with pytest.raises(UnknownModalityError):
        host.put(key("audio", 1), TEXT, 32, rand_pages(TEXT, 2, seed=1))
    with pytest.raises(ShapeError):
        host.put(key("text", 1), TEXT, 32, rand_pages(TEXT, 4, seed=1), page_ids=[0, 9])
    assert host.used_bytes == 0 and host.stats()["groups"] == 0


def test_held_slots_are_not_reused_until_released():
    host = HostTier(4 * TEXT.page_bytes, pin_memory=False)
    a = rand_pages(TEXT, 4, seed=11)
    k = key("text", 1)
    host.put(k, TEXT, 64, a)
    held = host.hold(k)
    assert host.remove(k) and not host.contains(k)
    assert host.used_bytes == 4 * TEXT.page_bytes  # still counted while the copy runs
    with pytest.raises(CapacityError):
        host.put(key("text", 2), TEXT, 16, rand_pages(TEXT, 1, seed=12))
    assert same_bytes(held.gather(), a)
    host.release(held)
    assert host.used_bytes == 0
    host.put(key("text", 2), TEXT, 64, rand_pages(TEXT, 4, seed=13))
    with pytest.raises(MMTierError):
        host.release(held)


def test_reserve_commit_abort():
    host = HostTier(4 * TEXT.page_bytes, pin_memory=False)
    k = key("text", 1)
    e = host.reserve(k, TEXT, 40)
    assert not host.contains(k) and host.used_bytes == 3 * TEXT.page_bytes
    with pytest.raises(MMTierError):
        host.reserve(k, TEXT, 40)
    host.abort(e)
    assert host.used_bytes == 0
    e = host.reserve(k, TEXT, 40)
    pages = rand_pages(TEXT, 3, seed=14)
    for r, start in zip(e.runs(), [0]):
        r.copy_(pages[start:start + r.shape[0]])
    host.commit(e)
    assert host.contains(k) and same_bytes(host.get(k).gather(), pages)


def test_trim_keeps_live_data():
    host = HostTier(64 * TEXT.page_bytes, pin_memory=False)
    keep = rand_pages(TEXT, 4, seed=15)
    host.put(key("text", 1), TEXT, 64, keep)
    host.put(key("text", 2), TEXT, 60 * 16, rand_pages(TEXT, 60, seed=16))
    host.remove(key("text", 2))
    assert host.trim() > 0
    assert same_bytes(host.get(key("text", 1)).gather(), keep)


def test_close_then_typed_error():
    host = HostTier(4 * TEXT.page_bytes, pin_memory=False)
    host.put(key("text", 1), TEXT, 16, rand_pages(TEXT, 1, seed=1))
    host.close()
    with pytest.raises(ClosedError):
        host.put(key("text", 2), TEXT, 16, rand_pages(TEXT, 1, seed=2))


def test_attention_runs_in_place_over_host_slots():
    """The slab view plus slot ids is a PagedKV operand: same result as over the pages."""
    host = HostTier(16 * TEXT.page_bytes, pin_memory=False)
    host.put(key("text", 9), TEXT, 32, rand_pages(TEXT, 2, seed=3))  # occupy slots 0, 1
    g = torch.Generator().manual_seed(0)
    pages = (torch.randn(3, *TEXT.page_shape, generator=g) * 0.5).to(TEXT.torch_dtype)
    entry = host.put(key("text", 1), TEXT, 40, pages)
    view, ids = entry.view()
    assert ids.tolist() == [2, 3, 4]
    q = torch.randn(4, 4, 64, generator=g).to(TEXT.torch_dtype)
    q_indptr = torch.tensor([0, 4], dtype=torch.int32)
    q_pos = torch.arange(36, 40, dtype=torch.int32)
    ref = paged_attention(q, q_indptr, q_pos, [build_paged_kv(pages, 1, [[([0, 1, 2], 0, 40)]])],
                          backend="torch")
    got = paged_attention(q, q_indptr, q_pos, [build_paged_kv(view, 1, [[(ids.tolist(), 0, 40)]])],
                          backend="torch")
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)


class HostAccounting(RuleBasedStateMachine):
    """Random puts, removes, holds and releases: no slot lost, none handed out twice."""

    SPECS = (TEXT, AUDIO, EMBED)

    def __init__(self):
        super().__init__()
        self.host = HostTier(24 * TEXT.page_bytes, pin_memory=False)
        self.live: dict[bytes, object] = {}
        self.held: list[object] = []
        self.n = 0

    @rule(which=st.integers(0, 2), pages=st.integers(1, 9))
    def put(self, which, pages):
        spec = self.SPECS[which]
        self.n += 1
        k = key(spec.name, self.n)
        fits = pages * spec.page_bytes <= self.host.free_bytes
        try:
            e = self.host.put(k, spec, pages * spec.page_size, rand_pages(spec, pages, self.n))
        except CapacityError:
            assert not fits
            return
        assert fits
        self.live[k.digest] = e

    @rule(data=st.data())
    def remove(self, data):
        if self.live:
            d = data.draw(st.sampled_from(sorted(self.live)))
            assert self.host.remove(self.live.pop(d).key)

    @rule(data=st.data())
    def hold(self, data):
        if self.live:
            d = data.draw(st.sampled_from(sorted(self.live)))
            self.held.append(self.host.hold(self.live[d].key))

    @rule(data=st.data())
    def release(self, data):
        if self.held:
            i = data.draw(st.integers(0, len(self.held) - 1))
            self.host.release(self.held.pop(i))

    @invariant()
    def accounting(self):
        occupying = {id(e): e for e in list(self.live.values()) + self.held}
        used = sum(e.nbytes for e in occupying.values())
        assert self.host.used_bytes == used <= self.host.capacity_bytes
        for spec in self.SPECS:
            slots = [s for e in occupying.values() if e.spec.name == spec.name for s in e.slots]
            assert len(slots) == len(set(slots)), "a slot handed out twice"
            slab = self.host._slabs.get(spec.name)
            if slab is not None:
                assert sorted(slots + slab.free) == list(range(slab.num_slots)), "a slot lost"

    def teardown(self):
        self.host.close()


TestHostAccounting = HostAccounting.TestCase
TestHostAccounting.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
