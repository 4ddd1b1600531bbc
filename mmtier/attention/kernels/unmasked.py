"""Attention over pages that need no mask: every written token visible to every query.

For decode that is every page an item reads; for a block of queries, every page up to the
first query's position. Such keys can go to torch's fused CPU flash-attention kernel
(``aten::_scaled_dot_product_flash_attention_for_cpu``) as plain dense sequences. Measured on
a 2-core CPU at decode (one query, 4 query heads per KV head, fp32), the kernel over gathered
pages runs about twice as fast as the masked matmul / softmax loop of ``reference``: it works
in blocks that stay in cache between the score and the value products, in one parallel region
per call. It needs each key sequence at one stride, which a page of the pool only is by itself:

- full pages are visited in sorted id order, in chunks of about ``GATHER_BYTES`` of K+V:
  attention does not depend on key order, sorted ids read memory forward (~10% faster
  gathers than table order), and runs of consecutive ids become chunks that are one strided
  view of the pool;
- such a chunk of float32 pages with at least ``IN_PLACE_MIN`` elements per page and head is
  read in place, the pages as the kernel's batch (no copy; 10-20% faster from 64 x 64). With
  smaller pages a batch entry has too little work: 16 tokens x 64 dims run slower in place
  than copied;
- any other chunk is copied into one reused float32 buffer and cut into equal key sequences,
  one per thread, so that a kernel parallelised over batch x heads keeps every thread busy
  even with one KV head. A chunk of scattered pages is one ``index_select`` of page rows; a
  run of 16-bit pages is one strided copy that widens as it reads (``_copy_run``: one pass,
  about twice as fast as a gather then a conversion; a disk batch's one-layer buffer is such
  a run). ``GATHER_BYTES`` (8 MiB of float32 K+V, thousands of keys per call) was measured
  against 2, 4 and 16 MiB on one core: 1.2-1.3x faster than 2 MiB over bfloat16 pages of
  Qwen2.5-VL's shape (4 KV heads x 128, GQA 7), 1.0-1.3x over float32 pages of one head x 64;
- partly written pages (a segment's last page) have their written slots gathered token by
  token, so unwritten slots (which may hold NaN) are never read by the kernel;
- copies are where a 16-bit pool is widened: a float32 query keeps its precision and every
  dtype pair runs the float32 kernel;
- fp8 pages are not copied at all where the native helper applies (``native.fp8_attention``):
  one C call over every full page widens each row in registers where it is used, the softmax
  online, split over torch's threads; at a decode over Qwen2.5-VL's shape (4 KV heads x 128,
  GQA 7) about twice the widen-then-flash path's speed on one core of the 2-core EPYC;
- every kernel call yields exact partial states ``(out, lse)`` (one per batch entry), combined
  by a log-sum-exp merge in bounded groups, so memory stays bounded for long query blocks.

The op is private. If it is missing, or raises for some shape or dtype, ``unmasked_attention``
returns ``None`` and the caller runs its masked loop over these pages instead.
"""

from __future__ import annotations

import torch

from ...native import fp8, fp8_attention
from .layout import PagedKV

GATHER_BYTES = 8 << 20
IN_PLACE_MIN = 4096   # page_size * head_dim from which a float32 run is read in place
FLASH_OP = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class _Unavailable(Exception):
    """The flash op is missing or refused an input."""


