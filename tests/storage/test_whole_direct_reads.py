"""Whole-group disk reads with ``O_DIRECT`` (real files on the test's file system, fresh random
data, bitwise checks): ``get`` and ``get_many`` of groups whose extents are padded (>= 64 KiB)
and not, float32 and bfloat16, into a tensor and into runs, equal what was written, read around
the page cache (``direct_read_files`` counts the files, ``mincore`` finds none of their pages
cached); windows smaller than an extent, ending inside rows and frames, read ahead or not, give
the same bytes; a flipped byte (a layer's bytes or the frame) and a truncated file are misses,
counted and quarantined; ``direct_reads=False``, files under ``DIRECT_MIN_FILE`` and a file
system that refuses ``O_DIRECT`` read buffered, bitwise the same; files found at a warm
restart are read in full first, then direct; every staging window is given back."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import tempfile
from pathlib import Path

import pytest
import torch

from mmtier.config import CacheConfig
from mmtier.errors import CorruptDataError
from mmtier.storage import DiskTier
from mmtier.storage.dest_pages import DestPages
from mmtier.storage.direct_reads import DIRECT_MIN_FILE, read_whole_direct
from mmtier.storage.layer_extent import DIRECT_MIN_EXTENT
from mmtier.storage.staging import StagingPool
from tests.storage.test_helpers import KEYS, MODEL, same_bytes
from tests.storage.test_layer_major import _drop, _resident
from tests.storage.test_layers import flip, quarantined

CFG = CacheConfig(model=MODEL, num_layers=3, num_kv_heads=2, head_dim=64, dtype="float16",
                  modalities={"f32": {"page_size": 16, "dtype": "float32"},       # 16 KiB a layer of a page
                              "bf16": {"page_size": 16, "dtype": "bfloat16"}},    # 8 KiB
                  device="cpu", device_bytes=1 << 20)
# pages per file: extents of >= 64 KiB (padded), under it (not), and files under DIRECT_MIN_FILE
CHUNKS = {"padded": 9, "unpadded": 3, "tiny": 1}


def key_of(spec, i: int):
    media = hashlib.sha256(f"whole/{spec.name}/{i}".encode()).digest()
    return KEYS.derive(modality=spec.name, layout=spec.layout_fields(), media=media, tenant_salt=b"\x02" * 32)


def fresh_pages(spec, n: int) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(os.urandom(n * spec.page_bytes)), dtype=torch.uint8)
    return raw.view(spec.torch_dtype).view(n, *spec.page_shape)


def written(path: Path, modality: str, chunk: str, n: int = 20, i: int = 0, **kw):
    spec = CFG.spec(modality)
    kw.setdefault("chunk_bytes", CHUNKS[chunk] * spec.page_bytes)
    disk = DiskTier(path, model=MODEL, capacity_bytes=1 << 30, **kw)
    pages, k = fresh_pages(spec, n), key_of(spec, i)
    entry = disk.put(k, spec, n * spec.page_size, pages)
    extent = entry.extents[0]
    padded = extent.pages * extent.layer_bytes >= DIRECT_MIN_EXTENT
    assert padded == (chunk == "padded" and disk.io_align > 1), (chunk, extent.pages * extent.layer_bytes)
    assert (extent.size >= DIRECT_MIN_FILE) == (chunk != "tiny")
    for name in entry.files:
        _drop(disk.dir / name)
    return disk, spec, pages, k, entry


def cached_share(disk, entry) -> float:
    """The largest share of a direct-read-sized file of the group in the page cache."""
    return max(_resident(disk.dir / name, 0, x.size) for name, x in zip(entry.files, entry.extents)
               if x.size >= DIRECT_MIN_FILE)


def direct_files(entry) -> int:
    return sum(1 for x in entry.extents if x.size >= DIRECT_MIN_FILE)


def runs_like(pages: torch.Tensor) -> list[torch.Tensor]:
    """Three runs of odd lengths covering the pages (each contiguous, none aligned)."""
    n = pages.shape[0]
    cuts = [0, 3, n - 5, n]
    return [torch.empty(b - a, *pages.shape[1:], dtype=pages.dtype) for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("modality", ["f32", "bf16"])
@pytest.mark.parametrize("chunk", ["padded", "unpadded", "tiny"])
@pytest.mark.parametrize("into", ["tensor", "runs"])
def test_a_group_read_direct_equals_what_was_written(tmp_path, modality, chunk, into):
    disk, spec, pages, k, entry = written(tmp_path, modality, chunk)
    assert len(entry.files) > 2
    out = torch.zeros_like(pages) if into == "tensor" else runs_like(pages)
    got = disk.get(k, spec, MODEL, out=out)
    assert got is out
    back = out if into == "tensor" else torch.cat(out)
    assert same_bytes(back, pages)
    direct = chunk != "tiny"
    assert disk.stats()["direct_read_files"] == (direct_files(entry) if direct else 0)
    assert disk.stats()["hits"] == 1 and disk.stats()["corrupt_reads"] == 0
    if direct:
        assert cached_share(disk, entry) == 0.0          # around the page cache
    assert not disk._reads.windows._out                  # every window given back
    assert same_bytes(disk.get(k, spec, MODEL), pages)   # a new tensor too


@pytest.mark.parametrize("chunk", ["padded", "unpadded"])
def test_get_many_reads_direct_and_equals_what_was_written(tmp_path, chunk):
    spec = CFG.spec("bf16")
    disk = DiskTier(tmp_path, model=MODEL, capacity_bytes=1 << 30, chunk_bytes=CHUNKS[chunk] * spec.page_bytes)
    groups = [(key_of(spec, i), fresh_pages(spec, n)) for i, n in enumerate((11, 4, 17))]
    files = 0
    for k, p in groups:
        entry = disk.put(k, spec, p.shape[0] * spec.page_size, p)
        files += direct_files(entry)
        for name in entry.files:
            _drop(disk.dir / name)
    out = torch.zeros(32, *spec.page_shape, dtype=spec.torch_dtype)
    assert disk.get_many([k for k, _ in groups], spec, MODEL, out, [p.shape[0] for _, p in groups]) == [True] * 3
    assert same_bytes(out, torch.cat([p for _, p in groups]))
    assert disk.stats()["direct_read_files"] == files and disk.stats()["hits"] == 3


@pytest.mark.parametrize("window", [4096, 3 * 4096, 64 << 10, 8 << 20])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_windows_of_any_size_read_ahead_or_not_give_the_same_bytes(tmp_path, window, depth):
    """Windows that end inside a page's slice, inside the frame, or hold several extents."""
    disk, spec, pages, k, entry = written(tmp_path, "f32", "padded", n=13)
    windows = StagingPool(64 << 20)
    out = torch.zeros_like(pages)
    dest = DestPages(spec, out, pages.shape[0])
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        for name, extent in zip(entry.files, entry.extents):
            got = read_whole_direct(str(disk.dir / name), extent, dest, windows,
                                    ex if depth else None, window=window, depth=depth)
            assert got == extent.pages
    assert same_bytes(out, pages)
    assert not windows._out


