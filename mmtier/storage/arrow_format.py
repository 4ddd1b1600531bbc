"""The Arrow IPC file format of the disk tier (version 2, layer-major): encode, decode, verify.

A group is stored as one or more files, ``{modality}-{digest hex}-{chunk:04d}of{n:04d}.arrow``:

- columns ``page`` (``fixed_size_binary(page_bytes // L)``, ``L`` the layers a page holds: one
  for an embedding page) and ``xxh3`` (``uint64``: xxh3_64 of that row); ``L`` record batches,
  batch ``l`` holding layer ``l``'s slice of every page of the chunk in page order, so one
  layer of a chunk is one contiguous extent of its file (``layer_extent.py``);
- schema metadata ``mmtier.meta``: JSON with ``format``, ``key`` (the key's wire fields),
  ``model``, ``layout`` (``spec.layout_fields()`` plus ``name`` and ``page_bytes``), the
  group's ``num_tokens``, ``num_pages`` and ``num_chunks``, and this file's ``chunk``,
  ``first_page`` and ``chunk_pages``; ``mmtier.meta.xxh3``: xxh3_64 of that JSON, so no
  metadata byte can change unnoticed.

Nothing is ever unpickled: the metadata is JSON, the payloads are bytes, and the schema must
equal the two plain columns above before any column is touched. ``serialize`` feeds the Arrow
writer through a collecting sink, so the large parts it returns are the caller's own arrays
(the writer's layer-major copy of a chunk: ``layer_extent.layer_major``), and says where each
layer's rows landed in the file. ``read_file`` maps a file, checks both magics and the
metadata against what the index expects, and reads each layer's rows straight into that
layer's slice of the destination pages, verifying each row's xxh3 right after its layer
landed; it returns the file's
``LayerExtent`` (per-layer and frame digests, from the verified bytes), with which
later reads take the lean paths of ``layer_extent.py`` (``read_whole``, ``read_layer_extent``).

Version 1 (page-major: one row per page holding all its layers) is not read: ``read_meta``
refuses it like any unknown format, and the tier's scan leaves a live writer's version-1 files
alone and quarantines the rest (``old_format_at_start``); the groups are recomputed, never
read wrongly.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import xxhash

from ..config import ModalitySpec
from ..errors import CorruptDataError, DTypeError, ShapeError
from .dest_pages import DestPages, layer_slices
from .layer_extent import (
    DIRECT_MIN_EXTENT,
    LayerExtent,
    digest_of_slices,
    preadv_exact,
    read_frame,
)

FORMAT_VERSION = 2
OLD_FORMATS = (1,)  # recognised, not read (see the module's docstring)
SUFFIX = ".arrow"
_META = b"mmtier.meta"
_META_SUM = b"mmtier.meta.xxh3"
_PAD = b"mmtier.pad"
_CHUNK_FIELDS = ("chunk", "first_page", "chunk_pages", "writer")   # per file, not per group
FILE_OVERHEAD = 4096  # bytes a file adds to its pages, at most (budget estimate)

def layout_of(spec: ModalitySpec) -> dict[str, str]:
    """The layout fields a file records (a new dict each call; ``_layout_cached`` for checks)."""
    return dict(_layout_cached(spec))


@functools.lru_cache(maxsize=256)
def _layout_cached(spec: ModalitySpec) -> tuple[tuple[str, str], ...]:
    return (("name", str(spec.name)), ("page_bytes", str(spec.page_bytes)), *spec.layout_fields())


def layout_matches(layout: dict[str, str], spec: ModalitySpec) -> bool:
    return layout == dict(_layout_cached(spec))


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

    def offsets_of(self, addresses: list[int]) -> list[int] | None:
        """Where the parts that start at ``addresses`` (the callers' page memory, passed through
        without a copy) were written, in order; ``None`` if any of them was not."""
        pos, found = 0, {}
        for p in self.parts:
            if isinstance(p, pa.Buffer):
                found.setdefault(p.address, pos)
            pos += memoryview(p).nbytes  # type: ignore[arg-type]
        out = [found.get(a) for a in addresses]
        return None if any(o is None for o in out) else out  # type: ignore[return-value]

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


def layers_of(layout: dict[str, str]) -> int:
    """The layers a page of ``layout`` holds (the record batches of one file)."""
    return 1 if layout["kind"] == "embedding" else int(layout["layers"])


def schema_of(meta: dict, page_bytes: int) -> pa.Schema:
    blob = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return pa.schema([("page", pa.binary(page_bytes)), ("xxh3", pa.uint64())],
                     metadata={_META: blob, _META_SUM: xxhash.xxh3_64_hexdigest(blob).encode()})


def serialize(meta: dict, page_bytes: int, rows: list[np.ndarray], sums: np.ndarray, align: int = 1
              ) -> tuple[list[object], list[int] | None]:
    """The bytes of one Arrow IPC file as parts (large parts alias ``rows``: no copy), and the
    file offset of each row block's page data (``None`` if the writer copied them, so they
    could not be located; the first read then learns them from the footer).

    ``align`` (a power of two over 8): each row block's page data starts at a multiple of it
    where every row block holds at least ``DIRECT_MIN_EXTENT`` bytes, so a layer's extent can
    be read with ``O_DIRECT`` (``layer_extent.read_direct``). The pad
    goes in the record batch's own custom metadata (``mmtier.pad``: spaces), which lengthens
    its message by as many bytes; the file stays plain Arrow IPC and the pad is part of the
    frame, checked like every byte outside the extents."""
    schema = schema_of(meta, page_bytes)
    batches = [pa.record_batch([pa.FixedSizeBinaryArray.from_buffers(pa.binary(page_bytes), r.shape[0],
                                                                     [None, pa.py_buffer(r)]),
                                pa.array(sums[at:at + r.shape[0]], pa.uint64())], schema=schema)
               for r, at in zip(rows, itertools.accumulate([0, *(r.shape[0] for r in rows)]))]
    padded = align > 8 and all(r.shape[0] * page_bytes >= DIRECT_MIN_EXTENT for r in rows)
    starts = _data_starts(schema, batches, rows) if padded else None
    pads = starts is not None
    first, later = starts or (0, 0)
    sink = _Sink()
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema) as writer:
        for i, b in enumerate(batches):
            if pads:
                start = first if i == 0 else sink.pos + later
                writer.write_batch(b, custom_metadata={_PAD: b" " * ((-start) % align)})
            else:
                writer.write_batch(b)
    where = sink.offsets_of([r.ctypes.data for r in rows if r.shape[0]])
    return sink.coalesced(), where


def _data_starts(schema: pa.Schema, batches: list[pa.RecordBatch], rows: list[np.ndarray]
                 ) -> tuple[int, int] | None:
    """Where the first batch's page data lands in the file (after the magic and the schema) and
    how far past a later batch's start its page data lands, each with an empty pad (written to
    a scratch sink: the messages alias the rows, nothing is copied). A pad of ``8 * m`` bytes
    moves them by as many (the metadata is padded to 8 bytes). ``None`` if the writer copied
    the page data (it cannot be located)."""
    sink = _Sink()
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema) as writer:
        writer.write_batch(batches[0], custom_metadata={_PAD: b""})
        before = sink.pos
        if len(batches) > 1:
            writer.write_batch(batches[1], custom_metadata={_PAD: b""})
        at = sink.offsets_of([r.ctypes.data for r in rows[:2]])
    if at is None:
        return None
    return at[0], (at[1] - before if len(at) > 1 else 0)


def read_meta(schema: pa.Schema, formats: tuple[int, ...] = (FORMAT_VERSION,)) -> dict:
    """The verified JSON metadata of a file's schema, or ``CorruptDataError`` (also for a
    format not in ``formats``; the scan passes ``OLD_FORMATS`` too, to recognise them)."""
    md = schema.metadata or {}
    blob, total = md.get(_META), md.get(_META_SUM)
    if blob is None or total is None or xxhash.xxh3_64_hexdigest(blob).encode() != total:
        raise CorruptDataError("missing or damaged mmtier metadata")
    meta = json.loads(blob)
    if not isinstance(meta, dict) or meta.get("format") not in formats:
        raise CorruptDataError(f"unknown format {meta.get('format') if isinstance(meta, dict) else meta!r}")
    width = int(meta["layout"]["page_bytes"])
    if meta["format"] == FORMAT_VERSION:
        width //= layers_of(meta["layout"])
    want = pa.schema([("page", pa.binary(width)), ("xxh3", pa.uint64())])
    if not schema.remove_metadata().equals(want):
        raise CorruptDataError(f"unexpected schema {schema.remove_metadata()}")
    return meta


def group_fields(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k not in _CHUNK_FIELDS}


def group_meta(key_wire: dict, model: str, layout: dict[str, str], num_tokens: int, num_pages: int,
               num_chunks: int) -> dict:
    """The metadata every file of a group records (``group_fields`` of each file's): what a
    writer starts each file's metadata from and what a full read expects to find."""
    return {"format": FORMAT_VERSION, "key": key_wire, "model": model, "layout": layout,
            "num_tokens": num_tokens, "num_pages": num_pages, "num_chunks": num_chunks}


_MAGIC = b"ARROW1\x00\x00"


def open_reader(mm: pa.MemoryMappedFile) -> tuple[pa.ipc.RecordBatchFileReader, int]:
    """An IPC file reader, after checking the leading magic (Arrow checks the trailing one),
    and the address the mapping starts at (to turn buffer addresses into file offsets)."""
    mm.seek(0)
    head = mm.read_buffer(len(_MAGIC))
    if head.to_pybytes() != _MAGIC:
        raise CorruptDataError("not an Arrow IPC file (leading magic)")
    return pa.ipc.open_file(mm), head.address


def scan_file(path: str) -> dict:
    """A file's verified metadata from its footer and schema (an old format's too: the caller
    checks ``meta["format"]``)."""
    with pa.memory_map(path) as mm:
        reader, _ = open_reader(mm)
        meta = read_meta(reader.schema, (FORMAT_VERSION, *OLD_FORMATS))
        if reader.num_record_batches < 1:
            raise CorruptDataError("no record batches")
        return meta


def page_sums(rows: list[np.ndarray]) -> np.ndarray:
    return np.fromiter((xxhash.xxh3_64_intdigest(r[i]) for r in rows for i in range(r.shape[0])),
                       dtype=np.uint64)


def slice_rows(rows: list[np.ndarray], lo: int, hi: int) -> list[np.ndarray]:
    out, at = [], 0
    for r in rows:
        a, b = max(lo, at), min(hi, at + r.shape[0])
        if a < b:
            out.append(r[a - at:b - at])
        at += r.shape[0]
    return out



def read_file(path: Path, expected: dict, first_page: int, dest: DestPages) -> LayerExtent:
    """Verify one file against the group fields the index expects (its pages start at
    ``first_page``) and fill ``dest`` (whole pages); returns where its layers lie and their
    digests, computed from the verified bytes (so later reads take ``read_whole`` or
    ``read_layer_extent``).

    The mapping serves the structure (magics, footer, schema, metadata, checksum column); each
    layer's rows are read with ``preadv`` straight into that layer's slice of every destination
    page at the offsets the mapping reveals (copied once, no page of it faulting through the
    map), and each row's xxh3 checked right after its layer landed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with pa.memory_map(str(path)) as mm:
            reader, base = open_reader(mm)
            meta = read_meta(reader.schema)
            if group_fields(meta) != expected:
                raise CorruptDataError(f"{path.name}: metadata does not match the index")
            num_layers = layers_of(expected["layout"])
            lb = int(expected["layout"]["page_bytes"]) // num_layers
            first, k = int(meta["first_page"]), int(meta["chunk_pages"])
            if first != first_page:
                raise CorruptDataError(f"{path.name}: first page {first}, expected {first_page}")
            if reader.num_record_batches != num_layers:
                raise CorruptDataError(f"{path.name}: {reader.num_record_batches} record batches, "
                                       f"{num_layers} layers")
            views = dest.views(first, k)
            offsets, digests = [], []
            for layer in range(num_layers):
                batch = reader.get_batch(layer)
                batch.validate()
                col, sums = batch.column(0), batch.column(1)
                if col.null_count or sums.null_count:
                    raise CorruptDataError(f"{path.name}: null pages")
                if len(col) != k:
                    raise CorruptDataError(f"{path.name}: layer {layer} has {len(col)} rows, "
                                           f"metadata says {k}")
                offset = col.buffers()[1].address - base + col.offset * lb
                if offset < 0 or offset + k * lb > size:
                    raise CorruptDataError(f"{path.name}: page data outside the file")
                slices = (layer_slices(views, layer, lb) if dest.page_bytes != lb
                          else [v.reshape(-1) for v in views])
                preadv_exact(fd, slices, offset)
                want = np.frombuffer(sums.buffers()[1], dtype=np.uint64, count=k, offset=sums.offset * 8)
                rows = slices if dest.page_bytes != lb else [r for v in views for r in v]
                for j, row in enumerate(rows):
                    if xxhash.xxh3_64_intdigest(row) != int(want[j]):
                        raise CorruptDataError(f"{path.name}: checksum mismatch at page {first + j}, "
                                               f"layer {layer}")
                offsets.append(offset)
                digests.append(digest_of_slices(slices))
            extent = LayerExtent(path.name, size, lb, first, k, tuple(offsets), tuple(digests), 0)
            frame = read_frame(fd, extent.gaps())
            return LayerExtent(path.name, size, lb, first, k, tuple(offsets), tuple(digests), frame)
    finally:
        os.close(fd)
