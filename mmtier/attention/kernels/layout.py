"""The operands of paged attention: a query batch and, per pool, a CSR table over its pages.

One ``PagedKV`` describes one pool (one page size, one head dim) for one layer:

- ``kv``: the pool's page-major view ``[num_pages, num_layers, 2, page_size, num_kv_heads,
  head_dim]`` (index 0 of dim 2 is K, 1 is V);
- ``seg_indptr`` int32 ``[B+1]``: batch item ``b`` owns segments ``seg_indptr[b]:seg_indptr[b+1]``;
- ``seg_page_indptr`` int32 ``[S+1]``: segment ``s`` owns ``page_ids[seg_page_indptr[s]:
  seg_page_indptr[s+1]]``, in token order;
- ``seg_start`` int32 ``[S]``: absolute position of the segment's first token;
- ``seg_len`` int32 ``[S]``: its tokens (``0 <= seg_len <= pages * page_size``), packed from the
  start of its first page.

A ``PagedKV`` may carry ``host``: the same five tables as CPU int32 tensors, when the caller
built them on the host (``build_paged_kv``, the cache's ``compile_segments``). Planning a
Triton launch then reads the host copies (validation, grid, per-page tables) and never waits
on the device; without them it copies a few dozen ints back from the device (one sync).
``upload_ints`` (``pages/kernels/indices.py``, with ``INDEX_DTYPE``: the write kernels' index
arrays are int32 too) moves host-built index arrays to a device in one non-blocking copy.

The queries are ``q [total_q, num_q_heads, head_dim]`` with ``q_indptr`` int32 ``[B+1]`` and
``q_pos`` int32 ``[total_q]`` (absolute positions; key position ``p`` is visible to a query at
``qp`` when ``p <= qp`` under causal masking). Results are ``(out, lse)``: ``lse`` float32
``[total_q, num_q_heads]`` in natural log, ``-inf`` (with ``out == 0``) where a query sees no key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...errors import DTypeError, ShapeError
from ...pages.kernels.indices import INDEX_DTYPE, upload_ints
from .scales import KVScales

TABLES = ("seg_indptr", "seg_page_indptr", "seg_start", "seg_len", "page_ids")


@dataclass(frozen=True)
class HostTables:
    """A ``PagedKV``'s five index tables as CPU int32 tensors (the same values)."""

    seg_indptr: torch.Tensor
    seg_page_indptr: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    page_ids: torch.Tensor


