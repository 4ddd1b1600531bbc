"""Scenario 6: hostile input. Each is rejected with a typed error (or quarantined and counted),
never executed, never served, and leaves the cache as it was.

Injected: forged content keys (zeroed tag, a digest of other bytes under a copied tag, a key of
another server's secret, a non-key object); malformed payloads (wrong shapes, empty, NaN, Inf,
wrong dtypes, non-bytes media, a group larger than every tier); crafted files dropped into
``disk_dir`` before a (re)start: random bytes named like a group, a well-formed Arrow file whose
metadata carries a forged key, an Arrow file whose metadata checksum is wrong, a pickle whose
``__reduce__`` would create a marker file (under ``.arrow``, ``.tmp`` and ``.pkl`` names), a
symlink to a file outside, and a real group file with one payload byte flipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil

import pyarrow as pa
import pytest
import torch
import xxhash

from mmtier import (
    CapacityError,
    DTypeError,
    ForeignKeyError,
    ShapeError,
    TieredKVCache,
    UnknownKeyError,
)
from mmtier.content import ContentKey, KeyMaker, tenant_salt
from mmtier.errors import CorruptDataError, MMTierError
from mmtier.storage.arrow_format import FORMAT_VERSION, file_name

from .conftest import MODEL, SECRET, D, H, L, fingerprint, make_cfg, media, seeded_kv, tmp_files

pytestmark = pytest.mark.chaos


class _Boom:
    """Unpickling this would create ``path``: proof of execution if the file ever appears."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _snapshot(cache: TieredKVCache):
    s = cache.stats()
    return ({t: {m: (u.groups, u.pages, u.bytes) for m, u in per.items()} for t, per in s.tiers.items()},
            {k: v for k, v in s.counters.items() if k not in ("hits", "misses")}, s.sequences,
            {m: p.num_free for m, p in cache.pools.items()})


def test_forged_keys_and_bad_payloads_are_rejected_and_change_nothing(tmp_path, figures):
    cfg = make_cfg(tmp_path / "spill", device_pages=4, host_pages=2)
    rejected: dict[str, int] = {}

    def expect(exc, fn, *args, **kw):
        with pytest.raises(exc):
            fn(*args, **kw)
        rejected[exc.__name__] = rejected.get(exc.__name__, 0) + 1

    with TieredKVCache(cfg) as cache:
        good = cache.content_key("vision", media(1), tenant="acme")
        k, v = seeded_kv(1, 40)
        assert cache.put(good, k, v)
        seq = cache.create_sequence("acme")
        cache.flush()                       # the put's write-behind lands before the snapshot
        before = _snapshot(cache)
        # forged or foreign ids: the tag authenticates digest, modality, sharing and scope
        other_digest = hashlib.sha256(b"other image bytes").digest()
        forged = [
            ContentKey(good.digest, good.modality, good.sharing, good.scope, b"\0" * 32),
            ContentKey(other_digest, good.modality, good.sharing, good.scope, good.tag),
            ContentKey(good.digest, "text", good.sharing, good.scope, good.tag),
            ContentKey(good.digest, good.modality, "prefix", good.scope, good.tag),
            ContentKey(good.digest, good.modality, good.sharing, b"\1" * 16, good.tag),
            KeyMaker(MODEL, "another-servers-secret").derive(
                modality="vision", layout=cfg.spec("vision").layout_fields(),
                media=hashlib.sha256(media(1)).digest(), tenant_salt=tenant_salt("x", "acme")),
        ]
        for bad in forged:
            expect(ForeignKeyError, cache.contains, bad)
            expect(ForeignKeyError, cache.put, bad, k, v)
            expect(ForeignKeyError, cache.attach, seq, bad)
            expect(ForeignKeyError, cache.read_group, bad)
            expect(ForeignKeyError, cache.lease, bad)
        expect(ForeignKeyError, cache.contains, good.to_wire())           # not a key at all
        expect(ForeignKeyError, cache.contains, "vision:" + good.hex)
        # malformed payloads
        fresh = cache.content_key("vision", media(2), tenant="acme")
        expect(ShapeError, cache.put, fresh, k[:, :0], v[:, :0])            # empty
        expect(ShapeError, cache.put, fresh, k, v[:, :39])                  # K/V mismatch
        expect(ShapeError, cache.put, fresh, k[0], v[0])                    # missing layer dim
        expect(ShapeError, cache.put, fresh, torch.randn(L + 1, 4, H, D), torch.randn(L + 1, 4, H, D))
        expect(ShapeError, cache.put, fresh, torch.randn(L, 4, H, D + 1), torch.randn(L, 4, H, D + 1))
        expect(ShapeError, cache.put, fresh, k.numpy(), v.numpy())          # not tensors
        expect(DTypeError, cache.put, fresh, k.half(), v.half())
        expect(DTypeError, cache.put, fresh, k.double(), v.double())
        expect(DTypeError, cache.put, fresh, k.to(torch.int32), v.to(torch.int32))
        for poison in (float("nan"), float("inf"), float("-inf")):
            kp = k.clone()
            kp[1, 17, 1, 3] = poison
            expect(DTypeError, cache.put, fresh, kp, v)
            expect(DTypeError, cache.append, seq, "text", v, kp)
        expect(DTypeError, cache.content_key, "vision", "a str, not bytes", tenant="acme")
        expect(DTypeError, cache.content_key, "vision", [1, 2, 3], tenant="acme")
        expect(ForeignKeyError, cache.content_key, "vision", media(3), tenant="")
        expect(ShapeError, cache.attention, seq, 0, torch.randn(1, 4, D + 1).float(), groups=None)
        huge = 4 * 32 + 2 * 32 + 1 + (64 << 20) // (32 * 1024) * 32        # > device + host + disk
        expect(CapacityError, cache.put, fresh, *seeded_kv(9, huge))
        expect(UnknownKeyError, cache.attach, seq, fresh)                  # never stored
        assert _snapshot(cache) == before                                   # nothing changed
        assert fingerprint(*cache.read_group(good)) == fingerprint(k, v)
        figures.update(rejected_calls=sum(rejected.values()), **{f"rejected_{n}": c for n, c in rejected.items()},
                       state_changed=0, served_wrong=0)


