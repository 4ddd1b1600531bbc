"""Whole-group disk reads straight into a group's token-major K and V (``DestTokens``; real
files, fresh random data, bitwise checks against the pages written, reshaped by torch): direct
and buffered, padded, unpadded and tiny files, float32 and bfloat16, a last page the group's
tokens fill only in part (its pad is read and checked, and lands nowhere: guard bytes around
every layer stay as they were), windows of any size read ahead or not, a warm restart's first
(full) read; a flipped byte is a miss, counted and quarantined; a destination that cannot take
the bytes is refused up front with ``ShapeError``, nothing read or counted. Through the cache:
``read_group`` of a disk group with and without ``out=`` (token-major, block-split, or strided
and so staged) gives the group's K and V."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from mmtier import CacheConfig, TieredKVCache
from mmtier.errors import ShapeError
from mmtier.storage import DiskTier
from mmtier.storage.dest_pages import DestTokens
from mmtier.storage.direct_reads import read_whole_direct
from mmtier.storage.staging import StagingPool
from tests.storage.test_helpers import MODEL, same_bytes
from tests.storage.test_layer_major import _drop
from tests.storage.test_layers import flip, quarantined
from tests.storage.test_whole_direct_reads import CFG, CHUNKS, direct_files, fresh_pages, key_of

GUARD = 24                                   # elements of poison after each layer's tokens


def tokens_of(pages: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: K and V ``[L, T, H, D]`` of page-major pages ``[n, L, 2, P, H, D]``."""
    n, L, _, P, H, D = pages.shape
    k = pages[:, :, 0].permute(1, 0, 2, 3, 4).reshape(L, n * P, H, D)[:, :num_tokens]
    v = pages[:, :, 1].permute(1, 0, 2, 3, 4).reshape(L, n * P, H, D)[:, :num_tokens]
    return k.contiguous(), v.contiguous()


