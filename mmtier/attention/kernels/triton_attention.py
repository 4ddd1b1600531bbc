"""Triton paged attention over heterogeneous pages: one launch per pool, then one exact merge.

Three layers (as in Triton's fused-attention tutorial):

- ``_kernel``: one program per (work item = batch item x query block, KV head, KV split); it
  streams the split's pages of one pool as ``[BLOCK_N, D]`` tiles gathered token by token
  (a tile may span several small pages or part of a large one) and keeps an online softmax
  for a query tile that holds every query head of its KV head group (GQA: each page is read
  once per KV head, never once per query head);
- the launch layer: ``plan_paged_attention`` validates the index tables (ranges, monotone
  CSR, devices, GQA ratio) and picks the grid (work items, KV splits per pool: enough
  programs to fill the GPU), from the tables' host copies when the caller has them (no
  sync: the cache's path), else with one small device -> host copy; ``_launch`` picks the
  tile config and passes every stride, so any strided view works;
- ``paged_attention_triton``: the torch-facing function, ``(out, lse)``.

A batch item's pages in one pool are ``page_ids[batch_page[b]:batch_page[b+1]]`` (segments of
a batch item are contiguous in the CSR), so splitting a sequence across programs
(flash-decoding) is a range split of that slice. With more than one partial result per query
(several pools or several splits), programs write float32 partials and ``triton_merge``
combines them by log-sum-exp; with exactly one, the kernel writes ``out`` directly.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...errors import DTypeError, ShapeError
from ...pages.kernels.indices import INDEX_DTYPE, upload_ints
from ...pages.kernels.launch import gpu_choices, launch_guard
from .layout import PagedKV, check_queries
from .triton_merge import merge_partials

LOG2E = 1.4426950408889634
INTERPRET_BLOCK_N = 128


@triton.jit
def _fp8_bytes_to_f16(x, FP8: tl.constexpr):
    """fp8 bytes (uint8) as float16, exactly, with integer ops that every GPU has (sm_80 has no
    e4m3 conversion): e5m2 (``FP8 == 2``) is float16's top byte; e4m3fn (``FP8 == 1``: sign,
    4 exponent bits of bias 7, 3 mantissa bits) placed in float16's fields reads as the value
    times 2**-8 (bias 15), subnormals included, so it is scaled by 256 (exact). NaN bytes,
    which writes refuse, would read as +-480."""
    b = x.to(tl.uint16)
    if FP8 == 1:
        return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True) * 256.0
    return (b << 8).to(tl.float16, bitcast=True)


@triton.jit
def _tile(q, q_pos, row_ok, kv_head, page, slot, k_pos, k_ok, d64, d_ok,
          m_i, l_i, acc, qk_scale, s_kp, s_kk, s_kt, s_kd,
          CAUSAL: tl.constexpr, FP8: tl.constexpr):
    """One ``[BLOCK_N, D]`` K/V tile folded into the running ``(m, l, acc)`` (base 2). Both dots
    take ``q``'s dtype (the pool's; an fp8 pool's tiles are widened to the query's, exactly:
    every e4m3 / e5m2 value is a float16, bfloat16 and float32 value; ``p`` is cast here) and
    sum in float32; float32 tiles multiply exactly ("ieee", never tf32: the precision asked for
    is only read for float32 operands, 16-bit products are exact anyway)."""
    tok = page.to(tl.int64) * s_kp + slot.to(tl.int64) * s_kt
    k_ptrs = kv_head + tok[:, None] + d64[None, :] * s_kd
    kv_mask = k_ok[:, None] & d_ok[None, :]
    if FP8:
        k = _fp8_bytes_to_f16(tl.load(k_ptrs, mask=kv_mask, other=0), FP8).to(q.dtype)
    else:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    vis = row_ok[:, None] & k_ok[None, :]
    if CAUSAL:
        vis = vis & (k_pos[None, :] <= q_pos[:, None])
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:
        v = _fp8_bytes_to_f16(tl.load(k_ptrs + s_kk, mask=kv_mask, other=0), FP8).to(q.dtype)
    else:
        v = tl.load(k_ptrs + s_kk, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


# lse strides and the group: scalars per row, no vector access to align (fewer variants)
@triton.jit(do_not_specialize=["layer", "pages_per_split", "part_base", "group", "s_lp", "s_lt"])
def _kernel(
    q_ptr, q_indptr_ptr, q_pos_ptr,
    kv_ptr, page_ids_ptr, page_pos_ptr, page_len_ptr, batch_page_ptr,
    work_b_ptr, work_qb_ptr,
    out_ptr, lse_ptr,
    layer, pages_per_split, part_base, group, page_size, head_dim, qk_scale,
    s_qt, s_qh, s_qd,
    s_kp, s_kl, s_kk, s_kt, s_kh, s_kd,
    s_op, s_ot, s_oh, s_od,
    s_lp, s_lt, s_lh,
    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    SKIP_TILES: tl.constexpr, FP8: tl.constexpr,
):
    """Softmax attention of one query tile over one split of one batch item's pages.

    Rows ``r`` of the query tile are (query ``q_lo + r // G``, head ``kvh * G + r % G``, with
    ``G = group``). Key token ``t`` (in page-slot space of the split's page slice, from its
    first page ``p_lo``) lives in page ``j = p_lo + t // page_size`` at slot ``t % page_size``;
    it exists when ``slot < page_len[j]`` and
    sits at absolute position ``page_pos[j] + slot``. For visible keys (causal:
    ``key_pos <= q_pos``), with ``s = q . k * scale`` kept in base 2, the online softmax is

        m' = max(m, max_t s_t);  l' = l * 2^(m - m') + sum_t 2^(s_t - m');
        acc' = acc * 2^(m - m') + sum_t 2^(s_t - m') v_t

    and the program writes ``out = acc / l`` and ``lse = (m + log2 l) * ln 2`` (natural log),
    or ``out = 0, lse = -inf`` when it saw no visible key. Every address is int64. ``group``,
    ``page_size`` and ``head_dim`` are runtime ints (Triton specializes the multiples of 16 of
    the last two), so one compiled variant serves every model shape of its dtypes and tiles. ``FP8``:
    0 for a float pool; 1 (e4m3fn) or 2 (e5m2) for fp8 pages passed as their bytes, widened
    exactly to the query's dtype in ``_tile`` (their scales are the caller's: ``scales.py``).
    """
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(work_b_ptr + w)
    qb = tl.load(work_qb_ptr + w)
    q_lo = tl.load(q_indptr_ptr + b) + qb * (BLOCK_M // group)  # BLOCK_M // G queries per tile
    q_end = tl.load(q_indptr_ptr + b + 1)

    rows = tl.arange(0, BLOCK_M)
    qi = q_lo + rows // group
    head = kvh * group + rows % group
    row_ok = (rows < (BLOCK_M // group) * group) & (qi < q_end)
    d = tl.arange(0, D_PAD)
    d_ok = d < head_dim
    qi64 = qi.to(tl.int64)
    head64 = head.to(tl.int64)
    d64 = d.to(tl.int64)
    q_off = qi64[:, None] * s_qt + head64[:, None] * s_qh + d64[None, :] * s_qd
    # the query takes the pool's dtype: a float32 query over a 16-bit pool is rounded to it
    # (the dots run on 16-bit tiles, as FlashAttention's and vLLM's require one dtype); over an
    # fp8 pool it keeps its own and the tiles are widened to it (``_tile``)
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if not FP8:
        q = q.to(kv_ptr.dtype.element_ty)
    q_pos = tl.load(q_pos_ptr + qi, mask=row_ok, other=-1)
    max_q_pos = tl.max(q_pos, 0)

    p_first = tl.load(batch_page_ptr + b).to(tl.int64)
    p_lo = p_first + split.to(tl.int64) * pages_per_split
    p_hi = tl.minimum(tl.load(batch_page_ptr + b + 1).to(tl.int64), p_lo + pages_per_split)
    n_tok = ((p_hi - p_lo) * page_size).to(tl.int32)     # the split's page slots (< 0: none)

    kv_head = kv_ptr + layer.to(tl.int64) * s_kl + kvh.to(tl.int64) * s_kh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for t0 in range(0, n_tok, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < n_tok
        jt = t // page_size      # int32 division by a runtime page size: once per key per tile
        slot = t - jt * page_size
        j = p_lo + jt.to(tl.int64)
        page = tl.load(page_ids_ptr + j, mask=t_ok, other=0)
        k_pos = tl.load(page_pos_ptr + j, mask=t_ok, other=0) + slot
        k_ok = t_ok & (slot < tl.load(page_len_ptr + j, mask=t_ok, other=0))
        if CAUSAL:
            k_ok = k_ok & (k_pos <= max_q_pos)
        if SKIP_TILES:  # prefill: skip tiles with no key visible to any query of the tile
            if tl.max(k_ok.to(tl.int32), 0) > 0:
                m_i, l_i, acc = _tile(q, q_pos, row_ok, kv_head, page, slot, k_pos, k_ok, d64, d_ok,
                                      m_i, l_i, acc, qk_scale, s_kp, s_kk, s_kt, s_kd,
                                      CAUSAL, FP8)
        else:
            m_i, l_i, acc = _tile(q, q_pos, row_ok, kv_head, page, slot, k_pos, k_ok, d64, d_ok,
                                  m_i, l_i, acc, qk_scale, s_kp, s_kk, s_kt, s_kd,
                                  CAUSAL, FP8)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    part = (part_base + split).to(tl.int64)
    o_off = part * s_op + qi64[:, None] * s_ot + head64[:, None] * s_oh + d64[None, :] * s_od
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + part * s_lp + qi64 * s_lt + head64 * s_lh, lse, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# plan: grid, splits and per-page metadata (from host tables, reusable across layers)


@dataclass(frozen=True)
class OperandPlan:
    """One pool's share of a plan: derived per-page arrays and its split of the work."""

    page_pos: torch.Tensor  # int32 [P]: absolute position of each listed page's first token
    page_len: torch.Tensor  # int32 [P]: valid tokens in each listed page (0..page_size)
    batch_page: torch.Tensor  # int32 [B+1]: batch item b's pages are page_ids[bp[b]:bp[b+1]]
    num_splits: int
    pages_per_split: int
    part_base: int  # index of this pool's first partial result


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch needs beyond the tensors: reusable while the CSR tables do not change
    (for instance across the layers of one step)."""

    work_b: torch.Tensor  # int32 [W]: batch item of each work item
    work_qb: torch.Tensor  # int32 [W]: query block of each work item inside its batch item
    block_m: int
    group: int
    max_q: int
    operands: tuple[OperandPlan | None, ...]  # None: the pool holds no page for this batch
    num_parts: int


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _block_m(group: int, max_q: int, d_pad: int, small: bool = False) -> int:
    """Query-tile rows: every query head of a KV head group for as many queries as fit, at
    least 16 (``tl.dot``'s minimum); ``small``: at most 16 (float32 tiles on a GPU, whose
    FMA dot spills registers on 32- and 64-row tiles)."""
    cap = 16 if small else 64 if d_pad <= 128 else 32
    return max(_next_pow2(group), min(cap, max(16, _next_pow2(max_q * group))))


@functools.cache
def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another: no reason to split


def plan_paged_attention(
    q: torch.Tensor, q_indptr: torch.Tensor, operands: Sequence[PagedKV],
    *, num_splits: int | None = None, min_split_tokens: int = 256,
    host_q_indptr: torch.Tensor | None = None,
) -> LaunchPlan:
    """Validate the index tables and plan the launches.

    Where the tables have host copies (every operand's ``host`` and ``host_q_indptr``, the
    same values as ``q_indptr`` on the CPU), everything is read and derived on the host and
    the derived tables go up in one non-blocking copy: the host never waits on the device.
    Otherwise a few dozen ints come back from the device (one sync).

    ``num_splits`` forces that many KV splits per pool (capped by its page count);
    ``None`` picks enough splits to fill the device, each at least ``min_split_tokens`` long.
    """
    total_q, num_q_heads, head_dim = q.shape
    batch = q_indptr.shape[0] - 1
    if batch < 0:
        raise ShapeError("q_indptr needs at least one entry")
    group = None
    for op in operands:
        op.validate(batch, head_dim)
        if op.kv.device != q.device:
            raise DTypeError(f"kv is on {op.kv.device}, q on {q.device}")
        if num_q_heads % op.num_kv_heads:
            raise ShapeError(f"{num_q_heads} query heads are not a multiple of {op.num_kv_heads} KV heads")
        g = num_q_heads // op.num_kv_heads
        if group is not None and g != group:
            raise ShapeError("all pools of one call must have the same number of KV heads")
        group = g
    group = group or 1
    on_host = host_q_indptr is not None and all(op.host is not None for op in operands)
    if host_q_indptr is not None:
        if host_q_indptr.device.type != "cpu" or host_q_indptr.shape != q_indptr.shape:
            raise DTypeError(f"host_q_indptr must be a CPU tensor of shape {tuple(q_indptr.shape)}")

    # everything the grid depends on, in one list of ints: read on the host when the tables
    # are there, else in one small device -> host transfer
    if on_host:
        tables = [op.host for op in operands]
        stats = [host_q_indptr.to(torch.int64)]
    else:
        tables = list(operands)
        stats = [q_indptr.to(torch.int64)]
    batch_pages = []
    for op, tab in zip(operands, tables):
        bp, summary = _table_summary(tab, batch, op.num_segments)
        batch_pages.append(bp)
        stats.append(summary)
    host = torch.cat(stats).cpu().tolist()
    qptr, rest = host[: batch + 1], host[batch + 1:]
    if qptr[0] != 0 or qptr[-1] != total_q or any(b < a for a, b in zip(qptr, qptr[1:])):
        raise ShapeError(f"q_indptr must rise from 0 to {total_q} queries, got {qptr[0]}..{qptr[-1]}")
    q_counts = [b - a for a, b in zip(qptr, qptr[1:])]
    max_q = max(q_counts, default=0)

    d_pad = max(16, _next_pow2(head_dim))
    fp32_tiles = gpu_choices(q.device) and any(tile_dtype(op.kv.dtype, q.dtype) == torch.float32 for op in operands)
    block_m = _block_m(group, max_q, d_pad, small=fp32_tiles)
    qb_size = block_m // group
    blocks = torch.tensor([-(-n // qb_size) for n in q_counts], dtype=torch.int64)
    work_b = torch.repeat_interleave(torch.arange(batch, dtype=torch.int64), blocks)
    starts = torch.cumsum(blocks, 0) - blocks
    work_qb = torch.arange(work_b.shape[0], dtype=torch.int64) - starts[work_b]

    dev = q.device
    target = _target_programs(dev)
    shapes: list[tuple[int, int, int] | None] = []     # per operand: splits, pages per split, base
    per_page: list[torch.Tensor] = []                  # page_pos, page_len, batch_page per live pool
    parts = 0
    for i, (op, tab) in enumerate(zip(operands, tables)):
        (max_pages, min_pages, id_min, id_max, seg_step, seg_first, seg_last,
         page_step, page_first, page_last) = rest[10 * i: 10 * i + 10]
        n_ids, n_pool = op.page_ids.shape[0], op.kv.shape[0]
        if seg_first != 0 or seg_last != op.num_segments or seg_step < 0:
            raise ShapeError("seg_indptr must rise from 0 to the number of segments")
        if page_first != 0 or page_last != n_ids or page_step < 0 or min_pages < 0:
            raise ShapeError("seg_page_indptr must rise from 0 to the number of page ids")
        if n_ids and (id_min < 0 or id_max >= n_pool):
            raise ShapeError(f"page ids {id_min}..{id_max} outside a pool of {n_pool} pages")
        if max_pages == 0 or not work_b.numel():
            shapes.append(None)
            continue
        if num_splits is not None:
            splits = max(1, min(int(num_splits), max_pages))
        else:
            base = work_b.shape[0] * op.num_kv_heads
            by_len = max(1, (max_pages * op.page_size) // max(1, min_split_tokens))
            splits = max(1, min(-(-target // base), by_len))
        per_split = -(-max_pages // splits)
        splits = -(-max_pages // per_split)
        per_page.extend([*_page_tables(tab, op.num_segments, op.page_size), batch_pages[i].to(INDEX_DTYPE)])
        shapes.append((splits, per_split, parts))
        parts += splits

    # on the host path the derived tables are CPU tensors: one upload; else already on device
    work = [work_b.to(INDEX_DTYPE), work_qb.to(INDEX_DTYPE)]
    if on_host:
        uploaded = upload_ints(work + per_page, dev)
    else:
        uploaded = upload_ints(work, dev) + per_page
    work_b_dev, work_qb_dev, derived = uploaded[0], uploaded[1], iter(uploaded[2:])
    plans: list[OperandPlan | None] = []
    for shape in shapes:
        if shape is None:
            plans.append(None)
            continue
        page_pos, page_len, bp = next(derived), next(derived), next(derived)
        plans.append(OperandPlan(page_pos, page_len, bp, *shape))
    return LaunchPlan(work_b_dev, work_qb_dev, block_m, group, max_q, tuple(plans), parts)


def _table_summary(tab, batch: int, num_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch items' page bounds ``[B+1]`` (int64) and ten int64 facts about one operand's
    tables (``tab``: a ``PagedKV`` or its ``HostTables``), computed where the tables are:
    most and fewest pages of a batch item, least and greatest page id, the smallest step of
    ``seg_indptr``, its ends, the smallest step of ``seg_page_indptr``, its ends."""
    dev = tab.page_ids.device
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    seg_indptr = tab.seg_indptr.to(torch.int64)
    seg_page_indptr = tab.seg_page_indptr.to(torch.int64)
    bp = seg_page_indptr[seg_indptr.clamp(0, num_segments)]
    per_batch = bp[1:] - bp[:-1]
    has_ids = tab.page_ids.shape[0] > 0
    summary = torch.stack([
        per_batch.max() if batch else zero,
        per_batch.min() if batch else zero,
        tab.page_ids.min().to(torch.int64) if has_ids else zero,
        tab.page_ids.max().to(torch.int64) if has_ids else zero,
        (seg_indptr[1:] - seg_indptr[:-1]).min() if batch else zero,
        seg_indptr[0], seg_indptr[-1],
        (seg_page_indptr[1:] - seg_page_indptr[:-1]).min() if num_segments else zero,
        seg_page_indptr[0], seg_page_indptr[-1],
    ])
    return bp, summary


