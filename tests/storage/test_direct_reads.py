"""Layer reads with ``O_DIRECT`` (real files on the test's file system): the writer pads every
layer's extent of at least 64 KiB to the device's logical block (smaller ones stay unpadded); a layer read into an aligned destination goes
around the page cache and is bitwise the layer; a flipped byte in it is a miss and quarantined;
an unaligned destination, a file written without the pad and a tier with ``direct_reads=False``
read buffered, bitwise the same; where the device's block is larger than the alignment, the
direct read declines and reads nothing; streamed attention through aligned staging buffers
equals the float64 oracle."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from mmtier import CacheConfig, ModalitySpec, TieredKVCache
from mmtier.core.groups import Tier
from mmtier.storage.dest_pages import DestPages
from mmtier.storage.layer_extent import (
    DIRECT_MIN_EXTENT,
    direct_align,
    read_direct,
    read_layer_extent,
)
from mmtier.storage.staging import StagingPool
from tests.storage.test_helpers import MODEL, rand_pages, same_bytes
from tests.storage.test_layer_major import _drop, _resident
from tests.storage.test_layers import flip, key_of, quarantined, specs, tier
from tests.support.oracle import oracle_attention, rel_err


def aligned_empty(n: int, shape, dtype, skew: int = 0) -> torch.Tensor:
    """``[n, *shape]`` of ``dtype`` starting ``skew`` bytes past a 4 KiB boundary."""
    nbytes = n * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + 8192, dtype=torch.uint8)
    at = (-raw.data_ptr()) % 4096 + skew
    return raw[at:at + nbytes].view(dtype).view(n, *shape)


def _written(tmp_path, name: str, direct: bool = True, n: int = 10):
    """A 3-layer group of ``n`` pages in files of 5 (a layer's extent: 75 KiB, padded)."""
    spec = specs(3)[1]
    assert 5 * spec.layer_bytes >= DIRECT_MIN_EXTENT
    disk = tier(tmp_path / name, chunk_bytes=5 * spec.page_bytes, direct_reads=direct)
    pages = rand_pages(spec, n, seed=11)
    k = key_of(spec, 4)
    entry = disk.put(k, spec, n * spec.page_size, pages)
    return disk, spec, pages, k, entry


def test_written_extents_start_on_the_device_block_and_whole_reads_are_unchanged(tmp_path):
    disk, text, pages, k, entry = _written(tmp_path, "a")
    assert disk.io_align == direct_align(os.stat(disk.dir).st_dev) >= 512
    assert len(entry.files) == 2
    for extent in entry.extents:
        assert all(off % disk.io_align == 0 for off in extent.offsets), extent.offsets
    plain, _, same, k2, e2 = _written(tmp_path, "b", direct=False)
    assert plain.io_align == 1
    assert any(off % 512 for x in e2.extents for off in x.offsets)   # not padded: Arrow's own 8s
    small_spec = specs(3)[0]                                         # 1.5 KiB a layer of a page
    small, k3 = rand_pages(small_spec, 7, seed=12), key_of(small_spec, 5)
    e3 = disk.put(k3, small_spec, 7 * small_spec.page_size, small)   # extents under 64 KiB
    assert 7 * small_spec.layer_bytes < DIRECT_MIN_EXTENT
    assert any(off % 512 for x in e3.extents for off in x.offsets)   # left unpadded
    for d, key, sp, want in ((disk, k, text, pages), (plain, k2, text, pages), (disk, k3, small_spec, small)):
        out = torch.full_like(want, 3)
        assert d.get(key, sp, MODEL, out=out) is out and same_bytes(out, want)
        layer = aligned_empty(want.shape[0], sp.layer_shape, sp.torch_dtype)
        assert d.get_layer(key, sp, MODEL, 1, out=layer) is layer
        assert same_bytes(layer, want[:, 1:2].contiguous())


def test_an_aligned_layer_read_bypasses_the_page_cache_and_equals_the_layer(tmp_path):
    disk, text, pages, k, entry = _written(tmp_path, "a")
    for layer in range(text.page_layers):
        for name in entry.files:
            _drop(disk.dir / name)
        out = aligned_empty(pages.shape[0], text.layer_shape, text.torch_dtype)
        out.view(torch.uint8).fill_(0)
        assert disk.get_layer(k, text, MODEL, layer, out=out) is out
        assert same_bytes(out, pages[:, layer:layer + 1].contiguous())
        for name, extent in zip(entry.files, entry.extents):     # read around the page cache
            assert _resident(disk.dir / name, extent.offsets[layer],
                             extent.pages * extent.layer_bytes) == 0.0, (layer, name)
    assert disk.stats()["hits"] == text.page_layers and disk.stats()["corrupt_reads"] == 0


@pytest.mark.parametrize("how", ["unaligned destination", "unpadded file", "direct off"])
def test_buffered_fallbacks_equal_the_layer_and_go_through_the_page_cache(tmp_path, how):
    disk, text, pages, k, entry = _written(tmp_path, "a", direct=how != "unpadded file")
    layer = 2
    if how == "unpadded file":
        disk.direct_reads = True      # a reader that would go direct, over files without the pad
        layer = next(i for i, off in enumerate(entry.extents[0].offsets) if off % 512)
    if how == "direct off":
        disk.direct_reads = False
    for name in entry.files:
        _drop(disk.dir / name)
    out = aligned_empty(pages.shape[0], text.layer_shape, text.torch_dtype,
                        skew=8 if how == "unaligned destination" else 0)
    assert disk.get_layer(k, text, MODEL, layer, out=out) is out
    assert same_bytes(out, pages[:, layer:layer + 1].contiguous())
    extent = entry.extents[0]
    assert _resident(disk.dir / entry.files[0], extent.offsets[layer],
                     extent.pages * extent.layer_bytes) == 1.0          # buffered: cached


def test_a_flipped_byte_in_a_directly_read_extent_is_a_miss_and_quarantined(tmp_path):
    disk, text, pages, k, entry = _written(tmp_path, "a")
    extent, path = entry.extents[1], disk.dir / entry.files[1]
    flip(path, extent.offsets[1] + extent.layer_bytes + 5)      # layer 1, second page of the file
    _drop(path)
    out = aligned_empty(pages.shape[0], text.layer_shape, text.torch_dtype)
    assert disk.get_layer(k, text, MODEL, 0, out=out) is out    # another layer: still good
    assert disk.get_layer(k, text, MODEL, 1, out=out) is None
    assert disk.stats()["corrupt_reads"] == 1 and quarantined(disk.dir) and not disk.contains(k)


def test_the_direct_read_declines_where_the_device_block_is_larger_than_the_alignment(tmp_path):
    """On tmpfs (no block device: 4 KiB assumed) the writer pads to 4 KiB; a destination 512
    bytes past a 4 KiB boundary is declined untouched, and the layer read then reads it
    buffered, bitwise the same as the direct read."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        disk, text, pages, k, entry = _written(Path(shm), "a")
        extent, path = entry.extents[0], str(disk.dir / entry.files[0])
        assert disk.io_align == direct_align(os.stat(path).st_dev) == 4096
        assert all(off % 4096 == 0 for off in extent.offsets)
        span = extent.pages * extent.layer_bytes
        buf = aligned_empty(span, (), torch.uint8).numpy()
        if read_direct(path, extent, buf, extent.offsets[0]):    # tmpfs may refuse O_DIRECT
            assert buf.tobytes() == pages[:5, 0:1].contiguous().view(torch.uint8).numpy().tobytes()
        skewed = aligned_empty(span, (), torch.uint8, skew=512).numpy()
        skewed[:] = 7
        assert not read_direct(path, extent, skewed, extent.offsets[0])
        assert (skewed == 7).all()
        dest = DestPages(text, torch.from_numpy(skewed).view(text.torch_dtype).view(5, *text.layer_shape), 5,
                         one_layer=True)
        assert read_layer_extent(path, extent, 0, dest) == 5      # the caller reads buffered
        assert skewed.tobytes() == pages[:5, 0:1].contiguous().view(torch.uint8).numpy().tobytes()
        disk.close()


def test_staging_buffers_start_on_a_page():
    pool = StagingPool(64 << 20)
    bufs = [pool.take(n) for n in (1, 5000, 3 << 20)]
    assert all(b.data_ptr() % 4096 == 0 and b.numel() >= n for b, n in zip(bufs, (1, 5000, 3 << 20)))
    for b in bufs:
        pool.give(b)
    again = pool.take(5000)
    assert pool.reused == 1 and again.data_ptr() % 4096 == 0


L, H, D = 3, 2, 32


def test_attention_streamed_with_direct_reads_equals_the_oracle(tmp_path, monkeypatch):
    """Groups on disk read per layer with ``O_DIRECT`` into the staging buffers (several
    small stream batches), every layer against the float64 oracle; the page cache holds none of
    the extents afterwards."""
    from mmtier.attention import streaming

    monkeypatch.setattr(streaming, "BATCH_BYTES", 32 * 2 * H * D * 4)
    token = 2 * L * H * D * 4
    cfg = CacheConfig(
        model="direct", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
        modalities={"text": ModalitySpec(page_size=16, share=0.5), "vision": ModalitySpec(page_size=32, share=0.5)},
        device="cpu", device_bytes=2 * 2 * 160 * token + 64, host_bytes=0,
        disk_dir=tmp_path / "spill", disk_bytes=64 << 20, disk_free_floor_bytes=0)
    gen = torch.Generator().manual_seed(5)
    data = {}
    with TieredKVCache(cfg) as cache:
        for i in range(10):
            kind, n = ("vision", 150) if i % 2 else ("text", 130)     # layer extents over 64 KiB
            k, v = torch.randn(L, n, H, D, generator=gen), torch.randn(L, n, H, D, generator=gen)
            key = cache.content_key(kind, f"m{i}".encode(), tenant="t")
            cache.put(key, k, v)
            data[key] = (k, v)
        cache.flush()
        disk = cache.lower.disk
        on_disk = [key for key in data if cache.index.groups[key].tier == Tier.DISK]
        assert len(on_disk) >= 4 and disk.direct_reads
        seq = cache.create_sequence(tenant="t")
        for key in on_disk:
            cache.attach(seq, key)
        still = [key for key in on_disk if cache.index.groups[key].tier == Tier.DISK]
        assert len(still) >= 2
        for path in disk.dir.glob("*.arrow"):
            _drop(path)
        kk = torch.cat([data[key][0] for key in on_disk], 1)
        vv = torch.cat([data[key][1] for key in on_disk], 1)
        t = kk.shape[1]
        q = torch.randn(3, 2 * H, D, generator=gen)
        for layer in (2, 0, 1):
            before = disk.stats()["read_bytes"]
            out = cache.attention(seq, layer, q)
            assert disk.stats()["read_bytes"] > before
            expect, _ = oracle_attention(q, torch.arange(t - 3, t), kk[layer], vv[layer], torch.arange(t))
            assert rel_err(out, expect) < 1e-5, layer
        assert cache.stats().counters.get("corrupt_reads", 0) == 0
        for key in still:
            e = disk.info(key)
            for name, extent in zip(e.files, e.extents):
                for layer in range(L):
                    resident = _resident(disk.dir / name, extent.offsets[layer], extent.pages * extent.layer_bytes)
                    assert resident == 0.0, (name, layer)