@pytest.mark.parametrize("where", ["layer", "frame"])
@pytest.mark.parametrize("chunk", ["padded", "unpadded"])
def test_a_flipped_byte_in_a_directly_read_file_is_a_miss_and_quarantined(tmp_path, where, chunk):
    disk, spec, pages, k, entry = written(tmp_path, "bf16", chunk)
    extent, path = entry.extents[1], disk.dir / entry.files[1]
    at = extent.offsets[2] + extent.layer_bytes + 7 if where == "layer" else extent.gaps()[-1][0] + 3
    flip(path, at)
    _drop(path)
    out = torch.zeros_like(pages)
    assert disk.get(k, spec, MODEL, out=out) is None
    st = disk.stats()
    assert st["corrupt_reads"] == 1 and st["hits"] == 0 and st["direct_read_files"] == 1   # file 0 only
    assert quarantined(disk.dir) and not disk.contains(k)
    assert not disk._reads.windows._out


def test_a_flipped_byte_is_found_with_small_windows_read_ahead(tmp_path):
    disk, spec, pages, k, entry = written(tmp_path, "f32", "padded", n=13)
    extent, path = entry.extents[0], disk.dir / entry.files[0]
    flip(path, extent.offsets[1] + 5 * extent.layer_bytes - 1)      # last byte of a page's slice
    _drop(path)
    windows = StagingPool(64 << 20)
    dest = DestPages(spec, torch.zeros_like(pages), pages.shape[0])
    with concurrent.futures.ThreadPoolExecutor(2) as ex, pytest.raises(CorruptDataError, match="layer 1"):
        read_whole_direct(str(path), extent, dest, windows, ex, window=3 * 4096, depth=2)
    assert not windows._out


