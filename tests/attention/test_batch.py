"""``attention_batch`` (one call for a batch of sequences) and per-layer writes (``reserve`` /
``write_layer``), against the float64 oracle, on the device tier and with groups moved below."""

from __future__ import annotations

import pytest
import torch

from mmtier import CapacityError, ForeignKeyError, ShapeError, TieredKVCache, UnknownKeyError
from tests.cache.test_cache import build_multimodal, kv, make_cfg
from tests.support.oracle import Logical, oracle_attention, rel_err

HQ = 6          # GQA: 3 query heads per KV head


def _batch(cache, n):
    seqs, refs = [], []
    for i in range(n):
        seq, ref, *_ = build_multimodal(cache, image=b"img-%d" % i, audio=b"aud-%d" % i)
        seqs.append(seq)
        refs.append(ref)
    return seqs, refs


def _check_against_oracle(cache, seqs, refs, n_qs, layer, causal=True):
    q = torch.randn(sum(n_qs), HQ, 64)
    q_indptr = torch.tensor([0, *torch.tensor(n_qs).cumsum(0).tolist()], dtype=torch.int32)
    out, lse = cache.attention_batch_state(seqs, layer, q, q_indptr, causal=causal)
    for b, (seq, ref) in enumerate(zip(seqs, refs)):
        q0, q1 = int(q_indptr[b]), int(q_indptr[b + 1])
        if q0 == q1:                        # a sequence with no query this step
            continue
        k, v, pos = ref.gathered(layer)
        n = k.shape[0]
        q_pos = torch.arange(n - (q1 - q0), n)
        want, want_lse = oracle_attention(q[q0:q1], q_pos, k, v, pos, causal=causal)
        assert rel_err(out[q0:q1], want) < 1e-5
        assert rel_err(lse[q0:q1], want_lse) < 1e-5
        single = cache.attention(seq, layer, q[q0:q1], causal=causal)
        assert rel_err(out[q0:q1], single) < 1e-5


@pytest.mark.parametrize("layer", [0, 1])
def test_batch_of_sequences_matches_oracle_and_single_calls(layer, backend):
    with TieredKVCache(make_cfg(backend)) as cache:
        seqs, refs = _batch(cache, 3)
        _check_against_oracle(cache, seqs, refs, [1, 7, 0], layer)
        _check_against_oracle(cache, seqs, refs, [3, 3, 3], layer, causal=False)


def test_batch_with_groups_on_host_and_disk(tmp_path, backend):
    cfg = make_cfg(backend, device_bytes=2 << 20, host_bytes=1 << 20, disk_dir=tmp_path, disk_free_floor_bytes=0)
    with TieredKVCache(cfg) as cache:
        seqs, refs = _batch(cache, 4)
        cache.flush()
        tiers = {s.group.tier.name for seq in seqs for s in cache.sequence(seq).segments}
        assert len(tiers) >= 2, tiers
        _check_against_oracle(cache, seqs, refs, [2, 1, 5, 1], 1)


def test_cross_attention_groups_per_sequence(backend):
    with TieredKVCache(make_cfg(backend)) as cache:
        seqs, refs = _batch(cache, 2)
        keys = [next(k for k in cache.sequence(s).by_key if k.modality == "vision") for s in seqs]
        q = torch.randn(4, HQ, 64)
        out = cache.attention_batch(seqs, 0, q, [0, 1, 4], groups=[[keys[0]], [keys[1]]], causal=False)
        for b, (q0, q1) in enumerate([(0, 1), (1, 4)]):
            k, v, pos = refs[b].gathered(0, select={"image"})
            want, _ = oracle_attention(q[q0:q1], torch.zeros(q1 - q0), k, v, pos, causal=False)
            assert rel_err(out[q0:q1], want) < 1e-5