def unmasked_attention(qh: torch.Tensor, op: PagedKV, page_ids: torch.Tensor, valid: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of ``qh [Hkv, R, D]`` (float32, unscaled) over the first ``valid`` tokens of
    each page ``page_ids`` (int64; every one of those tokens visible to every query row, every
    ``valid > 0``); ``(out [Hkv, R, D], lse [Hkv, R])`` in float32, or ``None`` when the flash
    op is unavailable."""
    states = _States()
    full = valid == op.page_size
    try:
        _full_pages(qh, op, page_ids[full], scale, states)
        _partial_pages(qh, op, page_ids[~full], valid[~full], scale, states)
    except _Unavailable:
        return None
    return states.merged()


def _full_pages(qh, op: PagedKV, page_ids, scale: float, states: _States) -> None:
    """Full pages in sorted chunks: runs in place or gathered, as the module docstring says."""
    if page_ids.numel() == 0:
        return
    hkv, rows, head_dim = qh.shape
    size = op.page_size
    ids = page_ids.sort().values
    if op.kv.dtype in fp8.FP8:                             # fp8: widened in registers, one pass
        state = fp8_attention.attend(qh, op.kv, op.layer, ids, scale)
        if state is not None:
            states.add(state[0][None], state[1][None])
            return
    page_elems = size * hkv * head_dim                     # one page's K (or V) in one layer
    step = _pages_per_chunk(page_elems)
    buf = torch.empty(2 * step * page_elems, dtype=torch.float32, device=qh.device)
    gather = _Gather(op, ids, step)
    in_place = op.kv.dtype == torch.float32 and size * head_dim >= IN_PLACE_MIN
    want_parts = max(1, torch.get_num_threads() // hkv)
    for c0, n, run_start in _chunks(ids, step):
        if in_place and run_start is not None:             # pages as the batch, no copy
            pages = op.kv[run_start:run_start + n, op.layer]                  # [n, 2, P, Hkv, D]
            k, v = pages[:, 0].transpose(1, 2), pages[:, 1].transpose(1, 2)   # [n, Hkv, P, D]
        else:                                              # one gathered sequence in parts
            dst = buf[:2 * n * page_elems].view(2, n, page_elems)
            kv = gather(c0, n, dst) if run_start is None else _copy_run(op, run_start, n, dst)
            parts = _largest_divisor_at_most(n * size, want_parts)
            k, v = (x.view(parts, n * size // parts, hkv, head_dim).transpose(1, 2) for x in kv)
        states.add(*_flash(qh, k, v, scale))


def _copy_run(op: PagedKV, first: int, n: int, out: torch.Tensor) -> torch.Tensor:
    """K and V of the ``n`` consecutive pages from ``first`` in layer ``op.layer`` into the
    float32 ``out [2, n, page elements]``: one strided copy that widens as it reads (a 16-bit
    run costs one pass over its bytes, not a gather and then a conversion)."""
    size, hkv, head_dim = op.page_size, op.num_kv_heads, op.head_dim
    src = op.kv[first:first + n, op.layer]                                    # [n, 2, P, Hkv, D]
    if src.dtype in fp8.FP8 and all(fp8.widen(src[:, i], out[i].view(n, size, hkv, head_dim)) for i in (0, 1)):
        return out                                                            # fp8: one table pass
    out.view(2, n, size, hkv, head_dim).copy_(src.transpose(0, 1))
    return out


def _partial_pages(qh, op: PagedKV, page_ids, valid, scale: float, states: _States) -> None:
    """The written slots of partly written pages, gathered token by token, a chunk at a time."""
    hkv, _, head_dim = qh.shape
    step = _pages_per_chunk(op.page_size * hkv * head_dim)
    for c0 in range(0, page_ids.shape[0], step):
        k, v = _written_slots(op, page_ids[c0:c0 + step], valid[c0:c0 + step])    # [T, Hkv, D]
        states.add(*_flash(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale))


def _written_slots(op: PagedKV, ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (float32, ``[sum(valid), Hkv, D]``) of the first ``valid`` slots of pages ``ids``."""
    kv = op.kv
    size, hkv, head_dim = op.page_size, op.num_kv_heads, op.head_dim
    if not kv.is_contiguous():
        pages = kv[ids, op.layer]                                            # [n, 2, P, Hkv, D]
        written = torch.arange(size, device=kv.device)[None, :] < valid[:, None]
        return pages[:, 0][written].float(), pages[:, 1][written].float()
    # one row per token of K or V in one layer; K slot j of page p in this layer is row
    # ((p * layers + layer) * 2) * P + j and its V is P rows further
    tokens = kv.view(-1, hkv * head_dim)
    first = (ids * kv.shape[1] + op.layer) * (2 * size)
    starts = torch.cumsum(valid, 0) - valid
    slot = torch.arange(int(valid.sum()), device=kv.device) - torch.repeat_interleave(starts, valid)
    rows = torch.repeat_interleave(first, valid) + slot
    k = torch.index_select(tokens, 0, rows).view(-1, hkv, head_dim)
    v = torch.index_select(tokens, 0, rows + size).view(-1, hkv, head_dim)
    return widened(k), widened(v)


def widened(t: torch.Tensor) -> torch.Tensor:
    """``t.float()``; fp8 through the native table (``native.fp8``) where it applies."""
    if t.dtype in fp8.FP8:
        out = torch.empty(t.shape, dtype=torch.float32, device=t.device)
        if fp8.widen(t, out):
            return out
    return t.float()


def _flash(qh, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over key sequences ``k, v [batch, Hkv, T, D]`` for the same ``qh``:
    ``(out [batch, Hkv, R, D], lse [batch, Hkv, R])``."""
    if FLASH_OP is None:
        raise _Unavailable
    try:
        return FLASH_OP(qh.expand(k.shape[0], *qh.shape), k, v, scale=scale)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        raise _Unavailable from e


class _States:
    """Partial states over disjoint, non-empty key sets, merged exactly by log-sum-exp whenever
    the pending ones outgrow ``GATHER_BYTES``."""

    def __init__(self):
        self.outs: list[torch.Tensor] = []     # [m, Hkv, R, D] each
        self.lses: list[torch.Tensor] = []     # [m, Hkv, R] each
        self.held = 0

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.outs.append(out)
        self.lses.append(lse)
        self.held += out.numel()
        if self.held * 4 > GATHER_BYTES and len(self.outs) > 1:
            out, lse = self.merged()
            self.outs, self.lses, self.held = [out[None]], [lse[None]], out.numel()

    def merged(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.outs) == 1 and self.outs[0].shape[0] == 1:
            return self.outs[0][0], self.lses[0][0]
        out = torch.cat(self.outs)
        lse = torch.cat(self.lses)
        top = lse.amax(dim=0)                  # finite: every key set is non-empty
        w = torch.exp(lse - top)
        total = w.sum(dim=0)
        return (out * w[..., None]).sum(dim=0) / total[..., None], top + torch.log(total)


def _pages_per_chunk(page_elems: int) -> int:
    """Pages whose K+V, as float32, fill about ``GATHER_BYTES``."""
    return max(1, GATHER_BYTES // (2 * page_elems * 4))


def _chunks(ids: torch.Tensor, step: int) -> list[tuple[int, int, int | None]]:
    """Cut sorted ``ids`` into chunks of ``step``: ``(start, count, first id)`` with the first id
    only when the chunk's ids are consecutive (one strided view of the pool), else ``None``."""
    total = ids.shape[0]
    starts = torch.arange(0, total, step, device=ids.device)
    ends = (starts + step).clamp_max(total)
    breaks = torch.zeros(total, dtype=torch.long, device=ids.device)
    breaks[1:] = torch.cumsum(ids[1:] != ids[:-1] + 1, dim=0)
    consecutive = (breaks[ends - 1] == breaks[starts]).tolist()
    firsts = ids[starts].tolist()
    return [(s, e - s, first if ok else None)
            for s, e, ok, first in zip(starts.tolist(), ends.tolist(), consecutive, firsts)]


class _Gather:
    """Copies K and V of the chunks (of ``step`` pages) of the sorted pages ``ids`` in layer
    ``op.layer`` into a float32 ``out [2, n, page elements]``, converting the pool's dtype."""

    def __init__(self, op: PagedKV, ids: torch.Tensor, step: int):
        self.op, self.ids = op, ids
        kv = op.kv
        self.rows = self.row_ids = self.stage = None
        if kv.is_contiguous():
            # K (or V) of one page in one layer is one row of this view. Row ids are laid out
            # chunk by chunk, its K rows then its V rows, so one index_select fills a chunk:
            # into ``out`` itself for a float32 pool, else into a staging buffer.
            self.rows = kv.view(kv.shape[0] * kv.shape[1] * 2, -1)
            k_rows = (ids * kv.shape[1] + op.layer) * 2
            index = torch.arange(ids.shape[0], device=ids.device)
            first = index - index % step                       # the chunk's first page
            at = first + index                                 # 2 * first + offset in chunk
            in_chunk = (ids.shape[0] - first).clamp_max(step)
            self.row_ids = torch.empty(2 * ids.shape[0], dtype=torch.long, device=ids.device)
            self.row_ids[at] = k_rows
            self.row_ids[at + in_chunk] = k_rows + 1
            if kv.dtype != torch.float32:
                self.stage = torch.empty(2 * step, self.rows.shape[1], dtype=kv.dtype, device=kv.device)

    def __call__(self, c0: int, n: int, out: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            pages = self.op.kv[self.ids[c0:c0 + n], self.op.layer]    # [n, 2, P, Hkv, D]
            return out.copy_(pages.flatten(2).transpose(0, 1))
        dst = out.view(2 * n, -1) if self.stage is None else self.stage[:2 * n]
        torch.index_select(self.rows, 0, self.row_ids[2 * c0:2 * (c0 + n)], out=dst)
        if self.stage is None or fp8.widen(dst, out.view(dst.shape)):
            return out
        return out.copy_(dst.view(out.shape))


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)
