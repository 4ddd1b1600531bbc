"""The torch path: paged attention over CPU (or any) tensors, vectorised per chunk of pages.

The pages a batch item reads split in two:

- pages that need no mask, every written token visible to every query of the item (for
  decode, all of them): ``unmasked`` runs torch's fused CPU flash-attention kernel over them,
  about twice as fast as the loop below (see that module);
- pages crossing the causal boundary of the item's queries (a block of queries at different
  positions), and every page when the flash kernel is unavailable: the masked loop here.
  Pages are gathered in chunks of about ``CHUNK_BYTES`` of K+V, scores are computed for all
  query heads of a KV head at once (GQA: ``[Hkv, G * n_q, D]``), unwritten slots and future
  keys are masked, and chunks are combined by an online log-sum-exp merge.

The two partial states merge exactly. There is no Python loop per token or per page; the loops
are per batch item and per chunk. Pages wholly in the causal future of every query, and empty
pages, are never read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ...errors import ShapeError
from .layout import PagedKV, check_queries
from .small import small_attention
from .unmasked import unmasked_attention

CHUNK_BYTES = 4 << 20


def paged_attention_torch(
    q: torch.Tensor,
    q_indptr: torch.Tensor,
    q_pos: torch.Tensor,
    operands: Sequence[PagedKV],
    *,
    causal: bool = True,
    scale: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over the pages of every operand, merged exactly; ``(out, lse)``."""
    check_queries(q, q_indptr, q_pos)
    total_q, num_q_heads, head_dim = q.shape
    batch = q_indptr.shape[0] - 1
    scale = head_dim ** -0.5 if scale is None else float(scale)
    if batch == 1:                            # a short sequence: one pass over every operand
        for op in operands:
            op.validate(batch, head_dim)
        small = small_attention(q, q_pos, operands, causal=causal, scale=scale)
        if small is not None:
            out_dt = out_dtype or q.dtype
            return (small[0] if small[0].dtype == out_dt else small[0].to(out_dt)), small[1]
    out = torch.zeros(total_q, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, num_q_heads), -math.inf, dtype=torch.float32, device=q.device)
    q_bounds = q_indptr.tolist()
    filled = [False] * batch                  # whether an operand has written item b's rows
    for op in operands:
        op.validate(batch, head_dim)
        if num_q_heads % op.num_kv_heads:
            raise ShapeError(f"{num_q_heads} query heads are not a multiple of {op.num_kv_heads} KV heads")
        seg_bounds = op.seg_indptr.tolist()
        for b in range(batch):
            q0, q1 = q_bounds[b], q_bounds[b + 1]
            s0, s1 = seg_bounds[b], seg_bounds[b + 1]
            if q0 == q1 or s0 == s1:
                continue
            o, s = _item_attention(q[q0:q1], q_pos[q0:q1], op, s0, s1, causal, scale)
            if filled[b]:
                o, s = _merge_pair(out[q0:q1], lse[q0:q1], o, s)
            out[q0:q1], lse[q0:q1] = o, s
            filled[b] = True
    return out.to(out_dtype or q.dtype), lse


