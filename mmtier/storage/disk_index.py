"""The disk tier's index: which groups its directory holds, the byte budget, the counters,
removal and quarantine.

``DiskIndex`` owns one lock over all of it: the entries by key digest (``DiskEntry``: a group's
files and, once known, where their pages lie), the bytes used and reserved under
``capacity_bytes``, the writes in flight (``claim`` a group's bytes before writing it,
``settle`` after: a second write of the same key waits for the first), the tier's counters
(``stats``) and whether it is closed. The writes (``disk_writes.py``), the reads
(``disk_reads.py``) and the warm restart (``disk_restart.py``) each hold the index and go
through these calls; none of them reaches into its fields.

A corrupt group (``corrupt``) leaves the index and its files move to ``quarantine/``; a removed
group's files are unlinked, except a borrowed group's (another running process wrote it: it
is only forgotten here).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..content import ContentKey
from ..errors import CapacityError, ClosedError
from .layer_extent import LayerExtent

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"
COUNTERS = ("writes", "write_bytes", "hits", "misses", "corrupt_reads", "quarantined",
            "quarantined_at_start", "partial_groups_at_start", "tmp_removed_at_start",
            "full_errors", "floor_refusals", "budget_refusals", "io_errors", "removes",
            "read_bytes", "tmp_kept_at_start", "foreign_at_start", "borrowed_at_start",
            "old_format_at_start", "direct_read_files")


@dataclass(frozen=True)
class DiskEntry:
    """One group on disk, as the index knows it."""

    key: ContentKey
    model: str
    layout: dict[str, str]
    num_tokens: int
    num_pages: int
    nbytes: int
    files: tuple[str, ...]
    # Where the pages lie in each file and the digests of all its bytes, known from the write
    # or a first verified read; ``None`` after a warm restart until that read. With them a read
    # is a few syscalls per file (``read_whole``, ``read_layer_extent``) instead of parsing the Arrow footer.
    extents: tuple[LayerExtent, ...] | None = None
    # Written by another process that still runs (a directory shared by engine processes):
    # read like any other, but not counted in this tier's budget nor ever deleted by it.
    borrowed: bool = False


@dataclass(frozen=True)
class WriteSlot:
    """``need`` bytes of the budget reserved for one write of ``key``; ``DiskIndex.settle``
    ends it (exactly once), which wakes any other write of the same key waiting on ``done``."""

    key: ContentKey
    need: int
    done: concurrent.futures.Future


class DiskIndex:
    """The groups in ``directory`` and their bytes under ``capacity_bytes``. Thread-safe."""

    def __init__(self, directory: Path, capacity_bytes: int):
        self.dir = directory
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._entries: dict[bytes, DiskEntry] = {}
        self._writing: dict[bytes, concurrent.futures.Future] = {}
        self._used = 0
        self._reserved = 0
        self._closed = False
        self._counts = dict.fromkeys(COUNTERS, 0)

    # ---- state ----
    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def reserved_bytes(self) -> int:
        """Bytes claimed by the writes in flight (each may still need all of them)."""
        with self._lock:
            return self._reserved

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True

    def stats(self, **extra: object) -> dict[str, object]:
        """Budget, group count, ``extra`` (the tier's own figures), then every counter."""
        with self._lock:
            return {"capacity_bytes": self.capacity_bytes, "used_bytes": self._used,
                    "groups": len(self._entries), **extra, **self._counts}

    def count(self, **counts: int) -> None:
        """Add to counters, together (one lock)."""
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n

    # ---- lookups ----
    def inventory(self) -> list[DiskEntry]:
        with self._lock:
            return list(self._entries.values())

    def info(self, key: ContentKey) -> DiskEntry | None:
        with self._lock:
            e = self._entries.get(key.digest)
            return e if e is not None and e.key == key else None

    def by_digest(self, keys: list[ContentKey]) -> list[DiskEntry | None]:
        """The entries under the keys' digests in one look (the caller compares ``e.key``)."""
        with self._lock:
            return [self._entries.get(k.digest) for k in keys]

    def learn(self, e: DiskEntry, learned: DiskEntry) -> None:
        """Replace ``e`` by ``learned`` (the same group, its extents known now), unless ``e``
        was removed or replaced meanwhile."""
        with self._lock:
            if self._entries.get(e.key.digest) is e:
                self._entries[e.key.digest] = learned

    def adopt(self, e: DiskEntry) -> None:
        """A group found in the directory at a warm restart; a borrowed one takes no budget."""
        with self._lock:
            self._entries[e.key.digest] = e
            if e.borrowed:
                self._counts["borrowed_at_start"] += 1
            else:                            # its writer is gone: this tier takes the files over
                self._used += e.nbytes

    # ---- writes in flight ----
    def claim(self, key: ContentKey, need: int) -> DiskEntry | WriteSlot | concurrent.futures.Future:
        """The group if it is on disk already; else, if another write of ``key`` is in flight,
        the future it sets when done (wait, then claim again); else ``need`` bytes reserved for
        the caller's write (``CapacityError`` beyond the budget, ``ClosedError`` once closed)."""
        with self._lock:
            if self._closed:
                raise ClosedError("disk tier is closed")
            done = self._entries.get(key.digest)
            if done is not None and done.key == key:
                return done
            other = self._writing.get(key.digest)
            if other is not None:
                return other
            if self._used + self._reserved + need > self.capacity_bytes:
                self._counts["budget_refusals"] += 1
                raise CapacityError(f"disk tier: {need} bytes wanted, "
                                    f"{self.capacity_bytes - self._used - self._reserved} free")
            self._reserved += need
            slot = WriteSlot(key, need, concurrent.futures.Future())
            self._writing[key.digest] = slot.done
            return slot

    def settle(self, slot: WriteSlot, entry: DiskEntry | None) -> None:
        """End a claimed write: its reservation returned, ``entry`` (``None``: it failed)
        indexed and counted, and any write of the same key waiting on it woken."""
        with self._lock:
            self._reserved -= slot.need
            del self._writing[slot.key.digest]
            if entry is not None:
                self._entries[slot.key.digest] = entry
                self._used += entry.nbytes
                self._counts["writes"] += 1
                self._counts["write_bytes"] += entry.nbytes
        slot.done.set_result(None)

    # ---- removal and quarantine ----
    def remove(self, key: ContentKey) -> bool:
        with self._lock:
            e = self._entries.get(key.digest)
            if e is None or e.key != key:
                return False
            del self._entries[key.digest]
            self._counts["removes"] += 1
            if e.borrowed:                   # another running process's files: forget them only
                return True
            self._used -= e.nbytes
        for name in e.files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / name)
        return True

    def corrupt(self, e: DiskEntry, why: str) -> None:
        """A read found ``e`` damaged: counted, and (unless it changed meanwhile) dropped from
        the index with its files quarantined."""
        log.warning("mmtier disk tier: corrupt group %r (%s); quarantined", e.key, why)
        with self._lock:
            self._counts["corrupt_reads"] += 1
            current = self._entries.get(e.key.digest)
            if current is not None and current.key == e.key and current.files == e.files:
                del self._entries[e.key.digest]
                self._used -= current.nbytes
            else:
                return
        for name in e.files:
            self.quarantine(self.dir / name, "quarantined")

    def quarantine(self, path: Path, counter: str) -> None:
        """Move ``path`` into ``quarantine/`` (removed where it cannot be moved), counted."""
        qdir = self.dir / QUARANTINE_DIR
        try:
            qdir.mkdir(exist_ok=True)
            os.replace(path, qdir / f"{path.name}.{time.time_ns()}")
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("mmtier disk tier: cannot quarantine %s (%s); removing it", path, exc)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.count(**{counter: 1})