def guarded(spec, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A poisoned ``[L, T, H, D]`` whose layers lie ``GUARD`` rows apart in one buffer, so a
    byte written past a layer's tokens lands in the guard; its buffer for checking."""
    L, _, _, H, D = spec.page_shape
    buf = torch.full((L, num_tokens + GUARD, H, D), float("nan"), dtype=spec.torch_dtype)
    return buf[:, :num_tokens], buf


def guards_intact(buf: torch.Tensor, num_tokens: int) -> bool:
    return bool(torch.isnan(buf[:, num_tokens:].float()).all())


def written(tmp_path, modality: str, chunk: str, n: int, num_tokens: int, **kw):
    spec = CFG.spec(modality)
    kw.setdefault("chunk_bytes", CHUNKS[chunk] * spec.page_bytes)
    disk = DiskTier(tmp_path, model=MODEL, capacity_bytes=1 << 30, **kw)
    pages, key = fresh_pages(spec, n), key_of(spec, n)
    entry = disk.put(key, spec, num_tokens, pages)
    for name in entry.files:
        _drop(disk.dir / name)
    return disk, spec, pages, key, entry


@pytest.mark.parametrize("modality", ["f32", "bf16"])
@pytest.mark.parametrize("chunk", ["padded", "unpadded", "tiny"])
@pytest.mark.parametrize("tail", [0, 5])
def test_a_group_read_into_its_tokens_equals_what_was_written(tmp_path, modality, chunk, tail):
    n = 20
    spec = CFG.spec(modality)
    num_tokens = n * spec.page_size - tail
    disk, spec, pages, key, entry = written(tmp_path, modality, chunk, n, num_tokens)
    (k, kbuf), (v, vbuf) = guarded(spec, num_tokens), guarded(spec, num_tokens)
    dest = DestTokens(spec, k, v, n)
    assert disk.get(key, spec, MODEL, out=dest) is dest
    want_k, want_v = tokens_of(pages, num_tokens)
    assert same_bytes(k.contiguous(), want_k) and same_bytes(v.contiguous(), want_v)
    assert guards_intact(kbuf, num_tokens) and guards_intact(vbuf, num_tokens)
    st = disk.stats()
    assert st["hits"] == 1 and st["corrupt_reads"] == 0
    assert st["direct_read_files"] == (direct_files(entry) if chunk != "tiny" else 0)
    assert not disk._reads.windows._out


@pytest.mark.parametrize("window", [4096, 3 * 4096, 64 << 10, 8 << 20])
@pytest.mark.parametrize("depth", [0, 2, 5])
def test_windows_of_any_size_land_the_same_tokens(tmp_path, window, depth):
    """Windows that end inside a page's K or V, between them, inside the frame or the pad."""
    n, spec = 13, CFG.spec("f32")
    num_tokens = n * spec.page_size - 3
    disk, spec, pages, key, entry = written(tmp_path, "f32", "padded", n, num_tokens)
    (k, kbuf), (v, vbuf) = guarded(spec, num_tokens), guarded(spec, num_tokens)
    dest = DestTokens(spec, k, v, n)
    windows = StagingPool(64 << 20)
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        for name, extent in zip(entry.files, entry.extents):
            got = read_whole_direct(str(disk.dir / name), extent, dest, windows,
                                    ex if depth else None, window=window, depth=depth)
            assert got == extent.pages
    want_k, want_v = tokens_of(pages, num_tokens)
    assert same_bytes(k.contiguous(), want_k) and same_bytes(v.contiguous(), want_v)
    assert guards_intact(kbuf, num_tokens) and guards_intact(vbuf, num_tokens)
    assert not windows._out


def test_buffered_reads_and_a_warm_restart_land_the_same_tokens(tmp_path):
    n, spec = 11, CFG.spec("bf16")
    num_tokens = n * spec.page_size - 9
    disk, spec, pages, key, entry = written(tmp_path, "bf16", "padded", n, num_tokens, direct_reads=False)
    want_k, want_v = tokens_of(pages, num_tokens)
    (k, kbuf), (v, vbuf) = guarded(spec, num_tokens), guarded(spec, num_tokens)
    assert disk.get(key, spec, MODEL, out=DestTokens(spec, k, v, n)) is not None
    assert disk.stats()["direct_read_files"] == 0
    assert same_bytes(k.contiguous(), want_k) and same_bytes(v.contiguous(), want_v)
    assert guards_intact(kbuf, num_tokens) and guards_intact(vbuf, num_tokens)
    disk.close()
    again = DiskTier(tmp_path, model=MODEL, capacity_bytes=1 << 30, chunk_bytes=CHUNKS["padded"] * spec.page_bytes)
    assert again.info(key).extents is None               # layout not known yet: a full read
    (k, kbuf), (v, vbuf) = guarded(spec, num_tokens), guarded(spec, num_tokens)
    assert again.get(key, spec, MODEL, out=DestTokens(spec, k, v, n)) is not None
    assert same_bytes(k.contiguous(), want_k) and same_bytes(v.contiguous(), want_v)
    assert guards_intact(kbuf, num_tokens) and guards_intact(vbuf, num_tokens)
    assert again.info(key).extents is not None           # learnt: the next read is lean


@pytest.mark.parametrize("where", ["layer", "frame"])
def test_a_flipped_byte_under_a_token_read_is_a_miss_and_quarantined(tmp_path, where):
    n, spec = 20, CFG.spec("bf16")
    disk, spec, pages, key, entry = written(tmp_path, "bf16", "padded", n, n * spec.page_size - 1)
    extent, path = entry.extents[1], disk.dir / entry.files[1]
    at = extent.offsets[2] + extent.layer_bytes + 7 if where == "layer" else extent.gaps()[-1][0] + 3
    flip(path, at)
    _drop(path)
    k, _ = guarded(spec, n * spec.page_size - 1)
    v, _ = guarded(spec, n * spec.page_size - 1)
    assert disk.get(key, spec, MODEL, out=DestTokens(spec, k, v, n)) is None
    assert disk.stats()["corrupt_reads"] == 1 and disk.stats()["hits"] == 0
    assert quarantined(disk.dir) and not disk.contains(key)
    assert not disk._reads.windows._out


def test_a_destination_that_cannot_take_the_tokens_is_refused_up_front(tmp_path):
    n, spec = 6, CFG.spec("f32")
    T = n * spec.page_size
    disk, spec, pages, key, entry = written(tmp_path, "f32", "padded", n, T)
    L, _, _, H, D = spec.page_shape
    ok = torch.empty(L, T, H, D, dtype=spec.torch_dtype)
    bad = {
        "dtype": torch.empty(L, T, H, D, dtype=torch.bfloat16),
        "heads transposed": torch.empty(L, T, D, H, dtype=spec.torch_dtype).transpose(2, 3),
        "too few tokens": torch.empty(L, T - spec.page_size, H, D, dtype=spec.torch_dtype),
        "layers": torch.empty(L + 1, T, H, D, dtype=spec.torch_dtype),
    }
    for t in bad.values():
        with pytest.raises(ShapeError):
            DestTokens(spec, t, ok, n)
    more = torch.empty(L, T + spec.page_size, H, D, dtype=spec.torch_dtype)
    with pytest.raises(ShapeError):                        # a group of another page count
        disk.get(key, spec, MODEL, out=DestTokens(spec, more, more.clone(), n + 1))
    st = disk.stats()
    assert st["hits"] == 0 and st["misses"] == 0 and st["corrupt_reads"] == 0 and disk.contains(key)


@pytest.mark.parametrize("out", ["none", "tokens", "blocks", "strided"])
def test_read_group_of_a_disk_group_gives_its_kv(tmp_path, out):
    cfg = CacheConfig(model=MODEL, num_layers=3, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                      modalities={"text": {"page_size": 16}}, device="cpu", key_secret="token-reads",
                      device_bytes=1 << 20, host_bytes=1 << 20, disk_dir=str(tmp_path / "disk"),
                      disk_bytes=1 << 30, disk_free_floor_bytes=0)
    T = 8 * 16 - (0 if out == "blocks" else 5)              # blocks: whole pages only
    with TieredKVCache(cfg) as cache:
        data = {}
        for i in range(14):                                  # 8 pages each: past device and host
            key = cache.content_key("text", f"doc{i}".encode())
            data[key] = (torch.randn(3, T, 2, 64).to(torch.bfloat16), torch.randn(3, T, 2, 64).to(torch.bfloat16))
            cache.put(key, *data[key])
        cache.flush()
        on_disk = [key for key, tier, _ in cache.inventory() if tier == "disk"]
        assert len(on_disk) >= 2
        for key in on_disk[:2]:
            k, v = data[key]
            L, _, H, D = k.shape
            if out == "none":
                got = cache.read_group(key)
            elif out == "tokens":
                got = cache.read_group(key, out=(torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))))
            elif out == "blocks":
                blocks = [torch.full((L, T // 16, 16, H, D), float("nan"), dtype=k.dtype) for _ in range(2)]
                got = tuple(t.view(L, T, H, D) for t in cache.read_group(key, out=tuple(blocks)))
            else:                                            # heads-major memory: staged
                strided = [torch.full((L, H, T, D), float("nan"), dtype=k.dtype).transpose(1, 2) for _ in range(2)]
                got = cache.read_group(key, out=tuple(strided))
            assert torch.equal(got[0], k) and torch.equal(got[1], v)
