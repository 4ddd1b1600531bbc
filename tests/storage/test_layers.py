"""Per-layer disk reads with real files: one layer of every page, read alone and verified
against per-layer digests, equals that layer of a full read (1, 2, 3 layers; chunked groups;
run destinations); damage in the layer read is a miss and quarantined; a warm restart falls
back to one full read; ``Mover.fetch_many(layer=...)``."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from mmtier.config import CacheConfig
from mmtier.errors import ShapeError
from mmtier.storage import DiskTier, Mover
from mmtier.storage.disk_index import QUARANTINE_DIR
from tests.storage.test_helpers import KEYS, MODEL, rand_pages, same_bytes


def specs(num_layers: int):
    cfg = CacheConfig(
        model=MODEL, num_layers=num_layers, num_kv_heads=2, head_dim=24, dtype="float16",
        modalities={"text": {"page_size": 8},
                    "vision": {"page_size": 16, "num_kv_heads": 3, "head_dim": 40, "dtype": "float32"},
                    "emb": {"kind": "embedding", "page_size": 8, "width": 24}},
        device="cpu", device_bytes=1 << 20)
    return cfg.spec("text"), cfg.spec("vision"), cfg.spec("emb")


def key_of(spec, i: int):
    media = hashlib.sha256(f"{spec.name}/{i}".encode()).digest()
    return KEYS.derive(modality=spec.name, layout=spec.layout_fields(), media=media,
                       tenant_salt=b"\x01" * 32)


def tier(path, **kw) -> DiskTier:
    kw.setdefault("capacity_bytes", 1 << 30)
    return DiskTier(path, model=MODEL, **kw)


def layer_of(spec, pages: torch.Tensor, layer: int) -> torch.Tensor:
    return pages if spec.kind == "embedding" else pages[:, layer:layer + 1].contiguous()


def flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))


def quarantined(d: Path) -> list[Path]:
    q = d / QUARANTINE_DIR
    return sorted(q.iterdir()) if q.exists() else []


def byte_of(disk: DiskTier, key, page: int, layer: int, spec, within: int) -> tuple[Path, int]:
    """The file and offset of byte ``within`` of ``layer``'s slice of group page ``page``."""
    for extent in disk.info(key).extents:
        if extent.first <= page < extent.first + extent.pages:      # layer-major: one extent a layer
            at = extent.offsets[layer] + (page - extent.first) * spec.layer_bytes + within
            return disk.dir / extent.name, at
    raise AssertionError(f"page {page} not found")


