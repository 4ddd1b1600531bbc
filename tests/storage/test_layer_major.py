"""The disk tier's layer-major file format (version 2) with real files: the file holds one
record batch per layer, bitwise the pages' layer slices; a layer of a chunk is one contiguous
extent, read alone, and (read buffered) the next layer's extent is handed to the kernel
meanwhile; damage is a miss and quarantined on every read path (lean whole read, layer read, the first full read after
a warm restart); version-1 files are never read; attention streamed from layer-major files
equals the float64 oracle, before and after a warm restart."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import numpy as np
import pyarrow as pa
import pytest
import torch
import xxhash

from mmtier import CacheConfig, ModalitySpec, TieredKVCache
from mmtier.core.groups import Tier
from mmtier.errors import CorruptDataError
from mmtier.storage import writers
from mmtier.storage.arrow_format import (
    FORMAT_VERSION,
    file_name,
    layout_of,
    open_reader,
    page_rows,
    read_meta,
    serialize,
)
from tests.storage.test_helpers import MODEL, page_sums, rand_pages, same_bytes
from tests.storage.test_layers import flip, key_of, quarantined, specs, tier
from tests.support.oracle import oracle_attention, rel_err


def file_layers(path) -> tuple[dict, list[bytes], list[list[int]]]:
    """A file's metadata and, per record batch, its page column's bytes and its xxh3 column."""
    with pa.memory_map(str(path)) as mm:
        reader, _ = open_reader(mm)
        meta = read_meta(reader.schema)
        batches = [reader.get_batch(b) for b in range(reader.num_record_batches)]
        return (meta, [b"".join(x.as_py() for x in b.column(0)) for b in batches],
                [b.column(1).to_pylist() for b in batches])


def layer_bytes_of(spec, pages: torch.Tensor, layer: int) -> bytes:
    rows = page_rows(spec, pages)[0]
    lb = spec.layer_bytes
    return rows[:, layer * lb:(layer + 1) * lb].tobytes()


@pytest.mark.parametrize("num_layers", [1, 3])
def test_files_are_layer_major_bitwise_and_round_trip(tmp_path, num_layers):
    for spec in specs(num_layers):
        disk = tier(tmp_path / spec.name, chunk_bytes=3 * spec.page_bytes)     # 7 pages: 3 files
        pages = rand_pages(spec, 7, seed=40 + num_layers)
        k = key_of(spec, 2)
        runs = [pages[:2], pages[2:3], pages[3:]]              # written from runs of pages
        entry = disk.put(k, spec, 7 * spec.page_size - 1, runs)
        assert len(entry.files) == 3
        for name, extent in zip(entry.files, entry.extents):
            meta, batches, sums = file_layers(disk.dir / name)
            assert meta["format"] == FORMAT_VERSION == 2
            part = pages[meta["first_page"]:meta["first_page"] + meta["chunk_pages"]]
            assert len(batches) == spec.page_layers == extent.num_layers
            raw = (disk.dir / name).read_bytes()
            for layer in range(spec.page_layers):
                want = layer_bytes_of(spec, part, layer)
                assert batches[layer] == want, (spec.name, name, layer)
                lb = spec.layer_bytes
                assert sums[layer] == [xxhash.xxh3_64_intdigest(want[j * lb:(j + 1) * lb])
                                       for j in range(len(part))]
                at = extent.offsets[layer]                      # one contiguous extent a layer
                assert raw[at:at + len(part) * lb] == want
        out = torch.full_like(pages, 7)
        assert disk.get(k, spec, MODEL, out=out) is out and same_bytes(out, pages)
        disk.close()
        again = tier(tmp_path / spec.name)                      # warm restart: the first read parses
        assert again.contains(k) and again.info(k).extents is None
        assert same_bytes(again.get(k, spec, MODEL), pages)
        assert again.info(k).extents == entry.extents           # learned the writer's extents
        for layer in range(spec.page_layers):
            got = again.get_layer(k, spec, MODEL, layer)
            assert got.reshape(7, -1).view(torch.uint8).numpy().tobytes() == layer_bytes_of(spec, pages, layer)
        assert again.stats()["corrupt_reads"] == 0


def test_a_layer_read_right_after_a_restart_equals_that_layer(tmp_path):
    text, _, _ = specs(3)
    disk = tier(tmp_path, chunk_bytes=2 * text.page_bytes)
    pages = rand_pages(text, 5, seed=8)
    k = key_of(text, 1)
    disk.put(k, text, 5 * text.page_size, pages)
    disk.close()
    again = tier(tmp_path)
    assert same_bytes(again.get_layer(k, text, MODEL, 2), pages[:, 2:3].contiguous())
    assert again.info(k).extents is not None                  # the next layer read is lean
    before = again.stats()["read_bytes"]
    assert same_bytes(again.get_layer(k, text, MODEL, 1), pages[:, 1:2].contiguous())
    assert again.stats()["read_bytes"] - before == 5 * text.layer_bytes


@pytest.mark.parametrize("path", ["whole", "restart", "restart_layer"])
def test_a_flipped_byte_of_another_layer_is_a_miss_where_it_is_returned(tmp_path, path):
    """A layer read verifies the bytes it returns; a whole read verifies them all; the first
    read after a restart checks each row's xxh3: each damaged read is a miss, the group's files
    quarantined and counted, and the tier goes on."""
    text, _, _ = specs(3)
    disk = tier(tmp_path, chunk_bytes=3 * text.page_bytes)
    pages = rand_pages(text, 7, seed=12)
    k = key_of(text, 3)
    entry = disk.put(k, text, 7 * text.page_size, pages)
    extent = entry.extents[1]
    flip(disk.dir / extent.name, extent.offsets[2] + text.layer_bytes + 17)   # layer 2, 2nd page
    if path == "whole":
        assert same_bytes(disk.get_layer(k, text, MODEL, 0), pages[:, :1].contiguous())  # not returned
        assert disk.get(k, text, MODEL) is None
    else:
        disk.close()
        disk = tier(tmp_path)
        assert disk.contains(k)
        layer = 2 if path == "restart_layer" else None
        got = disk.get(k, text, MODEL) if layer is None else disk.get_layer(k, text, MODEL, layer)
        assert got is None
    st = disk.stats()
    assert st["corrupt_reads"] == 1 and st["quarantined"] == 3 and not disk.contains(k)
    assert len(quarantined(tmp_path)) == 3 and disk.used_bytes == 0
    disk.put(k, text, 7 * text.page_size, pages)
    assert same_bytes(disk.get(k, text, MODEL), pages)


def test_a_truncated_file_is_a_miss_on_the_layer_read_and_at_a_restart(tmp_path):
    text, _, _ = specs(2)
    disk = tier(tmp_path, chunk_bytes=4 * text.page_bytes)     # 6 pages: 2 files
    pages = rand_pages(text, 6, seed=5)
    k = key_of(text, 4)
    entry = disk.put(k, text, 6 * text.page_size, pages)
    path = disk.dir / entry.extents[0].name
    path.write_bytes(path.read_bytes()[:entry.extents[0].offsets[1] + 3])   # ends inside layer 1
    assert disk.get_layer(k, text, MODEL, 0) is None            # layer 0 intact, the file is not
    st = disk.stats()
    assert st["corrupt_reads"] == 1 and st["quarantined"] == 2 and not disk.contains(k)
    entry = disk.put(k, text, 6 * text.page_size, pages)
    disk.close()
    path = tmp_path / entry.files[0]
    path.write_bytes(path.read_bytes()[:-9])                    # footer gone: refused at the scan
    again = tier(tmp_path)
    assert not again.contains(k) and again.get(k, text, MODEL) is None
    st = again.stats()
    assert st["quarantined_at_start"] == 2 and st["partial_groups_at_start"] == 1 and st["misses"] == 1


def _v1_file(directory, spec, key, pages, writer: str) -> str:
    """A version-1 (page-major) file of one chunk, as the previous release wrote it."""
    rows = page_rows(spec, pages)
    sums = np.array(page_sums(pages), dtype=np.uint64)
    meta = {"format": 1, "key": key.to_wire(), "model": MODEL, "layout": layout_of(spec),
            "num_tokens": pages.shape[0] * spec.page_size, "num_pages": pages.shape[0], "num_chunks": 1,
            "chunk": 0, "first_page": 0, "chunk_pages": pages.shape[0], "writer": writer}
    name = file_name(key.modality, key.hex, 0, 1)
    with open(directory / name, "wb") as f:              # one row per page, all its layers
        for part in serialize(meta, spec.page_bytes, rows, sums)[0]:
            f.write(part)
    return name


def test_version_1_files_are_never_read(tmp_path):
    """A version-1 file of a writer that is gone is quarantined at the scan (counted); one of a
    live writer (a directory shared with an older process) is left alone, not indexed; a
    version-1 file's metadata is refused by the reader (a miss, never its bytes as layers)."""
    text, _, _ = specs(3)
    pages = rand_pages(text, 4, seed=21)
    dead, live = key_of(text, 10), key_of(text, 11)
    tmp_path.mkdir(exist_ok=True)
    gone = _v1_file(tmp_path, text, dead, pages, writer="999999999:1")
    kept = _v1_file(tmp_path, text, live, pages, writer=writers.this_writer())
    with pa.memory_map(str(tmp_path / kept)) as mm:
        reader, _ = open_reader(mm)
        assert read_meta(reader.schema, (1,))["format"] == 1
        with pytest.raises(CorruptDataError, match="unknown format 1"):
            read_meta(reader.schema)
    disk = tier(tmp_path)
    st = disk.stats()
    assert st["old_format_at_start"] == 2 and st["quarantined_at_start"] == 1 and st["groups"] == 0
    assert not disk.contains(dead) and not disk.contains(live) and disk.used_bytes == 0
    assert (tmp_path / kept).exists() and not (tmp_path / gone).exists()
    assert [p.name.rsplit(".", 1)[0] for p in quarantined(tmp_path)] == [gone]
    assert disk.get(dead, text, MODEL) is None and disk.stats()["misses"] == 1
    disk.put(dead, text, 4 * text.page_size, pages)             # rewritten in the new layout
    disk.close()
    again = tier(tmp_path)
    assert same_bytes(again.get(dead, text, MODEL), pages) and not again.contains(live)


