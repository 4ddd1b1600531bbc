"""The disk tier's index alone (``storage.disk_index``): claims against the byte budget, one
write per key in flight, settle, removal of owned and borrowed groups, corruption and
quarantine, counters; and the reads over an index alone (``storage.disk_reads``)."""

from __future__ import annotations

import concurrent.futures

import pytest

from mmtier.errors import CapacityError, ClosedError
from mmtier.storage.disk_index import QUARANTINE_DIR, DiskEntry, DiskIndex, WriteSlot
from mmtier.storage.disk_reads import DiskReads
from tests.storage.test_helpers import CFG, MODEL, key

TEXT = CFG.spec("text")


def entry(k, nbytes: int, files: tuple[str, ...], borrowed: bool = False) -> DiskEntry:
    return DiskEntry(k, MODEL, {}, 16, 1, nbytes, files, borrowed=borrowed)


def test_a_claim_reserves_bytes_refuses_beyond_the_budget_and_settle_indexes_the_group(tmp_path):
    index = DiskIndex(tmp_path, capacity_bytes=100)
    k1, k2 = key("text", 1), key("text", 2)
    slot = index.claim(k1, 60)
    assert isinstance(slot, WriteSlot) and index.reserved_bytes == 60 and index.used_bytes == 0
    with pytest.raises(CapacityError):
        index.claim(k2, 41)
    assert index.stats()["budget_refusals"] == 1
    e = entry(k1, 55, ("a.arrow",))
    index.settle(slot, e)
    assert slot.done.done() and index.reserved_bytes == 0 and index.used_bytes == 55
    assert index.claim(k1, 60) is e and index.info(k1) is e and index.inventory() == [e]
    st = index.stats(scan_s=0.5)
    assert (st["writes"], st["write_bytes"], st["groups"], st["scan_s"]) == (1, 55, 1, 0.5)
    assert list(st)[:4] == ["capacity_bytes", "used_bytes", "groups", "scan_s"]


def test_a_second_claim_of_a_key_in_flight_waits_for_the_first_which_may_fail(tmp_path):
    index = DiskIndex(tmp_path, capacity_bytes=100)
    k = key("text", 3)
    slot = index.claim(k, 40)
    other = index.claim(k, 40)
    assert isinstance(other, concurrent.futures.Future) and other is slot.done and not other.done()
    index.settle(slot, None)                  # the first write failed: nothing indexed
    assert other.done() and index.info(k) is None and index.reserved_bytes == 0
    assert isinstance(index.claim(k, 40), WriteSlot)


def test_remove_unlinks_owned_files_and_only_forgets_borrowed_ones(tmp_path):
    index = DiskIndex(tmp_path, capacity_bytes=1 << 20)
    mine, theirs = key("text", 4), key("text", 5)
    for name in ("m.arrow", "t.arrow"):
        (tmp_path / name).write_bytes(b"x" * 10)
    index.adopt(entry(mine, 10, ("m.arrow",)))
    index.adopt(entry(theirs, 10, ("t.arrow",), borrowed=True))
    assert index.used_bytes == 10 and index.stats()["borrowed_at_start"] == 1
    assert index.remove(mine) and index.remove(theirs) and not index.remove(mine)
    assert not (tmp_path / "m.arrow").exists() and (tmp_path / "t.arrow").exists()
    assert index.used_bytes == 0 and index.stats()["removes"] == 2


def test_corrupt_quarantines_the_current_entry_and_only_counts_a_stale_one(tmp_path):
    index = DiskIndex(tmp_path, capacity_bytes=1 << 20)
    k = key("text", 6)
    (tmp_path / "g.arrow").write_bytes(b"x" * 10)
    e = entry(k, 10, ("g.arrow",))
    index.adopt(e)
    index.corrupt(entry(k, 10, ("other.arrow",)), "stale")     # not what the index holds
    assert index.info(k) is e and (tmp_path / "g.arrow").exists()
    index.corrupt(e, "bad")
    assert index.info(k) is None and index.used_bytes == 0 and not (tmp_path / "g.arrow").exists()
    assert len(list((tmp_path / QUARANTINE_DIR).iterdir())) == 1
    st = index.stats()
    assert (st["corrupt_reads"], st["quarantined"]) == (2, 1)


def test_reads_over_an_index_alone_count_a_miss_and_refuse_once_it_is_closed(tmp_path):
    index = DiskIndex(tmp_path, capacity_bytes=1 << 20)
    reads = DiskReads(index, direct=False, threads=1, ahead_layers=0)
    assert reads.get(key("text", 7), TEXT, MODEL) is None and index.stats()["misses"] == 1
    index.close()
    with pytest.raises(ClosedError):
        reads.get(key("text", 7), TEXT, MODEL)
    with pytest.raises(ClosedError):
        index.claim(key("text", 7), 1)
    reads.close()