@pytest.mark.parametrize("num_layers", [1, 2, 3])
@pytest.mark.parametrize("chunk_pages", [1, 3, 1000])
def test_layer_read_equals_that_layer_of_a_full_read(tmp_path, num_layers, chunk_pages):
    for spec in specs(num_layers):
        disk = tier(tmp_path / spec.name, chunk_bytes=chunk_pages * spec.page_bytes)
        pages = rand_pages(spec, 7, seed=num_layers * 10 + chunk_pages)
        k = key_of(spec, 1)
        entry = disk.put(k, spec, 7 * spec.page_size - 3, pages)
        assert len(entry.files) == -(-7 // chunk_pages)
        assert all(e.num_layers == spec.page_layers for e in entry.extents)
        full = disk.get(k, spec, MODEL)
        assert same_bytes(full, pages)
        for layer in range(spec.page_layers):
            before = disk.stats()["read_bytes"]
            got = disk.get_layer(k, spec, MODEL, layer)
            assert got.shape == (7, *spec.layer_shape)
            assert same_bytes(got, layer_of(spec, full, layer)), (spec.name, layer)
            assert disk.stats()["read_bytes"] - before == 7 * spec.layer_bytes
            out = torch.full((7, *spec.layer_shape), float("nan"), dtype=spec.torch_dtype)
            assert disk.get_layer(k, spec, MODEL, layer, out=out) is out
            assert same_bytes(out, layer_of(spec, pages, layer))
            runs = [torch.empty(n, *spec.layer_shape, dtype=spec.torch_dtype) for n in (2, 1, 4)]
            assert disk.get_layer(k, spec, MODEL, layer, out=runs) is runs
            assert same_bytes(torch.cat(runs), layer_of(spec, pages, layer))
        with pytest.raises(ShapeError):                  # the caller's errors, not corruption
            disk.get_layer(k, spec, MODEL, spec.page_layers)
        with pytest.raises(ShapeError):
            disk.get_layer(k, spec, MODEL, 0, out=torch.empty(6, *spec.layer_shape, dtype=spec.torch_dtype))
        assert disk.stats()["corrupt_reads"] == 0 and disk.contains(k)


@pytest.mark.parametrize("where", ["first_byte", "middle", "last_byte", "truncated"])
def test_damage_in_the_layer_read_is_a_miss_and_quarantined(tmp_path, where):
    text, _, _ = specs(3)
    disk = tier(tmp_path, chunk_bytes=3 * text.page_bytes)       # 7 pages in 3 files
    pages = rand_pages(text, 7, seed=31)
    k = key_of(text, 1)
    entry = disk.put(k, text, 50, pages)
    within = {"first_byte": 0, "middle": text.layer_bytes // 2, "last_byte": text.layer_bytes - 1,
              "truncated": 0}[where]
    path, at = byte_of(disk, k, 4, 1, text, within)             # page 4 (second file), layer 1
    if where == "truncated":
        path.write_bytes(path.read_bytes()[:at])
    else:
        flip(path, at)
    assert disk.get_layer(k, text, MODEL, 1) is None
    st = disk.stats()
    assert st["corrupt_reads"] == 1 and st["quarantined"] == len(entry.files) == 3 and st["hits"] == 0
    assert not disk.contains(k) and disk.used_bytes == 0
    assert len(quarantined(tmp_path)) == len(entry.files)
    assert disk.get_layer(k, text, MODEL, 1) is None and disk.stats()["misses"] == 1
    disk.put(k, text, 50, pages)                                 # the writer goes on
    assert same_bytes(disk.get_layer(k, text, MODEL, 1), pages[:, 1:2])


def test_damage_in_another_layer_leaves_the_answer_exact(tmp_path):
    """A per-layer read reads and verifies only the requested layer's bytes. A changed byte in
    another layer's slice is not read, so it cannot reach the answer: what is returned is
    exactly the bytes that were written (each checked against its layer digest). That is
    fine; the damage is found by the first read that does take those bytes (a miss then)."""
    text, _, _ = specs(3)
    disk = tier(tmp_path)
    pages = rand_pages(text, 5, seed=32)
    k = key_of(text, 1)
    disk.put(k, text, 40, pages)
    path, at = byte_of(disk, k, 2, 2, text, 7)                   # page 2, layer 2
    flip(path, at)
    for layer in (0, 1):
        got = disk.get_layer(k, text, MODEL, layer)
        assert got is not None and same_bytes(got, pages[:, layer:layer + 1])
    assert disk.stats()["corrupt_reads"] == 0
    assert disk.get_layer(k, text, MODEL, 2) is None              # the damaged layer: a miss
    assert disk.stats()["corrupt_reads"] == 1 and not disk.contains(k)


def test_frame_damage_is_found_by_the_next_whole_read(tmp_path):
    text, _, _ = specs(2)
    disk = tier(tmp_path)
    pages = rand_pages(text, 3, seed=33)
    k = key_of(text, 1)
    entry = disk.put(k, text, 20, pages)
    flip(tmp_path / entry.files[0], 3)                           # the leading magic: not a page
    assert same_bytes(disk.get_layer(k, text, MODEL, 1), pages[:, 1:2])   # the pages are intact
    assert disk.get(k, text, MODEL) is None and disk.stats()["corrupt_reads"] == 1


def test_warm_restart_falls_back_to_one_full_read_then_lean(tmp_path, monkeypatch):
    from mmtier.storage import disk_reads

    text, _, _ = specs(3)
    disk = tier(tmp_path, chunk_bytes=2 * text.page_bytes)       # 3 files for 5 pages
    pages = rand_pages(text, 5, seed=34)
    k = key_of(text, 2)
    written = disk.put(k, text, 35, pages).extents
    disk.close()
    again = tier(tmp_path, chunk_bytes=2 * text.page_bytes)
    assert again.info(k).extents is None
    runs = [torch.empty(n, *text.layer_shape, dtype=text.torch_dtype) for n in (3, 2)]
    assert again.get_layer(k, text, MODEL, 2, out=runs) is runs   # full read into a temporary
    assert same_bytes(torch.cat(runs), pages[:, 2:3])
    assert again.info(k).extents == written                       # learned: the writer's digests
    assert again.stats()["read_bytes"] == sum(e.size for e in written)

    def no_full_read(*a, **kw):
        raise AssertionError("the full read ran again")

    monkeypatch.setattr(disk_reads, "read_file", no_full_read)
    assert same_bytes(again.get_layer(k, text, MODEL, 0), pages[:, 0:1])
    assert again.stats()["read_bytes"] == sum(e.size for e in written) + 5 * text.layer_bytes
    path, at = byte_of(again, k, 3, 0, text, 1)
    flip(path, at)
    assert again.get_layer(k, text, MODEL, 0) is None and again.stats()["corrupt_reads"] == 1


def test_warm_restart_fallback_of_a_corrupt_group_is_a_miss(tmp_path):
    text, _, _ = specs(2)
    disk = tier(tmp_path)
    pages = rand_pages(text, 4, seed=35)
    k = key_of(text, 3)
    disk.put(k, text, 30, pages)
    path, at = byte_of(disk, k, 1, 1, text, 5)
    disk.close()
    flip(path, at)                                               # layer 1: the full read sees it
    again = tier(tmp_path)
    assert again.get_layer(k, text, MODEL, 0) is None
    assert again.stats()["corrupt_reads"] == 1 and len(quarantined(tmp_path)) == 1


def test_fetch_many_one_layer(tmp_path):
    text, vision, _ = specs(3)
    disk = tier(tmp_path, chunk_bytes=2 * vision.page_bytes)
    data = {}
    with Mover(None, disk, model=MODEL, max_inflight_bytes=1 << 20) as mover:
        keys = [key_of(vision, i) for i in range(4)]
        for i, k in enumerate(keys):
            data[k] = rand_pages(vision, i + 1, seed=40 + i)
            disk.put(k, vision, (i + 1) * vision.page_size, data[k])
        ghost = key_of(vision, 99)
        for layer in range(3):
            got, ok = mover.fetch_many([keys[2], ghost, keys[0], keys[3]], vision, layer=layer).result(60)
            assert ok == [True, False, True, True]
            assert got.shape == (3 + 1 + 4, *vision.layer_shape)
            want = torch.cat([data[keys[2]], data[keys[0]], data[keys[3]]])[:, layer:layer + 1]
            assert same_bytes(torch.cat([got[:3], got[3:]]), want)
        path, at = byte_of(disk, keys[0], 0, 1, vision, 9)
        flip(path, at)
        got, ok = mover.fetch_many(keys, vision, layer=0).result(60)    # other layer: exact
        assert ok == [True] * 4 and same_bytes(got[:1], data[keys[0]][:, 0:1])
        got, ok = mover.fetch_many(keys, vision, layer=1).result(60)    # this layer: a miss
        assert ok == [False, True, True, True] and not disk.contains(keys[0])
        whole, ok = mover.fetch_many(keys[1:], vision).result(60)       # no layer: whole pages
        assert ok == [True] * 3 and same_bytes(whole, torch.cat([data[k] for k in keys[1:]]))
        with pytest.raises(ShapeError):
            mover.fetch_many(keys, vision, layer=3)