def _item_pages(op: PagedKV, s0: int, s1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Page ids, first-token positions and valid-token counts of segments ``s0:s1``."""
    ptr = op.seg_page_indptr[s0:s1 + 1].long()
    counts = ptr[1:] - ptr[:-1]
    page_ids = op.page_ids[ptr[0]:ptr[-1]].long()
    seg_of_page = torch.repeat_interleave(torch.arange(s1 - s0, device=ptr.device), counts)
    first = ptr[:-1] - ptr[0]
    index_in_seg = torch.arange(page_ids.shape[0], device=ptr.device) - first[seg_of_page]
    size = op.page_size
    pos0 = op.seg_start[s0:s1].long()[seg_of_page] + index_in_seg * size
    valid = (op.seg_len[s0:s1].long()[seg_of_page] - index_in_seg * size).clamp(0, size)
    return page_ids, pos0, valid


def _item_attention(q, q_pos, op: PagedKV, s0: int, s1: int, causal: bool, scale: float):
    """``(out [n_q, Hq, D], lse [n_q, Hq])`` of one batch item over its segments ``s0:s1``."""
    n_q, num_q_heads, head_dim = q.shape
    hkv = op.num_kv_heads
    group = num_q_heads // hkv
    page_ids, pos0, valid = _item_pages(op, s0, s1)
    qpos = q_pos.long()
    keep = valid > 0
    unmasked = keep.clone()
    if causal:
        keep &= pos0 <= qpos.max()
        unmasked &= pos0 + valid - 1 <= qpos.min()
    # [n_q, Hq, D] -> [Hkv, G * n_q, D] with query head h = kv_head * G + g
    qh = q.float().view(n_q, hkv, group, head_dim).permute(1, 2, 0, 3).reshape(hkv, group * n_q, head_dim)
    states = []
    if bool(unmasked.any()):
        state = unmasked_attention(qh, op, page_ids[unmasked], valid[unmasked], scale)
        if state is not None:
            states.append(state)
            keep &= ~unmasked
    if bool(keep.any()):
        states.append(_masked_attention(qh * scale, qpos, op, page_ids[keep], pos0[keep], valid[keep], causal))
    if not states:
        out = torch.zeros_like(qh)
        lse = torch.full(qh.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    else:
        out, lse = states[0] if len(states) == 1 else _merge_pair(*states[0], *states[1])
    return _to_rows(out, lse, n_q, group)


def _masked_attention(qh, qpos, op: PagedKV, page_ids, pos0, valid, causal: bool):
    """The masked loop over pages ``page_ids`` (first positions ``pos0``, ``valid`` tokens
    each, every one non-empty) for ``qh [Hkv, R, D]`` (float32, pre-scaled); returns
    ``(out [Hkv, R, D], lse [Hkv, R])``."""
    hkv, rows_q, head_dim = qh.shape
    group_rows = rows_q // qpos.shape[0]          # G: query rows are (g, query) pairs
    size = op.page_size
    offs = torch.arange(size, device=qh.device)
    page_kv_bytes = 2 * size * hkv * head_dim * op.kv.element_size()
    step = max(1, CHUNK_BYTES // page_kv_bytes)
    layers = op.kv.shape[1]
    # K (or V) of one page in one layer is one contiguous row of this view: gathering rows
    # lands K and V each as [T, Hkv, D], contiguous, with no copy after the gather.
    rows = op.kv.view(op.kv.shape[0] * layers * 2, size * hkv * head_dim) if op.kv.is_contiguous() else None
    kbuf = vbuf = None
    q_min = int(qpos.min())
    m_run = torch.full((hkv, rows_q, 1), -1e30, dtype=torch.float32, device=qh.device)
    l_run = torch.zeros(hkv, rows_q, 1, dtype=torch.float32, device=qh.device)
    acc = torch.zeros(hkv, rows_q, head_dim, dtype=torch.float32, device=qh.device)
    for c0 in range(0, page_ids.shape[0], step):
        ids = page_ids[c0:c0 + step]
        n = ids.shape[0]
        if rows is not None:
            if kbuf is None:
                kbuf = torch.empty(step, rows.shape[1], dtype=rows.dtype, device=rows.device)
                vbuf = torch.empty_like(kbuf)
            base = (ids * layers + op.layer) * 2
            k_rows = torch.index_select(rows, 0, base, out=kbuf[:n])
            v_rows = torch.index_select(rows, 0, base + 1, out=vbuf[:n])
            k = k_rows.view(n * size, hkv, head_dim)
            v = v_rows.view(n * size, hkv, head_dim)
        else:
            kv = op.kv[ids, op.layer]                                # [n, 2, P, Hkv, D]
            k = kv[:, 0].reshape(n * size, hkv, head_dim)
            v = kv[:, 1].reshape(n * size, hkv, head_dim)
        k = k.permute(1, 2, 0).float()                               # [Hkv, D, T]
        v = v.transpose(0, 1).float()                                # [Hkv, T, D]
        scores = torch.bmm(qh, k)                                    # [Hkv, G*n_q, T]
        chunk_valid = valid[c0:c0 + step]
        whole = bool((chunk_valid == size).all())
        mask = None if whole else (offs[None, :] < chunk_valid[:, None]).reshape(-1)   # [T]
        if mask is not None:
            v = v.masked_fill(~mask[None, :, None], 0.0)   # unwritten slots may hold NaN
        last = int(pos0[c0:c0 + n].max()) + size - 1
        if causal and last > q_min:                        # some key is in some query's future
            pos = (pos0[c0:c0 + step, None] + offs[None, :]).reshape(-1)
            allowed = pos[None, :] <= qpos[:, None]                              # [n_q, T]
            if mask is not None:
                allowed &= mask[None, :]
            scores = scores.masked_fill(~allowed.repeat(group_rows, 1)[None], -math.inf)
        elif mask is not None:
            scores = scores.masked_fill(~mask[None, None, :], -math.inf)
        m_new = torch.maximum(m_run, scores.amax(dim=-1, keepdim=True))
        alpha = torch.exp(m_run - m_new)
        p = torch.exp(scores - m_new)
        l_run = l_run * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, v)
        m_run = m_new
    seen = l_run > 0
    out = torch.where(seen, acc / l_run.clamp_min(1e-38), torch.zeros_like(acc))
    lse = torch.where(seen, m_run + torch.log(l_run.clamp_min(1e-38)), torch.full_like(l_run, -math.inf))
    return out, lse.squeeze(-1)


def _to_rows(out: torch.Tensor, lse: torch.Tensor, n_q: int, group: int):
    hkv, _, head_dim = out.shape
    out = out.view(hkv, group, n_q, head_dim).permute(2, 0, 1, 3).reshape(n_q, hkv * group, head_dim)
    lse = lse.view(hkv, group, n_q).permute(2, 0, 1).reshape(n_q, hkv * group)
    return out, lse


def _merge_pair(o1, s1, o2, s2):
    """Exact merge of two partial states; rows where both are empty stay (0, -inf)."""
    m = torch.maximum(s1, s2)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1 = torch.exp(s1 - m_safe)
    w2 = torch.exp(s2 - m_safe)
    total = w1 + w2
    out = (o1 * w1[..., None] + o2 * w2[..., None]) / total.clamp_min(1e-38)[..., None]
    lse = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(total, -math.inf))
    return out, lse


def merge_attention_states_torch(
    outs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial ``(out, lse)`` states over disjoint key sets into the exact whole."""
    if len(outs) != len(lses) or not outs:
        raise ShapeError("merge needs one lse per output and at least one state")
    for o, s in zip(outs, lses):
        if o.shape != outs[0].shape or s.shape != o.shape[:-1]:
            raise ShapeError(f"state shapes differ: out {tuple(o.shape)}, lse {tuple(s.shape)}")
    lse = torch.stack([s.float() for s in lses])                    # [N, ...]
    m = lse.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)
    total = w.sum(dim=0)
    out = sum(o.float() * wi[..., None] for o, wi in zip(outs, w)) / total.clamp_min(1e-38)[..., None]
    merged = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(total, -math.inf))
    return out.to(out_dtype or outs[0].dtype), merged