def test_per_layer_writes_match_append_and_check_input(backend):
    with TieredKVCache(make_cfg(backend)) as cache:
        seq = cache.create_sequence()
        ref = Logical()
        for n in (5, 20, 1, 1):             # a prefill, then appends that extend the run
            k, v = kv(n)
            res = cache.reserve(seq, "text", n, tokens=list(range(n)))
            for layer in (1, 0):            # any order; attention reads what is written
                cache.write_layer(res, layer, k[layer], v[layer])
            assert not res.open and res.group.pins == 0
            ref.add(k, v, "text")
        for layer in (0, 1):
            q = torch.randn(3, HQ, 64)
            k, v, pos = ref.gathered(layer)
            want, _ = oracle_attention(q, torch.arange(24, 27), k, v, pos)
            assert rel_err(cache.attention(seq, layer, q), want) < 1e-5
        res = cache.reserve(seq, "text", 2)
        k, v = kv(2)
        with pytest.raises(ShapeError):
            cache.write_layer(res, 0, k[0, :1], v[0, :1])
        with pytest.raises(ShapeError):
            cache.write_layer(res, 2, k[0], v[0])
        cache.write_layer(res, 0, k[0], v[0])
        with pytest.raises(ShapeError):
            cache.write_layer(res, 0, k[0], v[0])
        with pytest.raises(ShapeError):
            cache.reserve(seq, "text", 0)


def test_a_step_that_fails_part_way_gives_its_pages_back_with_its_sequence(backend):
    """A step reserves a text span as a run of its own, then an image the vision pool has no
    room for (``CapacityError``); another extends a run and writes one layer of two. Releasing
    their sequences frees every page they took (nothing stays pinned), a write to such a
    reservation is refused, and another sequence's pages and attention are untouched."""
    with TieredKVCache(make_cfg(backend)) as cache:
        vision, text = cache.pools["vision"], cache.pools["text"]
        kept = cache.create_sequence("acme")
        k0, v0 = kv(21)
        cache.append(kept, "text", k0, v0)
        used = {m: p.num_used for m, p in cache.pools.items()}
        seq = cache.create_sequence("acme")
        span = cache.reserve(seq, "text", 30, tokens=list(range(30)), new_run=True)
        with pytest.raises(CapacityError):
            cache.reserve(seq, "vision", (vision.num_pages + 1) * vision.spec.page_size, new_run=True)
        k, v = kv(30)
        cache.write_layer(span, 0, k[0], v[0])            # the forward failed after one layer
        other = cache.create_sequence("acme")
        cache.append(other, "text", *kv(5))
        tail = cache.reserve(other, "text", 40)            # extends its run: pins it
        cache.write_layer(tail, 1, *(t[1] for t in kv(40)))
        assert text.num_used > used["text"]
        cache.release(seq)
        cache.release(other)
        assert {m: p.num_used for m, p in cache.pools.items()} == used
        assert cache.stats().sequences == 1
        for res in (span, tail):
            assert not res.open and res.group.pins == 0
            with pytest.raises(ShapeError):
                cache.write_layer(res, 1, k[1, :res.num_tokens], v[1, :res.num_tokens])
        # every free page is usable again: the text pool's whole free room in one run
        room = cache.create_sequence("acme")
        cache.reserve(room, "text", text.num_free * text.spec.page_size, new_run=True)
        cache.release(room)
        q = torch.randn(2, HQ, 64)
        want, _ = oracle_attention(q, torch.arange(19, 21), k0[1], v0[1], torch.arange(21))
        assert rel_err(cache.attention(kept, 1, q), want) < 1e-5


def test_bad_batches_raise_typed_errors(backend):
    with TieredKVCache(make_cfg(backend)) as cache:
        seqs, _ = _batch(cache, 2)
        q = torch.randn(3, HQ, 64)
        for bad in ([0, 3], [0, 2, 1, 3][:3], [1, 2, 3], [0, 4, 3]):
            with pytest.raises(ShapeError):
                cache.attention_batch(seqs, 0, q, bad)
        with pytest.raises(ShapeError):
            cache.attention_batch(seqs, 0, q, [0, 1, 3], groups=[None])