@pytest.mark.parametrize("cut", ["tail", "half"])
def test_a_truncated_file_is_a_miss(tmp_path, cut):
    disk, spec, pages, k, entry = written(tmp_path, "f32", "padded")
    path = disk.dir / entry.files[-1]
    size = entry.extents[-1].size
    os.truncate(path, size - 1 if cut == "tail" else size // 2)
    assert disk.get(k, spec, MODEL, out=torch.zeros_like(pages)) is None
    assert disk.stats()["corrupt_reads"] == 1 and quarantined(disk.dir) and not disk.contains(k)


def test_direct_reads_off_reads_buffered_and_gives_the_same_bytes(tmp_path):
    disk, spec, pages, k, entry = written(tmp_path, "f32", "unpadded", direct_reads=False)
    out = torch.zeros_like(pages)
    assert disk.get(k, spec, MODEL, out=out) is out and same_bytes(out, pages)
    assert disk.stats()["direct_read_files"] == 0
    assert cached_share(disk, entry) == 1.0              # buffered: through the page cache
    for name in entry.files:
        _drop(disk.dir / name)
    disk.direct_reads = True                             # the same files, read direct
    out2 = torch.zeros_like(pages)
    assert disk.get(k, spec, MODEL, out=out2) is out2 and same_bytes(out2, pages)
    assert disk.stats()["direct_read_files"] == direct_files(entry) == len(entry.files)
    assert cached_share(disk, entry) == 0.0


def test_a_file_system_that_refuses_o_direct_reads_buffered(tmp_path, monkeypatch):
    """Where ``open(O_DIRECT)`` fails with EINVAL (tmpfs on older kernels, some FUSE), the
    read falls back to buffered, bitwise the same, and the directory is not tried again."""
    from mmtier.storage import direct_reads, layer_extent

    disk, spec, pages, k, entry = written(tmp_path, "bf16", "padded")
    real_open = os.open

    def refusing(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(direct_reads.os, "open", refusing)
    monkeypatch.setattr(layer_extent, "_DIRECT_REFUSED", set())
    out = torch.zeros_like(pages)
    assert disk.get(k, spec, MODEL, out=out) is out and same_bytes(out, pages)
    assert disk.stats()["direct_read_files"] == 0 and disk.stats()["corrupt_reads"] == 0
    assert str(disk.dir) in layer_extent._DIRECT_REFUSED


def test_tmpfs_reads_direct_or_buffered_and_gives_the_same_bytes():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        disk, spec, pages, k, entry = written(Path(shm), "f32", "padded")
        out = torch.zeros_like(pages)
        assert disk.get(k, spec, MODEL, out=out) is out and same_bytes(out, pages)
        assert disk.stats()["corrupt_reads"] == 0
        disk.close()


def test_a_warm_restart_reads_in_full_first_then_direct(tmp_path):
    disk, spec, pages, k, entry = written(tmp_path, "f32", "padded")
    disk.close()
    again = DiskTier(tmp_path, model=MODEL, capacity_bytes=1 << 30, chunk_bytes=CHUNKS["padded"] * spec.page_bytes)
    assert again.info(k).extents is None                 # layout not known yet
    assert same_bytes(again.get(k, spec, MODEL), pages)
    assert again.stats()["direct_read_files"] == 0       # the full (Arrow) read
    for name in entry.files:
        _drop(again.dir / name)
    assert same_bytes(again.get(k, spec, MODEL), pages)
    assert again.stats()["direct_read_files"] == direct_files(entry)
    assert cached_share(again, entry) == 0.0