def _resident(path, offset: int, length: int) -> float:
    """The share of the file's pages in ``[offset, offset + length)`` in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    ps = mmap.PAGESIZE
    lo, hi = offset // ps * ps, offset + length
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            buf = (ctypes.c_char * len(mm)).from_buffer(mm)
            n = -(-(hi - lo) // ps)
            vec = (ctypes.c_ubyte * n)()
            addr = ctypes.addressof(buf) + lo
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(hi - lo), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            del buf
            return sum(v & 1 for v in vec) / n
        finally:
            mm.close()


def _drop(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_layer_read_hands_the_next_layers_extent_to_the_kernel(tmp_path, ahead):
    """A buffered layer read (``direct_reads=False``; also the fallback where ``O_DIRECT``
    cannot be used): with ``read_ahead_layers=1`` reading layer 0 leaves layer 1's extent in
    the page cache (read by the kernel meanwhile), not layer 2's; with 0, neither."""
    cfg = CacheConfig(model=MODEL, num_layers=3, num_kv_heads=8, head_dim=128, dtype="float16",
                      modalities={"vision": {"page_size": 64}}, device="cpu", device_bytes=1 << 20)
    spec = cfg.spec("vision")                                   # 256 KiB a layer of a page
    disk = tier(tmp_path, read_ahead_layers=ahead, chunk_bytes=128 << 20, direct_reads=False)
    n = 96          # 24 MiB a layer extent: past the kernel's own readahead (up to 8 MiB here)
    pages = rand_pages(spec, n, seed=3)
    k = key_of(spec, 5)
    entry = disk.put(k, spec, n * spec.page_size, pages)
    extent, path = entry.extents[0], disk.dir / entry.files[0]
    span = extent.pages * extent.layer_bytes
    _drop(path)
    tail = (span * 3 // 4, span // 4)                           # the last quarter of an extent
    if _resident(path, extent.offsets[1] + tail[0], tail[1]) > 0.1:
        pytest.skip("this filesystem keeps the file in memory (no page cache to drop)")
    assert same_bytes(disk.get_layer(k, spec, MODEL, 0), pages[:, :1].contiguous())
    deadline = time.monotonic() + 10
    while ahead and _resident(path, extent.offsets[1] + tail[0], tail[1]) < 0.99 and time.monotonic() < deadline:
        time.sleep(0.05)
    nxt = _resident(path, extent.offsets[1] + tail[0], tail[1])
    after = _resident(path, extent.offsets[2] + tail[0], tail[1])
    assert (nxt > 0.99) if ahead else (nxt < 0.5), nxt
    assert after < 0.5, after
    assert same_bytes(disk.get_layer(k, spec, MODEL, 1), pages[:, 1:2].contiguous())


L, H, D = 3, 2, 32


def _cfg(tmp_path):
    token = 2 * L * H * D * 4
    return CacheConfig(
        model="layer-major", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
        modalities={"text": ModalitySpec(page_size=16, share=0.5), "vision": ModalitySpec(page_size=32, share=0.5)},
        device="cpu", device_bytes=2 * 2 * 32 * token + 64, host_bytes=0,
        disk_dir=tmp_path / "spill", disk_bytes=64 << 20, disk_free_floor_bytes=0)


def test_attention_streamed_from_layer_major_files_equals_the_oracle(tmp_path, monkeypatch):
    """Attention over groups on disk (several small stream batches), every layer, equals the
    float64 oracle on fresh random K/V and queries (outputs poisoned first); after a warm
    restart (the first read parses the files) it still does."""
    from mmtier.attention import streaming

    monkeypatch.setattr(streaming, "BATCH_BYTES", 32 * 2 * H * D * 4)
    cfg = _cfg(tmp_path)
    gen = torch.Generator().manual_seed(int(time.time_ns() % (1 << 31)))
    data = {}
    with TieredKVCache(cfg) as cache:
        for i in range(10):
            kind, n = ("vision", 60) if i % 2 else ("text", 30)
            k, v = torch.randn(L, n, H, D, generator=gen), torch.randn(L, n, H, D, generator=gen)
            key = cache.content_key(kind, f"m{i}".encode(), tenant="t")
            cache.put(key, k, v)
            data[key] = (k, v)
        cache.flush()
        on_disk = [key for key in data if cache.index.groups[key].tier == Tier.DISK]
        assert len(on_disk) >= 4 and {key.modality for key in on_disk} == {"text", "vision"}
        _check_every_layer(cache, on_disk, data, gen, "as written")
    with TieredKVCache(cfg) as cache:                           # warm restart: files parsed once
        kept = [key for key in data if cache.contains(key)]     # those still on disk at the close
        assert len(kept) >= 2 and cache.stats().counters["adopted_from_disk"] == len(kept)
        _check_every_layer(cache, kept, data, gen, "after a restart")


def _check_every_layer(cache, on_disk, data, gen, when: str) -> None:
    seq = cache.create_sequence(tenant="t")
    for key in on_disk:
        cache.attach(seq, key)
    still = [key for key in on_disk if cache.index.groups[key].tier == Tier.DISK]   # attach may promote some
    assert len(still) >= 2
    kk = torch.cat([data[key][0] for key in on_disk], 1)
    vv = torch.cat([data[key][1] for key in on_disk], 1)
    t = kk.shape[1]
    q = torch.randn(3, 2 * H, D, generator=gen)
    for layer in (2, 0, 1):
        out = torch.full((3, 2 * H, D), float("nan"))
        before = cache.lower.disk.stats()["read_bytes"]
        out = cache.attention(seq, layer, q)
        assert cache.lower.disk.stats()["read_bytes"] > before        # streamed from the files
        assert torch.isfinite(out).all()
        expect, _ = oracle_attention(q, torch.arange(t - 3, t), kk[layer], vv[layer], torch.arange(t))
        assert rel_err(out, expect) < 1e-5, (when, layer)
    assert cache.stats().counters.get("corrupt_reads", 0) == 0


def test_the_layer_major_copy_into_a_given_buffer_equals_the_fresh_one():
    from mmtier.storage.layer_extent import layer_major
    text, _, _ = specs(3)
    pages = rand_pages(text, 5, seed=21)
    rows = [r for r in page_rows(text, [pages[:2], pages[2:]])]
    fresh = layer_major(rows, 3)
    buf = np.full(5 * text.page_bytes + 64, 0xEE, dtype=np.uint8)     # larger, holding old bytes
    laid = layer_major(rows, 3, out=buf)
    assert [a.tobytes() for a in laid] == [a.tobytes() for a in fresh]
    assert all(np.shares_memory(a, buf) for a in laid)
    with pytest.raises(ValueError):
        layer_major(rows, 3, out=np.empty(5 * text.page_bytes - 1, dtype=np.uint8))


def test_reused_write_buffers_never_leak_the_previous_chunk_into_a_file(tmp_path):
    """Each chunk's layer-major copy goes into a buffer the tier reuses: the second group's
    files hold its own bytes, bitwise, although its buffer held the first group's."""
    text, _, _ = specs(3)
    disk = tier(tmp_path, chunk_bytes=4 * text.page_bytes)
    a, b = rand_pages(text, 4, seed=31), rand_pages(text, 3, seed=32)     # b: a shorter chunk
    ka, kb = key_of(text, 31), key_of(text, 32)
    disk.put(ka, text, 4 * text.page_size, a)
    disk.put(kb, text, 3 * text.page_size, b)
    assert disk._writes.buffers.reused >= 1
    for k, pages in ((ka, a), (kb, b)):
        name = disk.info(k).files[0]
        _, batches, _ = file_layers(disk.dir / name)
        assert batches == [layer_bytes_of(text, pages, layer) for layer in range(3)]
        assert same_bytes(disk.get(k, text, MODEL), pages)
    disk.close()
    again = tier(tmp_path)                                  # and from the files alone
    assert same_bytes(again.get(kb, text, MODEL), b) and same_bytes(again.get(ka, text, MODEL), a)
