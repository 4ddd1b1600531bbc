"""DiskTier with real files: bit-exact round trips, every corruption a miss plus a counter,
warm restart, the free-space floor, a really full filesystem, I/O errors survived."""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from mmtier.config import ModalitySpec
from mmtier.content import KeyMaker
from mmtier.errors import CapacityError, DTypeError, ShapeError, StorageFullError
from mmtier.storage import DiskTier, HostTier, StorageIOError
from mmtier.storage.disk_index import QUARANTINE_DIR
from tests.storage.test_helpers import CFG, MODEL, key, rand_pages, same_bytes

TEXT, VISION, AUDIO, EMBED = (CFG.spec(m) for m in ("text", "vision", "audio", "vision_embed"))


def tier(path, **kw) -> DiskTier:
    kw.setdefault("capacity_bytes", 1 << 30)
    return DiskTier(path, model=MODEL, **kw)


def group_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file())


def quarantined(d: Path) -> list[Path]:
    q = d / QUARANTINE_DIR
    return sorted(q.iterdir()) if q.exists() else []


@pytest.mark.parametrize("spec", [TEXT, VISION, AUDIO, EMBED], ids=lambda s: s.name)
@pytest.mark.parametrize("chunk_pages", [1, 3, 1000])
def test_round_trip_bit_exact(tmp_path, spec, chunk_pages):
    disk = tier(tmp_path, chunk_bytes=chunk_pages * spec.page_bytes)
    pages = rand_pages(spec, 7, seed=1)
    k = key(spec.name, 1)
    entry = disk.put(k, spec, 7 * spec.page_size - 5, pages)
    assert entry.num_pages == 7 and len(entry.files) == -(-7 // chunk_pages)
    assert disk.contains(k) and disk.used_bytes == entry.nbytes
    assert [p.name for p in group_files(tmp_path)] == sorted(entry.files)  # no .tmp left
    got = disk.get(k, spec, MODEL)
    assert same_bytes(got, pages)
    host = HostTier(16 * spec.page_bytes, pin_memory=False)
    host.put(key(spec.name, 99), spec, spec.page_size, rand_pages(spec, 1, seed=2))
    slot_entry = host.reserve(k, spec, entry.num_tokens)
    assert disk.get(k, spec, MODEL, out=slot_entry.runs()) is not None
    assert same_bytes(host.commit(slot_entry).gather(), pages)
    assert disk.stats()["hits"] == 2 and disk.stats()["corrupt_reads"] == 0


def test_put_from_runs_and_bad_input(tmp_path):
    disk = tier(tmp_path)
    pages = rand_pages(TEXT, 5, seed=3)
    k = key("text", 1)
    with pytest.raises(ShapeError):
        disk.put(k, TEXT, 80, pages[:4])
    with pytest.raises(DTypeError):
        disk.put(k, TEXT, 80, pages.float())
    assert group_files(tmp_path) == [] and disk.used_bytes == 0
    disk.put(k, TEXT, 80, [pages[:2], pages[2:3], pages[3:]])
    assert same_bytes(disk.get(k, TEXT, MODEL), pages)
    with pytest.raises(ShapeError):  # a wrong destination is the caller's error, not corruption
        disk.get(k, TEXT, MODEL, out=torch.empty(4, *TEXT.page_shape, dtype=TEXT.torch_dtype))
    assert disk.contains(k)


def test_remove_and_budget(tmp_path):
    disk = tier(tmp_path, capacity_bytes=12 * TEXT.page_bytes)
    disk.put(key("text", 1), TEXT, 8 * 16, rand_pages(TEXT, 8, seed=4))
    with pytest.raises(CapacityError):
        disk.put(key("text", 2), TEXT, 8 * 16, rand_pages(TEXT, 8, seed=5))
    assert disk.stats()["budget_refusals"] == 1 and len(group_files(tmp_path)) == 1
    assert disk.remove(key("text", 1)) and not disk.remove(key("text", 1))
    assert disk.used_bytes == 0 and group_files(tmp_path) == []
    disk.put(key("text", 2), TEXT, 8 * 16, rand_pages(TEXT, 8, seed=5))


def test_same_key_written_concurrently_once(tmp_path):
    disk = tier(tmp_path)
    pages = rand_pages(VISION, 6, seed=6)
    k = key("vision", 1)

    async def both():
        return await asyncio.gather(disk.put_async(k, VISION, 6 * 64, pages),
                                    disk.put_async(k, VISION, 6 * 64, pages))

    a, b = asyncio.run(both())
    assert a == b and disk.stats()["writes"] == 1 and len(group_files(tmp_path)) == 1


# ---- corruption: a miss and a counter, never wrong data ----

class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/mmtier-pwned-" + os.environ.get("MMTIER_PWN", "x"),))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x5A
    path.write_bytes(bytes(data))


def _checksum_column_at(path: Path) -> int:
    """The file offset of the first page's xxh3 in the checksum column (read with Arrow)."""
    import pyarrow as pa

    buf = pa.py_buffer(path.read_bytes())
    col = pa.ipc.open_file(buf).get_batch(0).column(1)
    return col.buffers()[1].address - buf.address + col.offset * 8


DAMAGE = {
    "flip_payload": lambda p: _flip(p, p.stat().st_size // 2),
    "flip_checksum_column": lambda p: _flip(p, _checksum_column_at(p)),
    "flip_metadata": lambda p: _replace(p, b'"num_tokens":100', b'"num_tokens":101'),
    "truncate_half": lambda p: os.truncate(p, p.stat().st_size // 2),
    "truncate_one_byte": lambda p: os.truncate(p, p.stat().st_size - 1),
    "zero_tail": lambda p: _zero_tail(p, 4096),
    "wrong_header": lambda p: _replace_at(p, 0, b"ARROW2\x00\x00"),
    "not_arrow": lambda p: p.write_bytes(os.urandom(p.stat().st_size)),
    "pickle_bytes": lambda p: p.write_bytes(pickle.dumps(_Evil())),
    "empty_file": lambda p: p.write_bytes(b""),
}


def _replace(p: Path, old: bytes, new: bytes) -> None:
    data = p.read_bytes()
    assert old in data
    p.write_bytes(data.replace(old, new))


def _replace_at(p: Path, at: int, new: bytes) -> None:
    data = bytearray(p.read_bytes())
    data[at:at + len(new)] = new
    p.write_bytes(bytes(data))


def _zero_tail(p: Path, n: int) -> None:
    data = bytearray(p.read_bytes())
    data[-n:] = bytes(min(n, len(data)))
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_corruption_at_read_is_a_miss_and_quarantined(tmp_path, damage, monkeypatch):
    monkeypatch.setenv("MMTIER_PWN", uuid.uuid4().hex)
    sentinel = Path("/tmp/mmtier-pwned-" + os.environ["MMTIER_PWN"])
    disk = tier(tmp_path)
    pages = rand_pages(TEXT, 7, seed=7)
    k = key("text", 1)
    entry = disk.put(k, TEXT, 100, pages)
    DAMAGE[damage](tmp_path / entry.files[0])
    assert disk.get(k, TEXT, MODEL) is None
    assert disk.stats()["corrupt_reads"] == 1 and disk.stats()["quarantined"] == 1
    assert not disk.contains(k) and disk.used_bytes == 0
    assert group_files(tmp_path) == [] and len(quarantined(tmp_path)) == 1
    assert disk.get(k, TEXT, MODEL) is None and disk.stats()["misses"] == 1
    assert not sentinel.exists()
    disk.put(k, TEXT, 100, pages)  # the writer goes on
    assert same_bytes(disk.get(k, TEXT, MODEL), pages)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_corruption_found_at_restart_or_read(tmp_path, damage):
    disk = tier(tmp_path)
    pages = rand_pages(TEXT, 7, seed=8)
    k = key("text", 1)
    entry = disk.put(k, TEXT, 100, pages)
    disk.close()
    DAMAGE[damage](tmp_path / entry.files[0])
    again = tier(tmp_path)
    st = again.stats()
    if st["quarantined_at_start"]:
        assert not again.contains(k) and group_files(tmp_path) == []
    else:  # footer intact: the page checksums catch it on read
        assert again.get(k, TEXT, MODEL) is None and again.stats()["corrupt_reads"] == 1
    assert len(quarantined(tmp_path)) == 1


def test_random_byte_flips_never_serve_wrong_data(tmp_path):
    rng = random.Random(0)
    disk = tier(tmp_path, chunk_bytes=3 * TEXT.page_bytes)
    pages = rand_pages(TEXT, 7, seed=9)
    k = key("text", 1)
    outcomes = {"miss": 0, "exact": 0}
    for _ in range(40):
        entry = disk.put(k, TEXT, 100, pages)
        victim = tmp_path / rng.choice(entry.files)
        _flip(victim, rng.randrange(victim.stat().st_size))
        got = disk.get(k, TEXT, MODEL)
        if got is None:
            outcomes["miss"] += 1
        else:  # a flip in padding or an unused byte: the data must still be exact
            assert same_bytes(got, pages)
            outcomes["exact"] += 1
            disk.remove(k)
    assert outcomes["miss"] > 30 and disk.stats()["corrupt_reads"] == outcomes["miss"]


def test_other_model_or_layout_is_a_miss(tmp_path):
    other = DiskTier(tmp_path / "other", model="another-model", capacity_bytes=1 << 30)
    okey = KeyMaker("another-model", "s").derive(modality="text", layout=TEXT.layout_fields(),
                                                 media=b"m" * 32, tenant_salt=b"t" * 32)
    e = other.put(okey, TEXT, 32, rand_pages(TEXT, 2, seed=10))
    disk = tier(tmp_path / "mine")
    assert disk.get(okey, TEXT, MODEL) is None  # not here at all
    shutil.copy(tmp_path / "other" / e.files[0], tmp_path / "mine" / e.files[0])
    restarted = tier(tmp_path / "mine")
    # another model's file (a process of another engine sharing the directory) is not this
    # tier's: neither indexed nor quarantined, left where it is
    assert not restarted.contains(okey) and restarted.stats()["quarantined_at_start"] == 0
    assert restarted.stats()["foreign_at_start"] == 1 and (tmp_path / "mine" / e.files[0]).exists()

    k = key("text", 1)
    disk.put(k, TEXT, 32, rand_pages(TEXT, 2, seed=11))
    assert disk.get(k, TEXT, "another-model") is None and disk.stats()["corrupt_reads"] == 1
    k2 = key("text", 2)
    disk.put(k2, TEXT, 32, rand_pages(TEXT, 2, seed=12))
    wider = ModalitySpec(**{**TEXT.model_dump(), "head_dim": 32, "num_kv_heads": 4})
    assert disk.get(k2, wider, MODEL) is None and disk.stats()["corrupt_reads"] == 2


def test_swapped_file_is_a_miss(tmp_path):
    disk = tier(tmp_path)
    a, b = key("text", 1), key("text", 2)
    ea = disk.put(a, TEXT, 32, rand_pages(TEXT, 2, seed=13))
    eb = disk.put(b, TEXT, 32, rand_pages(TEXT, 2, seed=14))
    shutil.copy(tmp_path / ea.files[0], tmp_path / eb.files[0])  # b's name, a's content
    assert disk.get(b, TEXT, MODEL) is None and disk.stats()["corrupt_reads"] == 1
    disk.close()
    shutil.copy(tmp_path / ea.files[0], tmp_path / "text-" + "0" * 64 + "-0000of0001.arrow"
                if False else tmp_path / ("text-" + "0" * 64 + "-0000of0001.arrow"))
    again = tier(tmp_path)
    assert again.stats()["quarantined_at_start"] == 1 and again.contains(a)


# ---- warm restart ----

def test_warm_restart_indexes_complete_groups(tmp_path):
    disk = tier(tmp_path, chunk_bytes=2 * VISION.page_bytes)
    data = {}
    for i in range(6):
        spec = VISION if i % 2 else TEXT
        pages = rand_pages(spec, 1 + i, seed=100 + i)
        disk.put(key(spec.name, i), spec, (1 + i) * spec.page_size, pages)
        data[i] = (spec, pages)
    used = disk.used_bytes
    disk.close()
    (tmp_path / "text-leftover.arrow.abc.tmp").write_bytes(b"partial")
    partial = next(p for p in group_files(tmp_path) if "-0001of0003" in p.name)
    partial.unlink()  # a group that lost a chunk: partial, quarantined whole
    again = tier(tmp_path)
    st = again.stats()
    assert st["tmp_removed_at_start"] == 1 and st["partial_groups_at_start"] == 1
    assert st["quarantined_at_start"] == 2 and st["groups"] == 5
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    inv = {e.key.digest: e for e in again.inventory()}
    for i, (spec, pages) in data.items():
        k = key(spec.name, i)
        if k.digest in inv:
            assert inv[k.digest].num_tokens == pages.shape[0] * spec.page_size
            assert same_bytes(again.get(k, spec, MODEL), pages)
    assert again.used_bytes < used


def test_scan_indexes_many_files_quickly(tmp_path):
    disk = tier(tmp_path)
    pages = rand_pages(TEXT, 1, seed=15)
    for i in range(2000):
        disk.put(key("text", i), TEXT, 16, pages)
    disk.close()
    again = tier(tmp_path)
    assert again.stats()["groups"] == 2000
    assert again.scan_s < 10.0


# ---- space: the floor, a full filesystem, other I/O errors ----

def test_free_space_floor_keeps_data_and_counts(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    disk = tier(tmp_path, free_floor_bytes=free - 64 * 1024)
    k = key("vision", 1)
    with pytest.raises(StorageFullError):
        disk.put(k, VISION, 64, rand_pages(VISION, 1, seed=16))  # 160 KiB would cross it
    assert disk.stats()["floor_refusals"] == 1 and group_files(tmp_path) == []
    disk.free_floor_bytes = 0
    disk.put(k, VISION, 64, rand_pages(VISION, 1, seed=16))
    assert disk.contains(k)


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_really_full_filesystem(tiny_fs):
    disk = tier(tiny_fs, free_floor_bytes=0)
    kept = {}
    i = 0
    with pytest.raises(StorageFullError):
        while i < 100:  # 8 MiB fills after ~12 groups of 640 KiB
            pages = rand_pages(VISION, 4, seed=200 + i)
            disk.put(key("vision", i), VISION, 256, pages)
            kept[i] = pages
            i += 1
    st = disk.stats()
    assert st["full_errors"] == 1 and len(kept) >= 5
    assert not any(p.name.endswith(".tmp") for p in tiny_fs.iterdir())
    assert not disk.contains(key("vision", i))
    for j, pages in kept.items():  # everything written before stays whole
        assert same_bytes(disk.get(key("vision", j), VISION, MODEL), pages)
    for j in list(kept)[:3]:
        disk.remove(key("vision", j))
    pages = rand_pages(VISION, 4, seed=999)
    disk.put(key("vision", 999), VISION, 256, pages)  # space freed: the writer works again
    assert same_bytes(disk.get(key("vision", 999), VISION, MODEL), pages)
    assert same_bytes(tier(tiny_fs).get(key("vision", 999), VISION, MODEL), pages)


def test_other_io_errors_are_typed_and_survived(tmp_path):
    d = tmp_path / "d"
    disk = tier(d)
    shutil.rmtree(d)  # the directory vanished under the writer
    with pytest.raises(StorageIOError):
        disk.put(key("text", 1), TEXT, 16, rand_pages(TEXT, 1, seed=17))
    assert disk.stats()["io_errors"] == 1 and disk.used_bytes == 0
    d.mkdir()
    disk.put(key("text", 1), TEXT, 16, rand_pages(TEXT, 1, seed=17))
    assert disk.contains(key("text", 1))


def test_lean_read_notices_any_changed_byte(tmp_path):
    """Reads after a write take the lean path (no Arrow parsing); every byte of the file is
    still checked against what was written: a flip anywhere is a miss, never wrong data."""
    disk = tier(tmp_path)
    pages = rand_pages(TEXT, 3, seed=21)
    k = key("text", 1)
    entry = disk.put(k, TEXT, 40, pages)
    assert entry.extents is not None
    size = (tmp_path / entry.files[0]).stat().st_size
    rng = random.Random(5)
    positions = sorted(set(range(0, 600, 7)) | set(range(size - 900, size))
                       | {rng.randrange(size) for _ in range(60)})
    for n, at in enumerate(positions[::3]):
        path = tmp_path / entry.files[0]
        raw = bytearray(path.read_bytes())
        raw[at] ^= 1 << (n % 8)
        path.write_bytes(bytes(raw))
        assert disk.get(k, TEXT, MODEL) is None, at
        assert not disk.contains(k)
        entry = disk.put(k, TEXT, 40, pages)
        assert same_bytes(disk.get(k, TEXT, MODEL), pages)
    assert disk.stats()["corrupt_reads"] == len(positions[::3])


def test_warm_restart_reads_fully_once_then_lean(tmp_path, monkeypatch):
    from mmtier.storage import disk_reads

    disk = tier(tmp_path, chunk_bytes=2 * TEXT.page_bytes)        # 3 files for 5 pages
    pages = rand_pages(TEXT, 5, seed=22)
    k = key("text", 2)
    disk.put(k, TEXT, 70, pages)
    disk.close()
    again = tier(tmp_path, chunk_bytes=2 * TEXT.page_bytes)
    assert again.info(k).extents is None                          # not known after a restart
    assert same_bytes(again.get(k, TEXT, MODEL), pages)           # full read: footer, metadata
    learned = again.info(k)
    assert learned.extents is not None and len(learned.extents) == 3

    def no_full_read(*a, **kw):
        raise AssertionError("the full read ran again")

    monkeypatch.setattr(disk_reads, "read_file", no_full_read)
    out = torch.full_like(pages, float("nan"))
    assert again.get(k, TEXT, MODEL, out=out) is out and same_bytes(out, pages)
    _flip(tmp_path / learned.files[2], 3)                         # the lean read checks too
    assert again.get(k, TEXT, MODEL) is None and again.stats()["corrupt_reads"] == 1
