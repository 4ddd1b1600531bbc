"""``ClusterCache``'s parts alone, without a cluster: the keys it derives (equal to a
``TieredKVCache``'s over the same config, and checked), and the sequence book (handles, tenants,
homes) over a ``Holders`` that knows no actor."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mmtier.cache import TieredKVCache
from mmtier.cluster.client_holders import Holders
from mmtier.cluster.client_keys import ClusterKeys
from mmtier.cluster.client_sequences import SequenceBook
from mmtier.cluster.settings import ClusterSettings
from mmtier.config import CacheConfig, ModalitySpec
from mmtier.core.segments import SequenceHandle
from mmtier.errors import ForeignKeyError, HolderLostError, UnknownKeyError, UnknownModalityError

CFG = CacheConfig(
    model="tiny-mm", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32",
    modalities={"text": ModalitySpec(page_size=4), "vision": ModalitySpec(page_size=8),
                "vision_embed": ModalitySpec(kind="embedding", width=12, page_size=8)},
    device="cpu", device_bytes=2 << 20, key_secret="test-secret")


def test_cluster_keys_equal_the_local_cache_keys_and_refuse_foreign_ones():
    keys = ClusterKeys(CFG)
    media = torch.randint(0, 256, (512,), dtype=torch.uint8).numpy().tobytes()
    with TieredKVCache(CFG) as local:
        for tenant in (None, "acme"):
            a = keys.content_key("vision", media, tenant=tenant)
            assert a == local.content_key("vision", media, tenant=tenant)
            child = keys.content_key("text", b"after", tenant=tenant, parent=a)
            assert child == local.content_key("text", b"after", tenant=tenant, parent=a)
    assert keys.content_key("vision", media, tenant="acme") != keys.content_key("vision", media, tenant="globex")
    other = ClusterKeys(CFG.model_copy(update={"key_secret": "another-secret"}))
    with pytest.raises(ForeignKeyError):
        keys.check(other.content_key("vision", media))
    with pytest.raises(UnknownModalityError):
        keys.check(keys.content_key("vision", media), "embedding")
    with pytest.raises(ForeignKeyError):
        keys.salt("")


def _book() -> SequenceBook:
    holders = Holders(ClusterSettings(), registry=None, loop=None)      # knows no actor
    return SequenceBook(CFG, ClusterKeys(CFG), holders, node="n0")


def test_sequence_book_creates_finds_and_forgets_handles():
    book = _book()
    seq = asyncio.run(book.create("acme"))
    assert len(book) == 1 and book.get(seq).handle == seq and seq.tenant == "acme"
    view = book.view(seq)
    assert (view.length, view.home, view.attached) == (0, None, ())
    with pytest.raises(UnknownKeyError):
        book.get(SequenceHandle(seq.id, "globex"))              # the id under another tenant
    with pytest.raises(UnknownKeyError):
        book.get(SequenceHandle(seq.id + 1, "acme"))
    with pytest.raises(UnknownKeyError):
        book.get("not a handle")
    # the prefix key of an empty sequence is the tenant's empty chain, and tenants differ
    other = asyncio.run(book.create("globex"))
    assert book.prefix_key(seq) != book.prefix_key(other)
    book.forget(book.get(seq))
    with pytest.raises(UnknownKeyError):
        book.get(seq)
    assert len(book) == 1


def test_sequence_book_refuses_bad_input_without_changing_anything():
    book = _book()
    with pytest.raises(ForeignKeyError):
        asyncio.run(book.create(""))
    assert len(book) == 0 and not book.homed
    seq = asyncio.run(book.create("acme"))
    with pytest.raises(UnknownModalityError):
        asyncio.run(book.append(seq, "vision_embed", torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)))
    with pytest.raises(HolderLostError):                         # no pool anywhere to home it on
        asyncio.run(book.append(seq, "text", torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)))
    st = book.get(seq)
    assert (st.length, st.home, st.subs) == (0, None, [])
