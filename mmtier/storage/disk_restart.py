"""The disk tier's warm restart: what a directory already holds, adopted into a ``DiskIndex``.

``adopt_directory`` scans the directory once, reading only each file's footer and schema
(``arrow_format.scan_file``; many files: side by side on ``threads`` threads). It removes
``.tmp`` leftovers of writers that are gone (another running process's write in flight is left
alone), leaves alone well-formed files of another model and a live writer's files of an older
format, quarantines every other file it cannot use (bad, misnamed, an older format whose writer
is gone) and every group whose chunks do not add up, and adopts each complete group: owned by
this tier, or borrowed where its writer still runs. Its layout (``DiskEntry.extents``) is not
known until a first full read. Every outcome is counted (``*_at_start``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os

import pyarrow as pa

from ..content import ContentKey
from ..errors import CorruptDataError
from . import writers
from .arrow_format import FORMAT_VERSION, SUFFIX, file_name, group_fields, scan_file
from .disk_index import DiskEntry, DiskIndex

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"


def adopt_directory(index: DiskIndex, model: str, threads: int) -> None:
    """Fill ``index`` (empty) with the complete groups of ``model`` found in its directory."""
    candidates: list[str] = []
    with os.scandir(index.dir) as it:
        for d in it:
            if not d.is_file(follow_symlinks=False):
                continue
            if d.name.endswith(TMP_SUFFIX):
                if writers.tmp_in_flight(d.name):    # another running process's write
                    index.count(tmp_kept_at_start=1)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(d.path)
                index.count(tmp_removed_at_start=1)
            elif d.name.endswith(SUFFIX):
                candidates.append(d.name)

    def one(name: str) -> tuple[dict, int] | str | None:
        return _scan_one(index, model, name)

    # Footers are small random reads: overlap them (the GIL is released inside Arrow).
    if len(candidates) > 64:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(one, candidates, chunksize=64))
    else:
        results = [one(name) for name in candidates]
    groups: dict[str, list[tuple[dict, str, int]]] = {}
    for name, found in zip(candidates, results):
        if found == "foreign":
            index.count(foreign_at_start=1)
        elif found in ("old", "old live"):
            index.count(old_format_at_start=1)
            if found == "old":               # its writer is gone: set aside, recomputed
                log.warning("mmtier disk tier: %s is an older file format; quarantined", name)
                index.quarantine(index.dir / name, "quarantined_at_start")
        elif found is None:
            index.quarantine(index.dir / name, "quarantined_at_start")
        else:
            groups.setdefault(found[0]["key"]["digest"], []).append((found[0], name, found[1]))
    for chunks in groups.values():
        chunks.sort(key=lambda c: c[0]["chunk"])
        m0 = chunks[0][0]
        ok = ([c[0]["chunk"] for c in chunks] == list(range(m0["num_chunks"]))
              and all(group_fields(c[0]) == group_fields(m0) for c in chunks)
              and [c[0]["first_page"] for c in chunks]
              == [sum(x[0]["chunk_pages"] for x in chunks[:i]) for i in range(len(chunks))]
              and sum(c[0]["chunk_pages"] for c in chunks) == m0["num_pages"])
        if not ok:
            index.count(partial_groups_at_start=1)
            for _, name, _ in chunks:
                index.quarantine(index.dir / name, "quarantined_at_start")
            continue
        writer = m0.get("writer")
        index.adopt(DiskEntry(ContentKey.from_wire(m0["key"]), m0["model"], m0["layout"],
                              m0["num_tokens"], m0["num_pages"], sum(c[2] for c in chunks),
                              tuple(c[1] for c in chunks),
                              borrowed=writer != writers.this_writer() and writers.alive(writer)))


def _scan_one(index: DiskIndex, model: str, name: str) -> tuple[dict, int] | str | None:
    """``(metadata, size)`` of a well-formed file of this model, ``"foreign"`` for a
    well-formed file of another model (left alone: another process's), else ``None``."""
    path = index.dir / name
    try:
        meta = scan_file(str(path))
        key = ContentKey.from_wire(meta["key"])
        if meta["model"] != model:
            return "foreign"
        if meta["format"] != FORMAT_VERSION:       # an old layout: never read (a miss)
            return "old live" if writers.alive(meta.get("writer")) else "old"
        if name != file_name(key.modality, key.hex, meta["chunk"], meta["num_chunks"]):
            return None
        return meta, path.stat().st_size
    except (OSError, pa.ArrowException, CorruptDataError, ValueError, KeyError, TypeError):
        return None
