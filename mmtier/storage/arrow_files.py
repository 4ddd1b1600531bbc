"""The disk tier: one Arrow IPC file per modality group (per 64 MiB chunk of a large group).

File format (version 1), ``{modality}-{digest hex}-{chunk:04d}of{num_chunks:04d}.arrow``:

- columns ``page`` (``fixed_size_binary(page_bytes)``, one row per page, the raw page-major
  bytes) and ``xxh3`` (``uint64``, xxh3_64 of that page);
- schema metadata ``mmtier.meta``: JSON with the format version, the key's wire fields, the
  model, the layout (``spec.layout_fields()`` plus ``name`` and ``page_bytes``), the group's
  ``num_tokens`` and ``num_pages``, and this chunk's ``chunk``, ``num_chunks``, ``first_page``,
  ``chunk_pages``; ``mmtier.meta.xxh3``: xxh3_64 of that JSON, so no metadata byte can change
  unnoticed. Nothing is ever unpickled: metadata is JSON, payloads are bytes.

Writes (``put_async``; ``put`` runs it on the tier's own loop) go through aiofiles: a unique
``.tmp`` file in the same directory, fsync, rename, and one fsync of the directory per group.
The Arrow writer is fed through a collecting sink, so the payload is never copied before the
write: the large buffers handed to aiofiles are the caller's own page memory. A write refused
for space (ENOSPC, the ``free_floor_bytes`` floor checked with ``statvfs``) raises
``StorageFullError``; beyond the byte budget, ``CapacityError``; other I/O errors,
``StorageIOError``. Every failure removes what that write created and leaves the tier working.

Reads (``get``) map the files with ``pyarrow.memory_map`` and copy the pages once, block by
block, into a new tensor or a destination the caller gives (e.g. host slab slots), verifying
each page's xxh3 right after its copy, while it is hot. Any mismatch (key fields, model,
layout, checksums, truncation, not Arrow at all) is a miss: ``corrupt_reads`` rises and the
group's files move to ``quarantine/``. Wrong data is never returned.

Warm restart: the constructor scans the directory, reading only each file's footer and schema,
removes ``.tmp`` leftovers, indexes complete groups, and quarantines bad files and partial
groups (``quarantined_at_start``). ``inventory()`` lists what is on disk so the cache can adopt
it (it should ``KeyMaker.verify`` each key: a file is not trusted to have been issued here).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import errno
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiofiles
import aiofiles.os
import numpy as np
import pyarrow as pa
import torch
import xxhash

from ..config import ModalitySpec
from ..content import ContentKey
from ..errors import (
    CapacityError,
    ClosedError,
    CorruptDataError,
    DTypeError,
    MMTierError,
    ShapeError,
    StorageFullError,
    UnknownModalityError,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SUFFIX = ".arrow"
TMP_SUFFIX = ".tmp"
QUARANTINE_DIR = "quarantine"
_META = b"mmtier.meta"
_META_SUM = b"mmtier.meta.xxh3"
_CHUNK_FIELDS = ("chunk", "first_page", "chunk_pages")
_BLOCK_BYTES = 4 << 20
_FILE_OVERHEAD = 4096
_afsync = aiofiles.os.wrap(os.fsync)


class StorageIOError(MMTierError):
    """A disk-tier write failed for a reason other than space (EIO, permissions, ...)."""


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


def layout_of(spec: ModalitySpec) -> dict[str, str]:
    return {"name": str(spec.name), "page_bytes": str(spec.page_bytes), **dict(spec.layout_fields())}


def file_name(modality: str, digest_hex: str, chunk: int, num_chunks: int) -> str:
    return f"{modality}-{digest_hex}-{chunk:04d}of{num_chunks:04d}{SUFFIX}"


def page_rows(spec: ModalitySpec, pages: torch.Tensor | Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Pages as uint8 numpy rows ``[k, page_bytes]`` sharing the tensors' memory (CPU)."""
    runs = [pages] if isinstance(pages, torch.Tensor) else list(pages)
    out = []
    for t in runs:
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"pages must be torch tensors, got {type(t).__name__}")
        if t.dtype != spec.torch_dtype:
            raise DTypeError(f"{spec.name}: pages are {t.dtype}, spec wants {spec.torch_dtype}")
        if tuple(t.shape[1:]) != tuple(spec.page_shape):
            raise ShapeError(f"{spec.name}: page shape {tuple(t.shape[1:])} != {spec.page_shape}")
        t = t.detach().cpu().contiguous()
        out.append(t.reshape(-1).view(torch.uint8).numpy().reshape(t.shape[0], spec.page_bytes))
    return out


