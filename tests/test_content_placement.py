"""A key's placement (its chain root's, for the cluster's registry shards) travels beside the key:
the digest and tag are bit-identical to what main derived before placements existed (pinned
below), a placement is never compared nor covered by the tag, every key derived down a chain
has its root's, and another tenant's same content has another placement."""

from __future__ import annotations

import secrets

import pytest

from mmtier.content import (
    KEY_FORMAT_VERSION,
    PLACE_BYTES,
    ContentKey,
    KeyMaker,
    placement,
    split_address,
    tenant_salt,
)

LAYOUT = [("page_size", "16"), ("layers", "2")]

# digest and tag of each key as main's content.py (before placements) derived them
PINNED = {
    "root": ("4a607b9c8ead3ed842e0bfa32473862d54c2e0d18118c66053b8726673cd015d", "51447dd86660f352b134ccf963cc49d111c417ed08b81f55bc794fcf19cb46d0"),
    "child": ("f9686eaeb9b5ece12972d057aaa1d7133b209f01bc81b9ca34ae80198a33b905", "78fb12d8d34334674ecead43c2ac9ad6b0a129183abacb8f95baed8b09bd1006"),
    "grand": ("9efd269c8c0175f198629c6bb040fbdb9f3b940d565e923e4fa9bd6b77f33edf", "3b050c1764eb66d09d8a0771171a9bf4fc3262f6ff72e5078cff63adeabde3bf"),
    "shard": ("047940aedbe1988dd22334fd5f0198c2f8b2815057bb189e057bee2798238574", "65123325a5d29bed23f1d3df2eb17791b51b67f50701108ed85477fc910e18ca"),
    "state": ("bfc9bf4449c68d1175a6ebed9dae7b56a04cbcd35cc2f8b999614f05a7444d75", "5fbc811645dfe3ffd46502e6dc10ca7475684b2f3f5a300ec5efb7fb56c81b54"),
    "chain": ("d454b5578d73443cf1176fad7b3d1074bb6731f3a588049d740a2ee381a14d1a", "6e012cb7649e421409f81b722864089046c26b9ebc2bd32ca3c64dac43e217cf"),
}


def _pinned_keys() -> dict[str, ContentKey]:
    m = KeyMaker("pin-model", "pin-secret")
    salt = tenant_salt("pin-secret", "acme")
    root = m.derive(modality="text", layout=LAYOUT, media=b"root-bytes", tenant_salt=salt)
    child = m.derive(modality="text", layout=LAYOUT, media=b"child-bytes", tenant_salt=salt, parent=root)
    grand = m.derive(modality="vision", layout=LAYOUT, media=b"img", tenant_salt=salt, parent=child)
    return {"root": root, "child": child, "grand": grand, "shard": m.shard(grand, "tp0/2"),
            "state": m.state(grand, "text"),
            "chain": m.chain(modality="text", chain_digest=b"c" * 32, tenant_salt=salt)}


def test_keys_are_bit_identical_to_mains():
    assert KEY_FORMAT_VERSION == 1
    keys = _pinned_keys()
    assert {n: (k.digest.hex(), k.tag.hex()) for n, k in keys.items()} == PINNED
    for k in keys.values():
        wire = k.to_wire()
        assert wire.pop("place") == k.placement.hex()        # beside the key, its own field
        assert wire == {"digest": k.hex, "modality": k.modality, "sharing": k.sharing, "scope": k.scope.hex(),
                        "tag": k.tag.hex(), **({"parent": k.parent.hex()} if k.parent else {})}


def test_a_chain_carries_its_roots_placement_and_the_placement_is_not_identity():
    m, salt = KeyMaker("tiny", "s"), tenant_salt("s", "acme")
    root = m.derive(modality="text", layout=LAYOUT, media=secrets.token_bytes(16), tenant_salt=salt)
    keys = [root]
    for _ in range(20):
        keys.append(m.derive(modality="text", layout=LAYOUT, media=secrets.token_bytes(16), tenant_salt=salt,
                             parent=keys[-1]))
    assert root.placement == placement(root.digest) and len(root.placement) == PLACE_BYTES
    assert {k.placement for k in keys} == {root.placement}
    assert m.shard(keys[7], "tp1/2").placement == root.placement
    assert m.state(keys[7], "text").placement == root.placement
    # not a part of the key: not its bytes, not compared, not in the tag
    assert all(root.placement not in k.digest for k in keys)
    other = ContentKey(keys[5].digest, keys[5].modality, keys[5].sharing, keys[5].scope, keys[5].tag,
                       keys[5].parent, secrets.token_bytes(PLACE_BYTES))
    assert other == keys[5] and hash(other) == hash(keys[5]) and m.is_authentic(other)
    assert ContentKey.from_wire(keys[5].to_wire()).placement == root.placement
    assert split_address(keys[5].address) == (keys[5].hex, root.placement.hex())
    assert split_address(keys[5].hex) == (keys[5].hex, None)
    # a media group is a root of its own; a wire without a placement reads as one too
    media = m.derive(modality="vision", layout=LAYOUT, media=b"img", tenant_salt=salt)
    assert media.placement == placement(media.digest) != root.placement
    bare = {k: v for k, v in keys[5].to_wire().items() if k != "place"}
    assert ContentKey.from_wire(bare).placement == placement(keys[5].digest)
    with pytest.raises(ValueError):
        ContentKey(root.digest, root.modality, root.sharing, root.scope, root.tag, None, b"short")


def test_another_tenants_same_content_has_another_placement():
    m = KeyMaker("tiny", "s")
    a = m.derive(modality="text", layout=LAYOUT, media=b"same", tenant_salt=tenant_salt("s", "a"))
    b = m.derive(modality="text", layout=LAYOUT, media=b"same", tenant_salt=tenant_salt("s", "b"))
    assert a.digest != b.digest and a.placement != b.placement
