"""Disk-tier files written with O_DIRECT from reused aligned images (``storage.file_writes``):
bitwise the parts, exactly their size (the block padding truncated away), no page-cache pages
behind them; buffered where no image pool is given; and a DiskTier round trip either way."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mmtier.storage.file_writes import write_parts
from mmtier.storage.layer_extent import direct_align
from mmtier.storage.staging import StagingPool
from tests.storage.test_helpers import MODEL, rand_pages, same_bytes
from tests.storage.test_layer_major import _resident
from tests.storage.test_layers import key_of, specs, tier


def parts_of(seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    sizes = [1000, 3 << 20, 17, 1 << 20, 4096 + 5]          # odd sizes: the image is padded
    return [rng.integers(1, 256, n, dtype=np.uint8).tobytes() for n in sizes]


@pytest.mark.parametrize("direct", [True, False])
def test_a_written_file_is_its_parts_exactly(tmp_path, direct):
    parts = parts_of(1 + direct)
    path = str(tmp_path / "f.tmp")
    images = StagingPool(16 << 20) if direct else None
    align = direct_align(os.stat(tmp_path).st_dev)
    size = write_parts(path, parts, align=align, images=images)
    want = b"".join(parts)
    assert size == len(want) == os.path.getsize(path)
    with open(path, "rb") as f:
        assert f.read() == want
    if direct:
        assert images.pooled_bytes > 0                          # the image went back to the pool
        again = str(tmp_path / "g.tmp")                         # the reused image holds f's bytes
        other = parts_of(9)[:2]
        assert write_parts(again, other, align=align, images=images) == sum(map(len, other))
        with open(again, "rb") as f:
            assert f.read() == b"".join(other)


def test_a_direct_write_leaves_no_page_cache_behind_and_a_buffered_one_does(tmp_path):
    align = direct_align(os.stat(tmp_path).st_dev)
    parts = [np.full(4 << 20, 7, dtype=np.uint8).tobytes()]
    direct, buffered = str(tmp_path / "d.tmp"), str(tmp_path / "b.tmp")
    write_parts(direct, parts, align=align, images=StagingPool(16 << 20))
    write_parts(buffered, parts, align=align, images=None)
    if _resident(direct, 0, 4 << 20) > 0.5:
        pytest.skip("this file system serves O_DIRECT through the page cache (or refused it)")
    assert _resident(buffered, 0, 4 << 20) > 0.9


def test_an_existing_file_is_never_overwritten(tmp_path):
    path = tmp_path / "f.tmp"
    path.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        write_parts(str(path), [b"new"], align=4096, images=StagingPool(1 << 20))
    assert path.read_bytes() == b"old"


@pytest.mark.parametrize("direct_writes", [True, False])
def test_disk_tier_round_trip_with_and_without_direct_writes(tmp_path, direct_writes):
    text, vision, _ = specs(3)
    disk = tier(tmp_path, direct_writes=direct_writes, chunk_bytes=3 * vision.page_bytes)
    for spec, n in ((text, 5), (vision, 7)):
        pages = rand_pages(spec, n, seed=n)
        k = key_of(spec, n)
        entry = disk.put(k, spec, n * spec.page_size, pages)
        assert same_bytes(disk.get(k, spec, MODEL), pages)
        for name in entry.files:
            assert os.path.getsize(disk.dir / name) == disk.info(k).extents[entry.files.index(name)].size \
                if disk.info(k).extents else True
    disk.close()
    again = tier(tmp_path)
    for spec, n in ((text, 5), (vision, 7)):
        assert same_bytes(again.get(key_of(spec, n), spec, MODEL), rand_pages(spec, n, seed=n))
    assert again.stats()["corrupt_reads"] == 0