class _Sink:
    """A write-only file for ``pa.PythonFile`` that keeps the parts instead of copying them."""

    def __init__(self) -> None:
        self.parts: list[object] = []
        self.pos = 0
        self.closed = False

    def write(self, data: object) -> int:
        n = memoryview(data).nbytes  # type: ignore[arg-type]
        self.parts.append(data)
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True

    def coalesced(self, small: int = 1 << 16) -> list[object]:
        out: list[object] = []
        pending = bytearray()
        for p in self.parts:
            if memoryview(p).nbytes < small:  # type: ignore[arg-type]
                pending += memoryview(p)  # type: ignore[arg-type]
                continue
            if pending:
                out.append(bytes(pending))
                pending = bytearray()
            out.append(p)
        if pending:
            out.append(bytes(pending))
        return out


def _schema(meta: dict, page_bytes: int) -> pa.Schema:
    blob = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return pa.schema([("page", pa.binary(page_bytes)), ("xxh3", pa.uint64())],
                     metadata={_META: blob, _META_SUM: xxhash.xxh3_64_hexdigest(blob).encode()})


def serialize(meta: dict, page_bytes: int, rows: list[np.ndarray], sums: np.ndarray) -> list[object]:
    """The bytes of one Arrow IPC file as parts; large parts alias ``rows`` (no copy)."""
    schema = _schema(meta, page_bytes)
    sink = _Sink()
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema) as writer:
        at = 0
        for r in rows:
            k = r.shape[0]
            col = pa.FixedSizeBinaryArray.from_buffers(pa.binary(page_bytes), k, [None, pa.py_buffer(r)])
            writer.write_batch(pa.record_batch([col, pa.array(sums[at:at + k], pa.uint64())], schema=schema))
            at += k
    return sink.coalesced()


def read_meta(schema: pa.Schema) -> dict:
    """The verified JSON metadata of a file's schema, or ``CorruptDataError``."""
    md = schema.metadata or {}
    blob, total = md.get(_META), md.get(_META_SUM)
    if blob is None or total is None or xxhash.xxh3_64_hexdigest(blob).encode() != total:
        raise CorruptDataError("missing or damaged mmtier metadata")
    meta = json.loads(blob)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CorruptDataError(f"unknown format {meta.get('format') if isinstance(meta, dict) else meta!r}")
    want = pa.schema([("page", pa.binary(int(meta["layout"]["page_bytes"]))), ("xxh3", pa.uint64())])
    if not schema.remove_metadata().equals(want):
        raise CorruptDataError(f"unexpected schema {schema.remove_metadata()}")
    return meta


def _group_fields(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k not in _CHUNK_FIELDS}


