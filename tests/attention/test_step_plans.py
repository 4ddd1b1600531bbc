"""A batch's attention plan is made at one layer of a step and reused by its other layers
(``step_plans``): every layer still equals the float64 oracle, and a plan is not reused once a
sequence grew, a group left the device, or a sequence was released."""

from __future__ import annotations

import torch

from mmtier import TieredKVCache
from mmtier.core.groups import Tier
from tests.cache.test_cache import build_multimodal, kv, make_cfg
from tests.cache.test_tiers import D as TIERS_D
from tests.cache.test_tiers import H as TIERS_H
from tests.cache.test_tiers import make_cfg as tiers_cfg
from tests.support.oracle import Logical, oracle_attention, rel_err

HQ = 6


def _check(cache, seqs, refs, layer, n_qs):
    q = torch.randn(sum(n_qs), HQ, 64)
    bounds = [0, *torch.tensor(n_qs).cumsum(0).tolist()]
    out = cache.attention_batch(seqs, layer, q, bounds)
    for b, ref in enumerate(refs):
        k, v, pos = ref.gathered(layer)
        n = k.shape[0]
        q0, q1 = bounds[b], bounds[b + 1]
        want, _ = oracle_attention(q[q0:q1], torch.arange(n - (q1 - q0), n), k, v, pos)
        assert rel_err(out[q0:q1], want) < 1e-5


def test_decode_steps_reuse_the_first_layers_plan_and_equal_the_oracle(backend):
    with TieredKVCache(make_cfg(backend)) as cache:
        seqs, refs = [], []
        for i in range(2):
            seq, ref, *_ = build_multimodal(cache, image=b"img-%d" % i, audio=b"aud-%d" % i)
            seqs.append(seq)
            refs.append(ref)
        layers = cache.cfg.num_layers
        for _ in range(3):                        # steps: one new token per sequence each
            before = cache.engine.steps.reuses
            new = [kv(1) for _ in seqs]
            runs = [cache.reserve(seq, "text", 1) for seq in seqs]
            for layer in range(layers):
                for res, (k, v) in zip(runs, new):
                    cache.write_layer(res, layer, k[layer], v[layer])
                if layer == 0:
                    for ref, (k, v) in zip(refs, new):
                        ref.add(k, v, "text")
                _check(cache, seqs, refs, layer, [1, 1])
            assert cache.engine.steps.reuses - before == layers - 1      # planned once a step
        # a prefill of 3 queries in one sequence: another batch, planned apart
        before = cache.engine.steps.reuses
        for layer in range(layers):
            _check(cache, seqs, refs, layer, [3, 1])
        assert cache.engine.steps.reuses - before == layers - 1
        # tokens appended between two layers: the kept plan no longer matches
        _check(cache, seqs, refs, 0, [1, 1])
        k, v = kv(4)
        cache.append(seqs[1], "text", k, v)
        refs[1].add(k, v, "text")
        before = cache.engine.steps.reuses
        _check(cache, seqs, refs, 1, [1, 1])
        assert cache.engine.steps.reuses == before
        for seq in seqs:
            cache.release(seq)
        assert not cache.engine.steps._plans                 # released: their plans are gone


def test_a_group_that_left_the_device_between_layers_is_planned_again(tmp_path, backend):
    """Layer 0 keeps a plan over a device group; other groups push it to a lower tier before
    layer 1, which then reads it where it is now (not through the kept plan)."""
    with TieredKVCache(tiers_cfg(backend, tmp_path, device_pages=4, host_pages=4)) as cache:
        seq = cache.create_sequence()
        ref = Logical()
        key = cache.content_key("vision", b"first")
        k, v = kv(60, heads=TIERS_H, dim=TIERS_D)
        cache.put(key, k, v)
        cache.attach(seq, key)
        ref.add(k, v, "vision")
        q = torch.randn(2, 2 * TIERS_H, TIERS_D)

        def check(layer):
            kk, vv, pos = ref.gathered(layer)
            n = kk.shape[0]
            want, _ = oracle_attention(q, torch.arange(n - 2, n), kk, vv, pos)
            assert rel_err(cache.attention_batch([seq], layer, q, [0, 2]), want) < 1e-5

        check(0)
        group = cache.sequence(seq).segments[0].group
        assert group.tier == Tier.DEVICE and cache.engine.steps._plans
        busy = cache.create_sequence()           # another request's images, more than the device holds
        for i in range(4):
            other = cache.content_key("vision", b"other-%d" % i)
            cache.put(other, *kv(60, heads=TIERS_H, dim=TIERS_D))
            cache.attach(busy, other)
        cache.flush()
        assert group.tier != Tier.DEVICE
        before = cache.engine.steps.reuses
        check(1)
        assert cache.engine.steps.reuses == before
        cache.release(seq)
        cache.release(busy)