def _arrow_with_meta(path, meta: dict, page_bytes: int, layers: int, good_sum: bool = True) -> None:
    """A well-formed file of the current format (layer-major: one batch per layer) with ``meta``."""
    blob = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    total = xxhash.xxh3_64_hexdigest(blob).encode() if good_sum else b"0" * 16
    width = page_bytes // layers
    schema = pa.schema([("page", pa.binary(width)), ("xxh3", pa.uint64())],
                       metadata={b"mmtier.meta": blob, b"mmtier.meta.xxh3": total})
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, schema) as w:
        for _ in range(layers):
            row = os.urandom(width)
            w.write_batch(pa.record_batch([pa.array([row], pa.binary(width)),
                                           pa.array([xxhash.xxh3_64_intdigest(row)], pa.uint64())], schema=schema))


def test_crafted_files_in_disk_dir_are_quarantined_never_executed(tmp_path, figures):
    spill = tmp_path / "spill"
    marker = tmp_path / "PWNED"
    # the group still on the device at close stays off disk (nor written behind): this test
    # counts the spilled two
    cfg = make_cfg(spill, device_pages=2, host_pages=0).model_copy(
        update={"persist_on_close": False, "write_behind": False})
    data = {}
    with TieredKVCache(cfg) as cache:                      # a real group on disk to tamper with
        for i in range(3):
            key = cache.content_key("vision", media(i), tenant="acme")
            data[key] = seeded_kv(i, 60)
            cache.put(key, *data[key])
        cache.flush()
        on_disk = [k for k in data if cache.index.groups[k].tier.name == "DISK"]
    assert len(on_disk) == 2
    spec = cfg.spec("vision")
    keys = KeyMaker(MODEL, SECRET)
    real = keys.derive(modality="vision", layout=spec.layout_fields(),
                       media=hashlib.sha256(b"crafted").digest(), tenant_salt=tenant_salt(SECRET, "acme"))
    boom = pickle.dumps(_Boom(str(marker)))
    crafted = {
        file_name("vision", "ab" * 32, 0, 1): os.urandom(5000),                        # not Arrow
        file_name("vision", "cd" * 32, 0, 1): boom,                                     # pickle
        "evil.pkl": boom,
        file_name("vision", "ef" * 32, 0, 1) + ".1234.tmp": boom,                       # tmp-named
        file_name("vision", real.hex, 0, 1)[:-6] + ".arrow": b"ARROW1\0\0" + boom,      # magic+pickle
    }
    for name, blob in crafted.items():
        (spill / name).write_bytes(blob)
    layout = {"name": "vision", "page_bytes": str(spec.page_bytes), **dict(spec.layout_fields())}
    meta = {"format": FORMAT_VERSION, "model": MODEL, "layout": layout, "num_tokens": 32, "num_pages": 1,
            "num_chunks": 1, "chunk": 0, "first_page": 0, "chunk_pages": 1}
    forged = ContentKey(real.digest[::-1], "vision", "content", real.scope, real.tag)   # tag of another
    _arrow_with_meta(spill / file_name("vision", forged.hex, 0, 1), {**meta, "key": forged.to_wire()},
                     spec.page_bytes, spec.page_layers)                                                   # forged key
    other_secret = KeyMaker(MODEL, "stolen-or-guessed").derive(
        modality="vision", layout=spec.layout_fields(), media=hashlib.sha256(b"x").digest(),
        tenant_salt=tenant_salt("stolen-or-guessed", "acme"))
    _arrow_with_meta(spill / file_name("vision", other_secret.hex, 0, 1),
                     {**meta, "key": other_secret.to_wire()}, spec.page_bytes, spec.page_layers)          # other secret
    bad_sum = keys.derive(modality="vision", layout=spec.layout_fields(),
                          media=hashlib.sha256(b"y").digest(), tenant_salt=tenant_salt(SECRET, "acme"))
    _arrow_with_meta(spill / file_name("vision", bad_sum.hex, 0, 1), {**meta, "key": bad_sum.to_wire()},
                     spec.page_bytes, spec.page_layers, good_sum=False)                                   # meta sum
    outside = tmp_path / "outside.arrow"
    shutil.copy(next(spill.glob(f"vision-{on_disk[0].hex}-*.arrow")), outside)
    (spill / file_name("vision", "99" * 32, 0, 1)).symlink_to(outside)                  # symlink
    victim = next(spill.glob(f"vision-{on_disk[1].hex}-*.arrow"))                       # flip a byte
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    victim.write_bytes(bytes(raw))

    with TieredKVCache(cfg) as cache:
        c = cache.stats().counters
        adopted = [k for k in data if cache.contains(k)]
        assert set(adopted) == set(on_disk)                    # both real groups indexed
        assert fingerprint(*cache.read_group(on_disk[0])) == fingerprint(*data[on_disk[0]])
        with pytest.raises(CorruptDataError):                  # the flipped one: a miss, counted
            cache.read_group(on_disk[1])
        assert not cache.contains(on_disk[1])
        c2 = cache.stats().counters
        assert c2["corrupt_reads"] == 1 and c2["disk_corrupt_reads"] == 1
        assert c2["disk_quarantined"] == 1
        # not Arrow, pickle, magic+pickle, bad metadata sum -> quarantined at start; the tmp name
        # is removed; the forged-key and other-secret files are well-formed Arrow: indexed by the
        # tier, refused by the cache (foreign_files) and never served
        assert c["disk_quarantined_at_start"] == 4
        assert c["disk_tmp_removed_at_start"] == 1
        assert c["foreign_files"] == 2
        for k in (forged, other_secret, bad_sum):
            with pytest.raises(ForeignKeyError if k is not bad_sum else UnknownKeyError):
                cache.read_group(k)
        assert cache.stats().sequences == 0
        # the symlink is not followed or adopted; the .pkl file is ignored (not a group name)
        assert (spill / file_name("vision", "99" * 32, 0, 1)).is_symlink()
        assert (spill / "evil.pkl").exists()
        assert tmp_files(spill) == []
        # the key of a real group can be recomputed and served again
        k1 = on_disk[1]
        assert cache.put(k1, *data[k1])
        assert fingerprint(*cache.read_group(k1)) == fingerprint(*data[k1])
        figures.update(crafted_files=len(crafted) + 4, flipped_files=1,
                       quarantined_at_start=c["disk_quarantined_at_start"],
                       tmp_removed=c["disk_tmp_removed_at_start"], foreign_refused=c["foreign_files"],
                       corrupt_reads=c2["corrupt_reads"], executed=int(marker.exists()), served_wrong=0)
    assert not marker.exists(), "a pickle from disk_dir was executed"
    with pytest.raises(MMTierError):
        raise ForeignKeyError("sanity: typed errors share the MMTierError base")