class _Dest:
    """Destination pages: one tensor or several contiguous runs, addressed by page index."""

    def __init__(self, spec: ModalitySpec, out: torch.Tensor | Sequence[torch.Tensor], n: int):
        runs = [out] if isinstance(out, torch.Tensor) else list(out)
        self.arrays: list[np.ndarray] = []
        self.starts: list[int] = []
        at = 0
        for t in runs:
            if t.dtype != spec.torch_dtype or tuple(t.shape[1:]) != tuple(spec.page_shape):
                raise ShapeError(f"destination {tuple(t.shape)} {t.dtype} does not fit {spec.name}")
            if t.is_cuda or not t.is_contiguous():
                raise DTypeError("destination runs must be contiguous CPU tensors")
            self.starts.append(at)
            self.arrays.append(t.reshape(-1).view(torch.uint8).numpy().reshape(t.shape[0], spec.page_bytes))
            at += t.shape[0]
        if at != n:
            raise ShapeError(f"destination holds {at} pages, the group has {n}")
        self.block = max(1, _BLOCK_BYTES // spec.page_bytes)

    def fill(self, first: int, src: np.ndarray, sums: list[int]) -> None:
        """Copy ``src`` rows to pages ``first..`` and verify each copied page's xxh3."""
        i, k = 0, src.shape[0]
        while i < k:
            r = bisect.bisect_right(self.starts, first + i) - 1
            local = first + i - self.starts[r]
            m = min(self.arrays[r].shape[0] - local, k - i, self.block)
            dst = self.arrays[r][local:local + m]
            np.copyto(dst, src[i:i + m])
            for j in range(m):
                if xxhash.xxh3_64_intdigest(dst[j]) != sums[i + j]:
                    raise CorruptDataError(f"checksum mismatch at page {first + i + j}")
            i += m


class DiskTier:
    """Arrow IPC files of groups in one directory, under a byte budget. Thread-safe."""

    def __init__(self, directory: str | os.PathLike, *, model: str, capacity_bytes: int,
                 free_floor_bytes: int = 0, chunk_bytes: int = 64 << 20, io_timeout_s: float = 300.0):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.capacity_bytes = capacity_bytes
        self.free_floor_bytes = free_floor_bytes
        self.chunk_bytes = chunk_bytes
        self.io_timeout_s = io_timeout_s
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._index: dict[bytes, DiskEntry] = {}
        self._writing: dict[bytes, concurrent.futures.Future] = {}
        self._used = 0
        self._reserved = 0
        self._closed = False
        self._counts = dict.fromkeys(
            ("writes", "write_bytes", "hits", "misses", "corrupt_reads", "quarantined",
             "quarantined_at_start", "partial_groups_at_start", "tmp_removed_at_start",
             "full_errors", "floor_refusals", "budget_refusals", "io_errors", "removes"), 0)
        t0 = time.perf_counter()
        self._scan()
        self.scan_s = time.perf_counter() - t0

    # ---- accounting ----
    @property
    def used_bytes(self) -> int:
        return self._used

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {"capacity_bytes": self.capacity_bytes, "used_bytes": self._used,
                    "groups": len(self._index), "scan_s": self.scan_s, **self._counts}

    def inventory(self) -> list[DiskEntry]:
        with self._lock:
            return list(self._index.values())

    def info(self, key: ContentKey) -> DiskEntry | None:
        with self._lock:
            e = self._index.get(key.digest)
            return e if e is not None and e.key == key else None

    # ---- the tier interface ----
    def contains(self, key: ContentKey) -> bool:
        return self.info(key) is not None

    def put(self, key: ContentKey, spec: ModalitySpec, num_tokens: int,
            pages: torch.Tensor | Sequence[torch.Tensor]) -> DiskEntry:
        """Write a group (blocking). ``pages``: ``[n, *page_shape]`` or contiguous runs of it."""
        with self._sync_lock:
            if self._closed:
                raise ClosedError("disk tier is closed")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(self.put_async(key, spec, num_tokens, pages))

    async def put_async(self, key: ContentKey, spec: ModalitySpec, num_tokens: int,
                        pages: torch.Tensor | Sequence[torch.Tensor]) -> DiskEntry:
        if spec.name != key.modality:
            raise UnknownModalityError(f"key of modality {key.modality!r} with spec {spec.name!r}")
        n = spec.pages_for(num_tokens)
        rows = page_rows(spec, pages)
        if sum(r.shape[0] for r in rows) != n:
            raise ShapeError(f"{spec.name}: {sum(r.shape[0] for r in rows)} pages for {n} needed")
        per_file = max(1, self.chunk_bytes // spec.page_bytes)
        num_chunks = max(1, -(-n // per_file))
        need = n * spec.page_bytes + num_chunks * _FILE_OVERHEAD
        while True:
            with self._lock:
                if self._closed:
                    raise ClosedError("disk tier is closed")
                done = self._index.get(key.digest)
                if done is not None and done.key == key:
                    return done
                other = self._writing.get(key.digest)
                if other is None:
                    if self._used + self._reserved + need > self.capacity_bytes:
                        self._counts["budget_refusals"] += 1
                        raise CapacityError(f"disk tier: {need} bytes wanted, "
                                            f"{self.capacity_bytes - self._used - self._reserved} free")
                    self._reserved += need
                    mine: concurrent.futures.Future = concurrent.futures.Future()
                    self._writing[key.digest] = mine
                    break
            # The same group is being written by another call: wait for it, then look again.
            try:
                await asyncio.wait_for(asyncio.wrap_future(other), self.io_timeout_s)
            except TimeoutError:
                raise StorageIOError(f"another write of {key!r} did not finish in "
                                     f"{self.io_timeout_s} s") from None
        entry = None
        written: list[Path] = []
        try:
            entry = await self._write_group(key, spec, num_tokens, n, rows, per_file, num_chunks, need,
                                            written)
        except OSError as exc:
            await self._cleanup(written)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._count("full_errors")
                raise StorageFullError(f"disk full writing {key!r}: {exc}") from exc
            self._count("io_errors")
            raise StorageIOError(f"writing {key!r} failed: {exc}") from exc
        except BaseException:
            await self._cleanup(written)
            raise
        finally:
            with self._lock:
                self._reserved -= need
                del self._writing[key.digest]
                if entry is not None:
                    self._index[key.digest] = entry
                    self._used += entry.nbytes
                    self._counts["writes"] += 1
                    self._counts["write_bytes"] += entry.nbytes
            mine.set_result(None)
        return entry

    def get(self, key: ContentKey, spec: ModalitySpec, expected_model: str,
            out: torch.Tensor | Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        """The group's pages ``[n, *page_shape]``, verified, or ``None`` (miss or corrupt).

        With ``out`` (a tensor or contiguous runs, e.g. ``HostEntry.runs()``) the pages land
        there and ``out`` is returned; after a ``None`` its contents are undefined."""
        if self._closed:
            raise ClosedError("disk tier is closed")
        e = self.info(key)
        if e is None:
            self._count("misses")
            return None
        if e.model != expected_model or e.layout != layout_of(spec):
            self._corrupt(e, f"model/layout {e.model} {e.layout} != {expected_model} {layout_of(spec)}")
            return None
        result = out if out is not None else torch.empty(e.num_pages, *spec.page_shape,
                                                         dtype=spec.torch_dtype)
        dest = _Dest(spec, result, e.num_pages)  # a bad ``out`` raises: it is not corruption
        try:
            for name in e.files:
                self._read_file(self.dir / name, e, dest)
        except FileNotFoundError:
            if self.info(key) is None:  # removed while we read: an ordinary miss
                self._count("misses")
                return None
            self._corrupt(e, "file vanished")
            return None
        except (OSError, pa.ArrowException, CorruptDataError, ValueError, KeyError, TypeError) as exc:
            self._corrupt(e, repr(exc))
            return None
        self._count("hits")
        return result

    async def get_async(self, key: ContentKey, spec: ModalitySpec, expected_model: str,
                        out: torch.Tensor | Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.get, key, spec, expected_model, out)

    def remove(self, key: ContentKey) -> bool:
        with self._lock:
            e = self._index.get(key.digest)
            if e is None or e.key != key:
                return False
            del self._index[key.digest]
            self._used -= e.nbytes
            self._counts["removes"] += 1
        for name in e.files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / name)
        return True

    def close(self) -> None:
        with self._sync_lock:
            self._closed = True
            if self._loop is not None:
                self._loop.run_until_complete(self._loop.shutdown_default_executor())
                self._loop.close()
                self._loop = None

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- batched forms ----
    def contains_many(self, keys: Sequence[ContentKey]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def remove_many(self, keys: Sequence[ContentKey]) -> list[bool]:
        return [self.remove(k) for k in keys]

    # ---- writing ----
    async def _write_group(self, key, spec, num_tokens, n, rows, per_file, num_chunks, need,
                           written: list[Path]) -> DiskEntry:
        st = await aiofiles.os.statvfs(self.dir)
        if st.f_bavail * st.f_frsize - need < self.free_floor_bytes:
            self._count("floor_refusals")
            raise StorageFullError(f"disk tier: writing {need} bytes would cross the free-space floor "
                                   f"({self.free_floor_bytes} bytes; {st.f_bavail * st.f_frsize} free)")
        loop = asyncio.get_running_loop()
        sums = await loop.run_in_executor(None, _page_sums, rows)
        base = {"format": FORMAT_VERSION, "key": key.to_wire(), "model": self.model,
                "layout": layout_of(spec), "num_tokens": num_tokens, "num_pages": n,
                "num_chunks": num_chunks}
        files, total = [], 0
        for c in range(num_chunks):
            lo, hi = c * per_file, min(n, (c + 1) * per_file)
            meta = {**base, "chunk": c, "first_page": lo, "chunk_pages": hi - lo}
            parts = serialize(meta, spec.page_bytes, _slice_rows(rows, lo, hi), sums[lo:hi])
            name = file_name(key.modality, key.hex, c, num_chunks)
            total += await self._write_file(self.dir / name, parts, written)
            files.append(name)
        await _fsync_dir(self.dir)
        return DiskEntry(key, self.model, layout_of(spec), num_tokens, n, total, tuple(files))

    async def _write_file(self, final: Path, parts: list[object], written: list[Path]) -> int:
        tmp = final.with_name(f"{final.name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")
        size = 0
        try:
            async with aiofiles.open(tmp, "wb") as f:
                for p in parts:
                    await f.write(p)
                    size += memoryview(p).nbytes  # type: ignore[arg-type]
                await f.flush()
                await _afsync(f.fileno())
            await aiofiles.os.replace(tmp, final)
        except BaseException:
            await self._cleanup([tmp])
            raise
        written.append(final)
        return size

    async def _cleanup(self, paths: list[Path]) -> None:
        for p in paths:
            try:
                await aiofiles.os.unlink(p)
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("mmtier disk tier: cannot remove %s: %s", p, exc)

    # ---- reading ----
    def _read_file(self, path: Path, e: DiskEntry, dest: _Dest) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
        with pa.memory_map(str(path)) as mm:
            reader = pa.ipc.open_file(mm)
            meta = read_meta(reader.schema)
            if _group_fields(meta) != self._expected_group(e):
                raise CorruptDataError(f"{path.name}: metadata does not match the index")
            pb = int(e.layout["page_bytes"])
            first, rows = int(meta["first_page"]), 0
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                batch.validate()
                col, sums = batch.column(0), batch.column(1)
                if col.null_count or sums.null_count:
                    raise CorruptDataError(f"{path.name}: null pages")
                k = len(col)
                src = np.frombuffer(col.buffers()[1], dtype=np.uint8, count=k * pb,
                                    offset=col.offset * pb).reshape(k, pb)
                sum_list = np.frombuffer(sums.buffers()[1], dtype=np.uint64, count=k,
                                         offset=sums.offset * 8).tolist()
                if first + rows + k > first + int(meta["chunk_pages"]):
                    raise CorruptDataError(f"{path.name}: more rows than chunk_pages")
                dest.fill(first + rows, src, sum_list)
                rows += k
            if rows != int(meta["chunk_pages"]):
                raise CorruptDataError(f"{path.name}: {rows} rows, metadata says {meta['chunk_pages']}")

    def _expected_group(self, e: DiskEntry) -> dict:
        return {"format": FORMAT_VERSION, "key": e.key.to_wire(), "model": e.model,
                "layout": e.layout, "num_tokens": e.num_tokens, "num_pages": e.num_pages,
                "num_chunks": len(e.files)}

    # ---- corruption and quarantine ----
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _corrupt(self, e: DiskEntry, why: str) -> None:
        log.warning("mmtier disk tier: corrupt group %r (%s); quarantined", e.key, why)
        with self._lock:
            self._counts["corrupt_reads"] += 1
            if self._index.get(e.key.digest) is e:
                del self._index[e.key.digest]
                self._used -= e.nbytes
            else:
                return
        for name in e.files:
            self._quarantine(self.dir / name, "quarantined")

    def _quarantine(self, path: Path, counter: str) -> None:
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
        self._count(counter)

    # ---- warm restart ----
    def _scan(self) -> None:
        groups: dict[str, list[tuple[dict, str, int]]] = {}
        with os.scandir(self.dir) as it:
            for d in it:
                if not d.is_file(follow_symlinks=False):
                    continue
                if d.name.endswith(TMP_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(d.path)
                    self._counts["tmp_removed_at_start"] += 1
                    continue
                if not d.name.endswith(SUFFIX):
                    continue
                try:
                    meta = _scan_file(d.path)
                    key = ContentKey.from_wire(meta["key"])
                    if meta["model"] != self.model:
                        raise CorruptDataError(f"model {meta['model']!r}, this tier holds {self.model!r}")
                    if d.name != file_name(key.modality, key.hex, meta["chunk"], meta["num_chunks"]):
                        raise CorruptDataError(f"file name does not match its metadata: {d.name}")
                except (OSError, pa.ArrowException, CorruptDataError, ValueError, KeyError, TypeError):
                    self._quarantine(Path(d.path), "quarantined_at_start")
                    continue
                groups.setdefault(key.hex, []).append((meta, d.name, d.stat().st_size))
        for chunks in groups.values():
            chunks.sort(key=lambda c: c[0]["chunk"])
            m0 = chunks[0][0]
            ok = ([c[0]["chunk"] for c in chunks] == list(range(m0["num_chunks"]))
                  and all(_group_fields(c[0]) == _group_fields(m0) for c in chunks)
                  and sum(c[0]["chunk_pages"] for c in chunks) == m0["num_pages"])
            if not ok:
                self._counts["partial_groups_at_start"] += 1
                for _, name, _ in chunks:
                    self._quarantine(self.dir / name, "quarantined_at_start")
                continue
            key = ContentKey.from_wire(m0["key"])
            nbytes = sum(c[2] for c in chunks)
            self._index[key.digest] = DiskEntry(key, m0["model"], m0["layout"], m0["num_tokens"],
                                                m0["num_pages"], nbytes, tuple(c[1] for c in chunks))
            self._used += nbytes


def _scan_file(path: str) -> dict:
    with pa.memory_map(path) as mm:
        reader = pa.ipc.open_file(mm)
        meta = read_meta(reader.schema)
        if reader.num_record_batches < 1:
            raise CorruptDataError("no record batches")
        return meta


def _page_sums(rows: list[np.ndarray]) -> np.ndarray:
    return np.fromiter((xxhash.xxh3_64_intdigest(r[i]) for r in rows for i in range(r.shape[0])),
                       dtype=np.uint64)


def _slice_rows(rows: list[np.ndarray], lo: int, hi: int) -> list[np.ndarray]:
    out, at = [], 0
    for r in rows:
        a, b = max(lo, at), min(hi, at + r.shape[0])
        if a < b:
            out.append(r[a - at:b - at])
        at += r.shape[0]
    return out


async def _fsync_dir(path: Path) -> None:
    def sync() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    await asyncio.get_running_loop().run_in_executor(None, sync)
