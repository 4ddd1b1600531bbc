"""Content keys: adversarial pairs never collide, chains bind every ancestor, keys authenticate."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mmtier import content
from mmtier.config import CacheConfig
from mmtier.content import (
    KEY_FORMAT_VERSION,
    ContentKey,
    KeyMaker,
    encode_fields,
    media_digest,
    tenant_salt,
    tenant_scope,
)
from mmtier.errors import ForeignKeyError

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SECRET = "s3cret"
MODEL = "tiny-mm"
CFG = CacheConfig(model=MODEL, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32",
                  modalities={"text": {"page_size": 16}, "vision": {"page_size": 64},
                              "audio": {"page_size": 32},
                              "vision_embed": {"kind": "embedding", "page_size": 64, "width": 64}},
                  device="cpu", device_bytes=64 << 20)
LAYOUT = CFG.modalities["vision"].layout_fields()

blobs = st.binary(min_size=0, max_size=64)
names = st.text(min_size=1, max_size=12)
tenants = st.text(min_size=1, max_size=16)
param_values = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=8), st.booleans(),
                         st.tuples(st.integers(0, 4096), st.integers(0, 4096)))
params_st = st.dictionaries(st.text(min_size=1, max_size=8), param_values, max_size=4)


def key(media: bytes = b"img", *, modality: str = "vision", tenant: str = "acme", km: KeyMaker | None = None,
        layout=LAYOUT, params=None, parent: ContentKey | None = None, secret: str = SECRET) -> ContentKey:
    km = km or KeyMaker(MODEL, secret)
    return km.derive(modality=modality, layout=layout, media=media_digest(media, params),
                     tenant_salt=tenant_salt(secret, tenant), parent=parent)


# ------------------------------------------------------------------------- full-width keys
@FAST
@given(blobs, tenants)
def test_keys_are_full_sha256(media, tenant):
    k = key(media, tenant=tenant)
    assert isinstance(k.digest, bytes) and len(k.digest) == 32
    assert len(k.tag) == 32 and len(k.scope) == 16
    assert len(k.hex) == 64 and bytes.fromhex(k.hex) == k.digest
    assert str(k) == f"vision:{k.hex}"
    assert k.to_wire()["digest"] == k.hex


def test_digest_is_sha256_of_the_documented_encoding():
    digest = media_digest(b"pixels", {"size": 336})
    salt = tenant_salt(SECRET, "acme")
    k = KeyMaker(MODEL, SECRET).derive(modality="vision", layout=LAYOUT, media=digest, tenant_salt=salt)
    fields = [("version", str(KEY_FORMAT_VERSION)), ("model", MODEL),
              *((f"layout.{n}", v) for n, v in LAYOUT), ("modality", "vision"), ("media", digest),
              ("tenant", salt), ("sharing", "content")]
    assert k.digest == hashlib.sha256(encode_fields(content._DOMAIN, fields)).digest()
    assert k.sharing == "content" and k.scope == tenant_scope(salt)


def test_contentkey_refuses_short_fields():
    k = key()
    with pytest.raises(ValueError):
        dataclasses.replace(k, digest=k.digest[:16])
    with pytest.raises(ValueError):
        dataclasses.replace(k, tag=k.tag[:31])
    with pytest.raises(ValueError):
        dataclasses.replace(k, scope=k.scope + b"x")
    with pytest.raises(ValueError):
        dataclasses.replace(k, sharing="both")


# ---------------------------------------------------------------------------- determinism
@FAST
@given(blobs, tenants, params_st)
def test_deterministic_across_keymakers(media, tenant, params):
    a = key(media, tenant=tenant, params=params, km=KeyMaker(MODEL, SECRET))
    b = key(media, tenant=tenant, params=params, km=KeyMaker(MODEL, SECRET))
    assert a == b and hash(a) == hash(b) and a.tag == b.tag
    KeyMaker(MODEL, SECRET).verify(a)
    assert media_digest(bytearray(media), params) == media_digest(memoryview(media), params) == \
        media_digest(media, dict(reversed(list(params.items()))))


def test_media_must_be_bytes():
    with pytest.raises(TypeError):
        media_digest("not bytes")   # type: ignore[arg-type]


# ------------------------------------------------------------------------ adversarial pairs
@FAST
@given(blobs, st.sampled_from(sorted(CFG.modalities)), st.sampled_from(sorted(CFG.modalities)))
def test_same_bytes_other_modality(media, m1, m2):
    assume(m1 != m2)
    a = key(media, modality=m1, layout=CFG.modalities[m1].layout_fields())
    b = key(media, modality=m2, layout=CFG.modalities[m2].layout_fields())
    assert a.digest != b.digest
    # even with an identical layout, the modality name alone separates them
    assert key(media, modality=m1).digest != key(media, modality=m2).digest


@FAST
@given(blobs, tenants, tenants)
def test_same_bytes_other_tenant(media, t1, t2):
    assume(t1 != t2)
    a, b = key(media, tenant=t1), key(media, tenant=t2)
    assert a.digest != b.digest and a.scope != b.scope
    assert tenant_salt(SECRET, t1) != tenant_salt(SECRET, t2)


@FAST
@given(blobs, names, names)
def test_same_bytes_other_model(media, m1, m2):
    assume(m1 != m2)
    assert key(media, km=KeyMaker(m1, SECRET)).digest != key(media, km=KeyMaker(m2, SECRET)).digest


def test_same_bytes_other_secret_other_salt():
    assert tenant_salt("a", "acme") != tenant_salt("b", "acme")
    assert key(b"x", secret="a").digest != key(b"x", secret="b").digest


@pytest.mark.parametrize("index", range(len(LAYOUT)))
@FAST
@given(media=blobs, value=st.text(max_size=8))
def test_same_bytes_other_layout_field(index, media, value):
    name, old = LAYOUT[index]
    assume(value != old)
    changed = tuple((n, value if i == index else v) for i, (n, v) in enumerate(LAYOUT))
    assert key(media, layout=changed).digest != key(media).digest


@pytest.mark.parametrize("change", [
    {"page_size": 32}, {"num_layers": 3}, {"num_kv_heads": 1}, {"head_dim": 80}, {"dtype": "float16"},
    {"dtype": "bfloat16"},
])
def test_layout_of_real_specs(change):
    """Each layout field of a real (resolved) spec enters the key."""
    spec = CFG.modalities["vision"]
    other = spec.model_copy(update=change)
    assert other.layout_fields() != spec.layout_fields()
    assert key(layout=other.layout_fields()).digest != key(layout=spec.layout_fields()).digest


def test_embedding_and_kv_layouts_differ():
    kv = CFG.modalities["vision"].layout_fields()
    emb = CFG.modalities["vision_embed"].layout_fields()
    assert key(modality="v", layout=kv).digest != key(modality="v", layout=emb).digest


@FAST
@given(blobs, params_st, params_st)
def test_preprocessing_params(media, p1, p2):
    assume({k: repr(v) for k, v in p1.items()} != {k: repr(v) for k, v in p2.items()})
    assert media_digest(media, p1) != media_digest(media, p2)
    assert key(media, params=p1).digest != key(media, params=p2).digest


def test_params_types_and_absence():
    raw = b"pixels"
    assert media_digest(raw, {"size": 336}) != media_digest(raw, {"size": "336"})
    assert media_digest(raw, {"size": 336}) != media_digest(raw, {"size": 336.0})
    assert media_digest(raw, {"size": (336, 336)}) != media_digest(raw, {"size": [336, 336]})
    assert media_digest(raw, None) == media_digest(raw, {})
    assert media_digest(raw, {}) != hashlib.sha256(raw).digest()   # domain-separated, not the raw hash


@FAST
@given(blobs, blobs)
def test_other_bytes_other_key(m1, m2):
    assume(m1 != m2)
    assert media_digest(m1) != media_digest(m2)
    assert key(m1).digest != key(m2).digest


def test_params_with_large_arrays_do_not_collide():
    np = pytest.importorskip("numpy")
    a, b = np.arange(5000), np.arange(5000)
    b[2500] = -1
    with pytest.raises(TypeError):          # arrays are refused: their repr is abbreviated
        media_digest(b"x", {"mask": a})
    assert media_digest(b"x", {"mask": a.tolist()}) != media_digest(b"x", {"mask": b.tolist()})


# -------------------------------------------------------------------------- field boundaries
@pytest.mark.parametrize("left,right", [("org_1", "2345"), ("org_", "12345"), ("", "org_12345")])
def test_boundary_shift_tenant_and_model(left, right):
    whole = left + right
    # tenant strings
    assert key(tenant=left + right).digest != key(tenant=left).digest
    assert tenant_salt(SECRET, whole) != tenant_salt(SECRET, left)
    # model strings, and the model/modality boundary
    assert key(km=KeyMaker(whole, SECRET)).digest != key(km=KeyMaker(left, SECRET)).digest
    a = KeyMaker(left, SECRET).derive(modality=right + "vision", layout=(), media=b"m", tenant_salt=b"t")
    b = KeyMaker(whole, SECRET).derive(modality="vision", layout=(), media=b"m", tenant_salt=b"t")
    assert a.digest != b.digest
    # adjacent fields in the encoding
    assert encode_fields(b"d", [("model", left), ("tenant", right)]) != \
        encode_fields(b"d", [("model", whole), ("tenant", "")])


def test_adjacent_key_fields_shift():
    km = KeyMaker(MODEL, SECRET)
    a = km.derive(modality="vision", layout=LAYOUT, media=b"\x01" * 32, tenant_salt=b"\x02" * 32)
    b = km.derive(modality="visio", layout=LAYOUT, media=b"n" + b"\x01" * 32, tenant_salt=b"\x02" * 32)
    c = km.derive(modality="vision", layout=LAYOUT, media=b"\x01" * 31, tenant_salt=b"\x01" + b"\x02" * 32)
    assert len({a.digest, b.digest, c.digest}) == 3


@FAST
@given(st.binary(min_size=1, max_size=40), st.data())
def test_shifting_bytes_between_adjacent_fields(joined, data):
    i = data.draw(st.integers(0, len(joined)))
    j = data.draw(st.integers(0, len(joined)))
    assume(i != j)
    enc = lambda k: encode_fields(b"dom", [("a", joined[:k]), ("b", joined[k:])])
    assert enc(i) != enc(j)
    # shifting between a name and its value, or between a value and the next name
    assert encode_fields(b"dom", [("a", joined[:i]), ("b" + "x", b"")]) != \
        encode_fields(b"dom", [("a", joined[:i] + b"b"), ("x", b"")])


field_lists = st.lists(st.tuples(st.text(max_size=6), st.binary(max_size=8)), max_size=5)


@FAST
@given(st.binary(max_size=6), field_lists, st.binary(max_size=6), field_lists)
def test_encode_fields_is_injective(d1, f1, d2, f2):
    same = (d1, f1) == (d2, f2)
    assert (encode_fields(d1, f1) == encode_fields(d2, f2)) == same


def test_encode_fields_lengths_are_8_byte_big_endian():
    enc = encode_fields(b"dd", [("n", "vv"), ("é", b"")])
    assert enc == (b"\0" * 7 + b"\2" + b"dd" + b"\0" * 7 + b"\1" + b"n" + b"\0" * 7 + b"\2" + b"vv"
                   + b"\0" * 7 + b"\2" + "é".encode() + b"\0" * 8)


# --------------------------------------------------------------------------------- chains
step = st.tuples(st.sampled_from(["text", "vision", "audio"]), st.binary(max_size=8))


def build_chain(steps, *, tenant="acme", km=None, root=None):
    km = km or KeyMaker(MODEL, SECRET)
    parent = root
    out = []
    for modality, media in steps:
        parent = key(media, modality=modality, tenant=tenant, km=km,
                     layout=CFG.modalities[modality].layout_fields(), parent=parent)
        out.append(parent)
    return out


@FAST
@given(st.lists(step, min_size=1, max_size=5), st.data())
def test_chained_keys_bind_every_ancestor(steps, data):
    chain = build_chain(steps)
    assert all(k.sharing == "prefix" for k in chain[1:]) and chain[0].sharing == "content"
    assert len({k.digest for k in chain}) == len(chain)
    j = data.draw(st.integers(0, len(steps) - 1), label="ancestor changed")
    new = data.draw(step, label="new step")
    assume(new != steps[j])
    other = build_chain([*steps[:j], new, *steps[j + 1:]])
    assert other[-1].digest != chain[-1].digest
    assert all(a.digest != b.digest for a, b in zip(chain[j:], other[j:]))
    assert other[:j] == chain[:j]


@FAST
@given(st.lists(step, min_size=2, max_size=5), st.data())
def test_chain_order_matters(steps, data):
    i = data.draw(st.integers(0, len(steps) - 2))
    swapped = list(steps)
    swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
    assume(swapped != steps)
    assert build_chain(steps)[-1].digest != build_chain(swapped)[-1].digest


@FAST
@given(st.lists(step, min_size=1, max_size=5), tenants, tenants)
def test_chain_under_other_tenant(steps, t1, t2):
    assume(t1 != t2)
    a, b = build_chain(steps, tenant=t1), build_chain(steps, tenant=t2)
    assert all(x.digest != y.digest for x, y in zip(a, b))


@FAST
@given(st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32), st.lists(step, max_size=4))
def test_prefix_chain_keys(c1, c2, steps):
    km = KeyMaker(MODEL, SECRET)
    salt = tenant_salt(SECRET, "acme")
    r1 = km.chain(modality="text", chain_digest=c1, tenant_salt=salt)
    r2 = km.chain(modality="text", chain_digest=c2, tenant_salt=salt)
    assert r1.sharing == "prefix" and len(r1.digest) == 32
    km.verify(r1)
    assert r1 == km.chain(modality="text", chain_digest=c1, tenant_salt=salt)
    if c1 != c2:
        assert r1.digest != r2.digest
        assert build_chain(steps + [("text", b"q")], root=r1)[-1].digest != \
            build_chain(steps + [("text", b"q")], root=r2)[-1].digest
    # a prefix-dependent key never equals the content-only key of the same media
    assert key(b"q", parent=r1).digest != key(b"q").digest
    other_tenant = km.chain(modality="text", chain_digest=c1, tenant_salt=tenant_salt(SECRET, "zeta"))
    assert other_tenant.digest != r1.digest


# ------------------------------------------------------------------------- authentication
def test_foreign_secret_or_model_is_refused():
    mine = KeyMaker(MODEL, SECRET)
    for issuer in (KeyMaker(MODEL, "other-secret"), KeyMaker("other-model", SECRET)):
        k = issuer.derive(modality="vision", layout=LAYOUT, media=media_digest(b"x"),
                          tenant_salt=tenant_salt(SECRET, "acme"))
        issuer.verify(k)
        assert not mine.is_authentic(k)
        with pytest.raises(ForeignKeyError):
            mine.verify(k)
        with pytest.raises(ForeignKeyError):
            key(b"y", km=mine, parent=k)


@FAST
@given(st.sampled_from(["digest", "tag", "scope"]), st.data())
def test_forged_bytes_are_refused(field, data):
    km = KeyMaker(MODEL, SECRET)
    k = key(b"img", km=km)
    raw = bytearray(getattr(k, field))
    i = data.draw(st.integers(0, len(raw) - 1))
    bit = data.draw(st.integers(0, 7))
    raw[i] ^= 1 << bit
    forged = dataclasses.replace(k, **{field: bytes(raw)})
    assert not km.is_authentic(forged)
    with pytest.raises(ForeignKeyError):
        km.verify(forged)
    with pytest.raises(ForeignKeyError):
        key(b"next", km=km, parent=forged)


def test_relabelled_keys_are_refused():
    km = KeyMaker(MODEL, SECRET)
    k = key(b"img", km=km)
    for forged in (dataclasses.replace(k, modality="audio"), dataclasses.replace(k, sharing="prefix"),
                   dataclasses.replace(k, scope=key(b"img", tenant="zeta").scope),
                   dataclasses.replace(k, digest=key(b"other", km=km).digest)):
        with pytest.raises(ForeignKeyError):
            km.verify(forged)


def test_non_key_is_refused():
    km = KeyMaker(MODEL, SECRET)
    with pytest.raises(ForeignKeyError):
        km.verify(key().to_wire())   # type: ignore[arg-type]
    with pytest.raises(ForeignKeyError):
        km.verify(key().digest)      # type: ignore[arg-type]


def test_parent_of_another_tenant_is_refused():
    km = KeyMaker(MODEL, SECRET)
    parent = key(b"p", tenant="acme", km=km)
    with pytest.raises(ForeignKeyError):
        key(b"c", tenant="zeta", km=km, parent=parent)
    root = km.chain(modality="text", chain_digest=b"\0" * 32, tenant_salt=tenant_salt(SECRET, "acme"))
    with pytest.raises(ForeignKeyError):
        key(b"c", tenant="zeta", km=km, parent=root)
    assert key(b"c", tenant="acme", km=km, parent=parent).sharing == "prefix"


# ---------------------------------------------------------------------------------- wire
@FAST
@given(st.lists(step, min_size=1, max_size=3), tenants)
def test_wire_round_trip(steps, tenant):
    km = KeyMaker(MODEL, SECRET)
    for k in build_chain(steps, tenant=tenant, km=km):
        wire = k.to_wire()
        assert all(isinstance(v, str) for v in wire.values())
        back = ContentKey.from_wire(json.loads(json.dumps(wire)))
        assert back == k and hash(back) == hash(k)
        km.verify(back)


def test_tampered_wire_is_refused():
    km = KeyMaker(MODEL, SECRET)
    wire = key(km=km).to_wire()
    bad = dict(wire, digest=("0" if wire["digest"][0] != "0" else "1") + wire["digest"][1:])
    with pytest.raises(ForeignKeyError):
        km.verify(ContentKey.from_wire(bad))
    with pytest.raises(ValueError):
        ContentKey.from_wire(dict(wire, digest=wire["digest"][:32]))   # truncated: refused outright
    with pytest.raises(ValueError):
        ContentKey.from_wire(dict(wire, tag="zz" * 32))
    with pytest.raises(ValueError):
        ContentKey.from_wire(dict(wire, sharing="all"))


def test_tenant_scope():
    s1, s2 = tenant_salt(SECRET, "a"), tenant_salt(SECRET, "b")
    assert len(tenant_scope(s1)) == 16 and tenant_scope(s1) != tenant_scope(s2)
    assert tenant_scope(s1) not in s1   # the scope does not reveal the salt


def test_a_state_key_is_its_groups_own_never_the_group_and_never_another_pools():
    """``KeyMaker.state``: the key of the recurrent state after a group (Qwen3-Next's Gated
    DeltaNet layers), one per state pool; authentic, in its pool's modality, the group's scope."""
    km = KeyMaker(MODEL, SECRET)
    group = key(b"img", tenant="acme", km=km)
    conv, ssm = km.state(group, "state0"), km.state(group, "state1")
    assert conv.modality == "state0" and ssm.modality == "state1"
    assert len({group.digest, conv.digest, ssm.digest}) == 3
    assert conv.scope == group.scope and conv.sharing == group.sharing and conv.parent is None
    km.verify(conv)
    assert km.state(group, "state0") == conv                       # the same group, the same key
    other = key(b"img2", tenant="acme", km=km)
    assert km.state(other, "state0").digest != conv.digest
    with pytest.raises(ForeignKeyError):                           # another secret's group
        km.state(key(b"img", tenant="acme", km=KeyMaker(MODEL, "other")), "state0")


def test_checked_keys_are_remembered_never_their_forgeries():
    # a key issued (or checked once) is authentic by a lookup from then on; a copy differing in
    # any field is still refused, one with fields that do not hash is checked by the HMAC alone,
    # and a pickled KeyMaker carries no memo
    import pickle

    km = KeyMaker(MODEL, SECRET)
    k = key(b"img", km=km)
    assert k in km._authentic
    other = key(b"img", km=KeyMaker(MODEL, SECRET))          # issued elsewhere: checked once, then held
    km._authentic.clear()
    km.verify(other)
    assert other in km._authentic and km.is_authentic(k)
    for forged in (dataclasses.replace(k, tag=bytes(32)), dataclasses.replace(k, modality="audio")):
        with pytest.raises(ForeignKeyError):
            km.verify(forged)
        assert forged not in km._authentic
    unhashable = dataclasses.replace(k, digest=bytearray(k.digest))
    assert km.is_authentic(unhashable)
    with pytest.raises(ForeignKeyError):
        km.verify(dataclasses.replace(k, digest=bytearray(32)))
    again = pickle.loads(pickle.dumps(km))
    assert not again._authentic and again.is_authentic(k)