def _page_tables(tab, num_segments: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per listed page: the absolute position of its first token and its valid token count
    (int32, computed where ``tab``'s tables are)."""
    dev = tab.page_ids.device
    n = tab.page_ids.shape[0]
    counts = (tab.seg_page_indptr[1:] - tab.seg_page_indptr[:-1]).to(torch.int64)
    seg = torch.repeat_interleave(torch.arange(num_segments, device=dev), counts, output_size=n)
    idx = torch.arange(n, device=dev, dtype=torch.int64) - tab.seg_page_indptr[seg].to(torch.int64)
    first = idx * page_size
    page_pos = (tab.seg_start[seg].to(torch.int64) + first).to(INDEX_DTYPE)
    page_len = (tab.seg_len[seg].to(torch.int64) - first).clamp(0, page_size).to(INDEX_DTYPE)
    return page_pos.contiguous(), page_len.contiguous()


# ---------------------------------------------------------------------------------------------
# launch


def _check_launchable(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise DTypeError("the Triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")


FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def tile_dtype(kv_dtype: torch.dtype, q_dtype: torch.dtype) -> torch.dtype:
    """The dtype the dots run in: the pool's; an fp8 pool's widened to the query's when that is
    16-bit, else to bfloat16 (float32 tiles over fp8 bytes spilled registers in decode on
    sm_80 / sm_90: 0.5-9 KB; the query is then rounded to bfloat16, as over a bfloat16 pool)."""
    if kv_dtype in FP8_CODES:
        return q_dtype if q_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    return kv_dtype


def _gpu_tiles(kv_dtype: torch.dtype, block_m: int, d_pad: int, fp8: bool = False) -> tuple[int, dict]:
    """``BLOCK_N`` and the launch options on a GPU, chosen so that no variant over the whole
    space users configure spills a register on sm_80 / sm_90 / sm_100 (``./run kernels-compile``
    compiles every one; what the choices replaced is in parentheses):

    - float32 tiles (an FMA dot, "ieee"): ``16 x 16`` tiles (``BLOCK_M`` <= 16 from the plan),
      3 stages, 4 warps at head dims up to 64, else 8 (4 warps spilled 8-16 B at head dims
      128-256 on sm_80 / sm_100, and 150 B with ``maxnreg`` 255; 8 warps 8 B at head dim 64 on
      sm_80; 32-key tiles 0.4-2 KB);
    - 16-bit tiles (fp8 pages widened to 16 bits too): ``maxnreg`` 255, else ptxas aims at
      128 registers (8 warps) or 168 (4 warps) for occupancy and spills 8-56 B to get there
      (measured over every head dim, group and page size; 101-209 registers with it);
    - one query tile of <= 16 rows (decode, small chunks): 32-key tiles; 4 warps and 3 stages,
      8 warps and 2 stages at head dims over 128;
    - 32-64 rows (prefill, chunked prefill): 64-key tiles (32 at head dims over 128) on 8
      warps, 2 stages;
    - fp8 pages (``fp8``; bfloat16 or float16 tiles widened from the bytes) at head dims over
      128: 16-key tiles on 8 warps, 2 stages (32-key tiles spilled 8 B on sm_90 in prefill).
    """
    if kv_dtype == torch.float32:
        return 16, {"num_warps": 4 if d_pad <= 64 else 8, "num_stages": 3}
    wide = {"maxnreg": 255}
    if fp8 and d_pad > 128:     # the bytes' widening: 32-key tiles spilled 8 B on sm_90 at head dim 256
        return 16, {"num_warps": 8, "num_stages": 2, **wide}
    if block_m <= 16:
        return 32, ({"num_warps": 4, "num_stages": 3} if d_pad <= 128 else {"num_warps": 8, "num_stages": 2}) | wide
    return (64 if d_pad <= 128 else 32), {"num_warps": 8, "num_stages": 2, **wide}


def _launch(q, q_indptr, q_pos, op: PagedKV, op_plan: OperandPlan, plan: LaunchPlan,
            out, lse, *, causal: bool, scale: float) -> None:
    kv = op.kv
    head_dim = kv.shape[5]
    d_pad = max(16, _next_pow2(head_dim))
    if gpu_choices(kv.device):
        block_n, extra = _gpu_tiles(tile_dtype(kv.dtype, q.dtype), plan.block_m, d_pad, kv.dtype in FP8_CODES)
    else:   # the interpreter pays per tile op, not per element: fewer, wider tiles
        block_n, extra = INTERPRET_BLOCK_N, {}
    grid = (plan.work_b.shape[0], op.num_kv_heads, op_plan.num_splits)
    fp8 = FP8_CODES.get(kv.dtype, 0)      # fp8 pages go in as their bytes (``_fp8_bytes_to_f16``)
    if fp8 and q.dtype != tile_dtype(kv.dtype, q.dtype):
        q = q.to(tile_dtype(kv.dtype, q.dtype))
    with launch_guard(kv.device.type):
        _kernel[grid](
            q, q_indptr, q_pos,
            kv.view(torch.uint8) if fp8 else kv, op.page_ids, op_plan.page_pos, op_plan.page_len, op_plan.batch_page,
            plan.work_b, plan.work_qb,
            out, lse,
            op.layer, op_plan.pages_per_split, op_plan.part_base, plan.group, op.page_size, head_dim,
            scale * LOG2E,
            *q.stride(), *kv.stride(), *out.stride(), *lse.stride(),
            D_PAD=d_pad, BLOCK_M=plan.block_m, BLOCK_N=block_n, CAUSAL=causal,
            SKIP_TILES=causal and plan.max_q > 1, FP8=fp8, **extra,
        )


def paged_attention_triton(
    q: torch.Tensor, q_indptr: torch.Tensor, q_pos: torch.Tensor, operands: Sequence[PagedKV],
    *, causal: bool = True, scale: float | None = None, out_dtype: torch.dtype | None = None,
    num_splits: int | None = None, plan: LaunchPlan | None = None,
    host_q_indptr: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over the segments of every operand (pool), merged exactly.

    ``num_splits`` forces KV splits per pool (tests); ``plan`` reuses a plan from
    ``plan_paged_attention`` (skips validation; no sync remains, so the call can be captured
    in a CUDA graph). A plan is only valid for the very index tensors it was built from (the
    layer and the pool contents may change). ``host_q_indptr`` (``q_indptr`` on the CPU) with
    operands that carry ``host`` tables plans without a device sync.
    """
    check_queries(q, q_indptr, q_pos)
    for t in (q_indptr, q_pos):
        if t.device != q.device:
            raise DTypeError(f"index tensor on {t.device}, q on {q.device}")
    _check_launchable(q)
    total_q, num_q_heads, head_dim = q.shape
    out_dtype = out_dtype or q.dtype
    scale = head_dim ** -0.5 if scale is None else float(scale)
    if plan is None:
        plan = plan_paged_attention(q, q_indptr, operands, num_splits=num_splits,
                                    host_q_indptr=host_q_indptr)
    out = torch.empty((total_q, num_q_heads, head_dim), dtype=out_dtype, device=q.device)
    lse = torch.empty((total_q, num_q_heads), dtype=torch.float32, device=q.device)
    live = [(op, p) for op, p in zip(operands, plan.operands) if p is not None]
    if plan.num_parts == 0 or total_q == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if plan.num_parts == 1:
        op, p = live[0]
        _launch(q, q_indptr, q_pos, op, p, plan, out.unsqueeze(0), lse.unsqueeze(0),
                causal=causal, scale=scale)
        return out, lse
    parts = torch.empty((plan.num_parts, total_q, num_q_heads, head_dim),
                        dtype=torch.float32, device=q.device)
    lse_parts = torch.empty((plan.num_parts, total_q, num_q_heads),
                            dtype=torch.float32, device=q.device)
    for op, p in live:
        _launch(q, q_indptr, q_pos, op, p, plan, parts, lse_parts, causal=causal, scale=scale)
    merge_partials(parts, lse_parts, out, lse)
    return out, lse
