"""The torch path's small case: one batch item over few pages, in one pass over all operands.

A decode step of a short conversation (a few hundred tokens spread over a text pool and a
media pool or two) is dominated by per-operation overhead on the CPU, not by bytes: the general
path (``reference``) runs per operand and per chunk, then merges. Here the pages of every
operand are enumerated in Python (they are few), each operand's K and V are gathered with one
index, and one masked softmax over the concatenated keys gives ``(out, lse)`` exactly: about a
dozen tensor operations per call whatever the number of operands and segments.

Used by ``paged_attention_torch`` for a single batch item whose operands hold at most
``SMALL_TOKENS`` slots (and share the KV head count); anything else takes the general path.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ..errors import ShapeError
from .layout import PagedKV

SMALL_TOKENS = 2048          # key slots (pages x page size, all operands) of the small case
SMALL_SCORES = 1 << 22       # and at most this many scores (query rows x key slots)


def small_attention(q: torch.Tensor, q_pos: torch.Tensor, operands: Sequence[PagedKV], *,
                    causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out float32 [n_q, Hq, D], lse [n_q, Hq])`` of one batch item, or ``None`` when the
    case is not small (the caller takes the general path). Operands are validated by the caller."""
    n_q, num_q_heads, head_dim = q.shape
    live = []
    slots = 0
    for op in operands:
        s0, s1 = (int(x) for x in op.seg_indptr.tolist())
        if s0 == s1:
            continue
        ptr = op.seg_page_indptr[s0:s1 + 1].tolist()
        slots += (ptr[-1] - ptr[0]) * op.page_size
        live.append((op, s0, s1, ptr))
    if not live or slots > SMALL_TOKENS or slots * n_q * num_q_heads > SMALL_SCORES:
        return None
    hkv = live[0][0].num_kv_heads
    if any(op.num_kv_heads != hkv for op, *_ in live):
        return None
    if num_q_heads % hkv:
        raise ShapeError(f"{num_q_heads} query heads are not a multiple of {hkv} KV heads")
    ks, vs, layout = [], [], []
    for op, s0, s1, ptr in live:
        size = op.page_size
        layout.append((size, tuple(op.seg_start[s0:s1].tolist()), tuple(op.seg_len[s0:s1].tolist()),
                       tuple(b - a for a, b in zip(ptr, ptr[1:]))))
        ids = op.page_ids[ptr[0]:ptr[-1]].long()
        kv = op.kv[ids, op.layer]                                        # [n, 2, P, Hkv, D]
        n = ids.shape[0]
        ks.append(kv[:, 0].reshape(n * size, hkv, head_dim))
        vs.append(kv[:, 1].reshape(n * size, hkv, head_dim))
    k = (torch.cat(ks) if len(ks) > 1 else ks[0]).to(q.device, torch.float32)   # [T, Hkv, D]
    v = (torch.cat(vs) if len(vs) > 1 else vs[0]).to(q.device, torch.float32)
    key_pos, key_ok = _key_slots(tuple(layout), q.device)
    allowed = key_ok[None, :].expand(n_q, -1)                            # [n_q, T]
    if causal:
        allowed = allowed & (key_pos[None, :] <= q_pos.long()[:, None])
    group = num_q_heads // hkv
    # [n_q, Hq, D] -> [Hkv, G * n_q, D] with query head h = kv_head * G + g
    qh = (q.float() * scale).view(n_q, hkv, group, head_dim).permute(1, 2, 0, 3).reshape(hkv, group * n_q, head_dim)
    scores = torch.bmm(qh, k.permute(1, 2, 0))                           # [Hkv, G*n_q, T]
    scores = scores.masked_fill(~allowed.repeat(group, 1)[None], -math.inf)
    v = v.masked_fill(~key_ok[:, None, None], 0.0).transpose(0, 1)       # unwritten slots may hold NaN
    lse = torch.logsumexp(scores, dim=-1)                                # [Hkv, G*n_q]
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.bmm(torch.exp(scores - lse_safe[..., None]), v)         # rows seeing nothing: 0
    out = out.view(hkv, group, n_q, head_dim).permute(2, 0, 1, 3).reshape(n_q, num_q_heads, head_dim)
    lse = lse.view(hkv, group, n_q).permute(2, 0, 1).reshape(n_q, num_q_heads)
    return out, lse


_SLOTS: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_SLOTS_LOCK = threading.Lock()
_SLOTS_KEPT = 64


def _key_slots(layout: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position [T], written [T])`` of every key slot of a layout (per operand: page size,
    segment starts, lengths and page counts). The layers of one step share a layout, so it is
    built once per step and looked up by the others (a small LRU)."""
    key = (layout, str(device))
    with _SLOTS_LOCK:
        hit = _SLOTS.get(key)
        if hit is not None:
            _SLOTS.move_to_end(key)
            return hit
    pos: list[int] = []
    ok: list[bool] = []
    for size, starts, lens, pages in layout:
        for start, length, n in zip(starts, lens, pages):
            slots = n * size                            # a segment's tokens are packed from its start
            written = min(max(length, 0), slots)
            pos.extend(range(start, start + slots))
            ok.extend([True] * written)
            ok.extend([False] * (slots - written))
    out = (torch.tensor(pos, device=device), torch.tensor(ok, device=device))
    with _SLOTS_LOCK:
        _SLOTS[key] = out
        while len(_SLOTS) > _SLOTS_KEPT:
            _SLOTS.popitem(last=False)
    return out