def test_seal_turns_a_written_run_into_a_shared_group(backend):
    with TieredKVCache(make_cfg(backend)) as cache:
        seq = cache.create_sequence("acme")
        k, v = kv(9)
        key = cache.content_key("text", b"span", tenant="acme", parent=cache.prefix_key(seq))  # the prefix
        res = cache.reserve(seq, "text", 9, new_run=True)                                      # before the run
        cache.write_layer(res, 0, k[0], v[0])
        with pytest.raises(ShapeError):
            cache.seal(seq, key)                          # layer 1 not written yet
        cache.write_layer(res, 1, k[1], v[1])
        with pytest.raises(ForeignKeyError):
            cache.seal(seq, cache.content_key("text", b"span", tenant="globex"))
        assert cache.seal(seq, key)
        with pytest.raises(UnknownKeyError):
            cache.seal(seq, key)                          # its last run is shared now
        twin = cache.create_sequence("acme")
        res = cache.reserve(twin, "text", 9, new_run=True)
        for layer in (0, 1):
            cache.write_layer(res, layer, k[layer], v[layer])
        assert not cache.seal(twin, key)                  # held already: the twin's run stays private
        cache.release(twin)
        cache.release(seq)
        other = cache.create_sequence("acme")
        cache.attach(other, key)                          # stored once, no copy: still there
        q = torch.randn(2, HQ, 64)
        want, _ = oracle_attention(q, torch.arange(7, 9), k[1], v[1], torch.arange(9))
        assert rel_err(cache.attention(other, 1, q), want) < 1e-5


def test_seal_a_reserved_run_that_is_not_the_last(backend):
    """One step reserves a text span and an image as runs of their own (one forward over both);
    each is sealed from its reservation, and a sequence that attaches both attends them exactly."""
    with TieredKVCache(make_cfg(backend)) as cache:
        seq = cache.create_sequence("acme")
        (kt, vt), (ki, vi) = kv(5), kv(70)
        k_text = cache.content_key("text", b"span", tenant="acme", parent=cache.prefix_key(seq))
        text = cache.reserve(seq, "text", 5, tokens=[1, 2, 3, 4, 5], new_run=True)
        image = cache.reserve(seq, "vision", 70, new_run=True)
        k_img = cache.content_key("vision", b"img", tenant="acme", parent=k_text)
        for layer in (0, 1):
            cache.write_layer(text, layer, kt[layer], vt[layer])
        with pytest.raises(ShapeError):
            cache.seal(seq, k_img, image)                 # the image's layers are not written yet
        for layer in (0, 1):
            cache.write_layer(image, layer, ki[layer], vi[layer])
        with pytest.raises(UnknownKeyError):
            cache.seal(seq, k_img, text)                  # the text run is no vision run
        stranger = cache.create_sequence("acme")
        with pytest.raises(UnknownKeyError):
            cache.seal(stranger, k_text, text)            # not a run of that sequence
        with pytest.raises(ShapeError):
            cache.seal(seq, k_text, "the first run")
        assert cache.stats().counters.get("puts", 0) == 0            # nothing sealed by the refusals
        assert cache.seal(seq, k_text, text)
        assert cache.seal(seq, k_img, image)
        with pytest.raises(UnknownKeyError):
            cache.seal(seq, k_text, text)                 # shared now
        cache.release(seq)
        cache.release(stranger)
        other = cache.create_sequence("acme")
        cache.attach(other, k_text)
        cache.attach(other, k_img)
        q = torch.randn(3, HQ, 64)
        k = torch.cat([kt[1], ki[1]])
        v = torch.cat([vt[1], vi[1]])
        want, _ = oracle_attention(q, torch.arange(72, 75), k, v, torch.arange(75))
        assert rel_err(cache.attention(other, 1, q), want) < 1e-5
