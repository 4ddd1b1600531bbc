"""A prefix-dependent group is reused only under the prefix its K/V were computed after: ``attach``
and ``seal`` refuse a key derived under another prefix (``PrefixMismatchError``, nothing
changed); a content-only group attaches anywhere. The parent travels in the key (covered by its
tag) so the check holds for keys that crossed the wire."""

from __future__ import annotations

import pytest
import torch

from mmtier import CacheConfig, ContentKey, ForeignKeyError, ModalitySpec, TieredKVCache
from mmtier.errors import PrefixMismatchError

L, H, D = 2, 2, 16


@pytest.fixture
def cache():
    cfg = CacheConfig(model="tiny-mm", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
                      modalities={"text": ModalitySpec(page_size=16), "vision": ModalitySpec(page_size=32)},
                      device="cpu", device_bytes=8 << 20)
    with TieredKVCache(cfg) as c:
        yield c


def kv(n):
    return torch.randn(L, n, H, D), torch.randn(L, n, H, D)


def text(cache, seq, ids):
    cache.append(seq, "text", *kv(len(ids)), tokens=ids)


def snapshot(cache, seq):
    table = cache.sequence(seq)
    return (table.length, [s.group.gid for s in table.segments], cache.prefix_key(seq),
            {k: g.refs for k, g in cache.index.groups.items()})


def test_an_image_computed_after_other_text_is_refused(cache):
    a = cache.create_sequence(tenant="acme")
    text(cache, a, [1, 2, 3])
    img = cache.content_key("vision", b"cat.png", tenant="acme", parent=cache.prefix_key(a))
    cache.put(img, *kv(40))
    cache.attach(a, img)                                  # under its own prefix: fine
    b = cache.create_sequence(tenant="acme")
    text(cache, b, [7, 8, 9])                             # other text before the image
    before = snapshot(cache, b)
    with pytest.raises(PrefixMismatchError):
        cache.attach(b, img)
    assert snapshot(cache, b) == before                   # nothing changed
    empty = cache.create_sequence(tenant="acme")
    with pytest.raises(PrefixMismatchError):              # nor with nothing before it
        cache.attach(empty, img)
    same = cache.create_sequence(tenant="acme")
    text(cache, same, [1, 2, 3])                          # the same prefix: a hit
    cache.attach(same, img)
    assert cache.sequence(same).length == 43
    plain = cache.content_key("vision", b"cat.png", tenant="acme")
    cache.put(plain, *kv(40))
    cache.attach(b, plain)                                # content-only: anywhere
    cache.attach(empty, plain)
    assert cache.sequence(b).length == 43 and cache.sequence(empty).length == 40


def test_a_chain_of_spans_attaches_in_order_only(cache):
    seq = cache.create_sequence(tenant="acme")
    root = cache.prefix_key(seq)
    k1 = cache.content_key("text", b"span one", tenant="acme", parent=root)
    k2 = cache.content_key("vision", b"image", tenant="acme", parent=k1)
    k3 = cache.content_key("text", b"span three", tenant="acme", parent=k2)
    for k, n in ((k1, 5), (k2, 33), (k3, 4)):
        cache.put(k, *kv(n))
    skip = cache.create_sequence(tenant="acme")
    cache.attach(skip, k1)
    with pytest.raises(PrefixMismatchError):
        cache.attach(skip, k3)                            # k2 is missing before it
    cache.attach(skip, k2)
    with pytest.raises(PrefixMismatchError):
        cache.attach(skip, k2)                            # twice: its parent is k1, not k2
    cache.attach(skip, k3)
    assert cache.sequence(skip).length == 42
    after = cache.create_sequence(tenant="acme")
    cache.attach(after, k1)
    text(cache, after, [4, 4])                            # tokens after k1: k2 no longer fits
    with pytest.raises(PrefixMismatchError):
        cache.attach(after, k2)
    then = cache.content_key("vision", b"image", tenant="acme", parent=cache.prefix_key(after))
    cache.put(then, *kv(33))
    cache.attach(after, then)                             # derived under what it holds: fine


def test_seal_refuses_a_key_of_another_prefix(cache):
    seq = cache.create_sequence(tenant="acme")
    root = cache.prefix_key(seq)
    text(cache, seq, [5, 6, 7])
    other = cache.create_sequence(tenant="acme")
    text(cache, other, [9])
    wrong = cache.content_key("text", b"5 6 7", tenant="acme", parent=cache.prefix_key(other))
    with pytest.raises(PrefixMismatchError):
        cache.seal(seq, wrong)
    assert cache.sequence(seq).tail.group.key is None and not cache.contains(wrong)
    right = cache.content_key("text", b"5 6 7", tenant="acme", parent=root)
    assert cache.seal(seq, right)
    r1 = cache.reserve(seq, "vision", 33, new_run=True)   # a step of two runs, sealed in order
    r2 = cache.reserve(seq, "text", 2, new_run=True)
    for res in (r1, r2):
        for layer in range(L):
            cache.write_layer(res, layer, *(t[layer] for t in kv(res.num_tokens)))
    img = cache.content_key("vision", b"img", tenant="acme", parent=right)
    tail = cache.content_key("text", b"8 9", tenant="acme", parent=img)
    with pytest.raises(PrefixMismatchError):              # the image run follows `right`, not root
        cache.seal(seq, cache.content_key("vision", b"img", tenant="acme", parent=root), r1)
    with pytest.raises(PrefixMismatchError):
        cache.seal(seq, tail, r2)                          # the text run follows the image run,
    assert cache.seal(seq, img, r1) and cache.seal(seq, tail, r2)   # named only once sealed
    again = cache.create_sequence(tenant="acme")
    for k in (right, img, tail):                          # a new request attaches the whole chain
        cache.attach(again, k)
    assert cache.sequence(again).length == 38


def test_a_content_only_group_at_the_start_names_the_prefix(cache):
    first = cache.content_key("vision", b"opening image", tenant="acme")      # content-only
    cache.put(first, *kv(33))
    nxt = cache.content_key("text", b"after the image", tenant="acme", parent=first)
    cache.put(nxt, *kv(5))
    seq = cache.create_sequence(tenant="acme")
    cache.attach(seq, first)                              # all the sequence holds: it names it
    cache.attach(seq, nxt)
    late = cache.create_sequence(tenant="acme")
    text(cache, late, [1])
    cache.attach(late, first)                             # content-only: fine anywhere, but
    with pytest.raises(PrefixMismatchError):              # it names only itself, not [1, image]
        cache.attach(late, nxt)


def test_a_prefix_key_is_no_group_key_and_parents_are_authenticated(cache):
    seq = cache.create_sequence(tenant="acme")
    chain = cache.prefix_key(seq)
    assert chain.parent is None and chain.sharing == "prefix"
    cache.put(chain, *kv(3))
    with pytest.raises(PrefixMismatchError):
        cache.attach(seq, chain)
    img = cache.content_key("vision", b"x", tenant="acme", parent=chain)
    assert img.parent == chain.digest
    assert ContentKey.from_wire(img.to_wire()) == img     # the parent crosses the wire
    forged = ContentKey(img.digest, img.modality, img.sharing, img.scope, img.tag, b"\1" * 32)
    with pytest.raises(ForeignKeyError):
        cache.attach(seq, forged)                         # the tag covers the parent
    assert cache.content_key("vision", b"x", tenant="acme").parent is None