@dataclass(frozen=True)
class PagedKV:
    kv: torch.Tensor
    layer: int
    seg_indptr: torch.Tensor
    seg_page_indptr: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    page_ids: torch.Tensor
    host: HostTables | None = None   # the tables on the host, when built there (no planning sync)
    scales: KVScales | None = None   # fp8 pages' dequantization scales (``scales.py``); None: unscaled

    def at_layer(self, layer: int) -> PagedKV:
        """The same tables over another layer of the pool (a layer is an offset, not a table)."""
        return PagedKV(self.kv, layer, self.seg_indptr, self.seg_page_indptr, self.seg_start,
                       self.seg_len, self.page_ids, host=self.host, scales=self.scales)

    def unscaled(self) -> PagedKV:
        """The same operand without its scales (the kernels' view: fp8 values as stored)."""
        return PagedKV(self.kv, self.layer, self.seg_indptr, self.seg_page_indptr, self.seg_start,
                       self.seg_len, self.page_ids, host=self.host)

    @property
    def page_size(self) -> int:
        return self.kv.shape[3]

    @property
    def num_kv_heads(self) -> int:
        return self.kv.shape[4]

    @property
    def head_dim(self) -> int:
        return self.kv.shape[5]

    @property
    def num_segments(self) -> int:
        return self.seg_start.shape[0]

    def validate(self, batch: int, head_dim: int) -> None:
        """``ShapeError`` / ``DTypeError`` unless the operand fits a batch of ``batch`` items with
        head dim ``head_dim``. What it checks (dims, dtypes, devices, shapes) cannot change for
        the same tensors, so a passed check is remembered on the operand (the cache hands the
        layers and steps of a sequence the same operands)."""
        if self.__dict__.get("_valid_for") == (batch, head_dim):
            return
        self._validate(batch, head_dim)
        object.__setattr__(self, "_valid_for", (batch, head_dim))   # frozen: a memo, not a field

    def _validate(self, batch: int, head_dim: int) -> None:
        if self.kv.dim() != 6 or self.kv.shape[2] != 2:
            raise ShapeError(f"kv must be [pages, layers, 2, page_size, kv_heads, head_dim], got {tuple(self.kv.shape)}")
        if not 0 <= self.layer < self.kv.shape[1]:
            raise ShapeError(f"layer {self.layer} out of range for a pool of {self.kv.shape[1]} layers")
        if self.head_dim != head_dim:
            raise ShapeError(f"query head dim {head_dim} != pool head dim {self.head_dim}")
        for name in TABLES:
            t = getattr(self, name)
            if t.dtype != INDEX_DTYPE:
                raise DTypeError(f"{name} must be int32, got {t.dtype}")
            if t.device != self.kv.device:
                raise DTypeError(f"{name} is on {t.device}, kv on {self.kv.device}")
            if self.host is not None:
                h = getattr(self.host, name)
                if h.dtype != INDEX_DTYPE or h.device.type != "cpu" or h.shape != t.shape:
                    raise DTypeError(f"host copy of {name} must be a CPU int32 tensor of shape {tuple(t.shape)}")
        if self.seg_indptr.shape[0] != batch + 1:
            raise ShapeError(f"seg_indptr has {self.seg_indptr.shape[0]} entries for a batch of {batch}")
        if self.seg_page_indptr.shape[0] != self.num_segments + 1 or self.seg_len.shape[0] != self.num_segments:
            raise ShapeError("seg_page_indptr / seg_len do not match seg_start")


def build_paged_kv(kv: torch.Tensor, layer: int, batch_segments: list[list[tuple[list[int], int, int]]]) -> PagedKV:
    """Build a ``PagedKV`` from Python lists: per batch item, segments ``(page_ids, start, length)``.
    The tables are built on the host and kept there too (``host``), then copied to ``kv``'s
    device at once."""
    seg_indptr, seg_page_indptr, seg_start, seg_len, page_ids = [0], [0], [], [], []
    for segments in batch_segments:
        for pages, start, length in segments:
            page_ids.extend(pages)
            seg_page_indptr.append(len(page_ids))
            seg_start.append(start)
            seg_len.append(length)
        seg_indptr.append(len(seg_start))
    return paged_kv_from_host(kv, layer, seg_indptr, seg_page_indptr, seg_start, seg_len, page_ids)


def paged_kv_from_host(kv: torch.Tensor, layer: int, *tables: Sequence[int]) -> PagedKV:
    """A ``PagedKV`` from the five tables as host integers (in ``TABLES`` order): kept on the
    host as ``host`` and uploaded to ``kv``'s device in one non-blocking copy."""
    host = [torch.tensor(t, dtype=INDEX_DTYPE) for t in tables]
    dev = upload_ints(host, kv.device)
    return PagedKV(kv, layer, *dev, host=HostTables(*host))


def check_queries(q: torch.Tensor, q_indptr: torch.Tensor, q_pos: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ShapeError(f"q must be [total_q, num_q_heads, head_dim], got {tuple(q.shape)}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"q dtype {q.dtype} is not one of float32, float16, bfloat16")
    if q_indptr.dtype != INDEX_DTYPE or q_pos.dtype != INDEX_DTYPE:
        raise DTypeError("q_indptr and q_pos must be int32")
    if q_pos.shape[0] != q.shape[0]:
        raise ShapeError(f"q_pos has {q_pos.shape[0]} entries for {q.shape[0]} queries")
