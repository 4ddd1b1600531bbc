"""The torch path's small case: one batch item over few pages, in one pass over all operands.

A decode step of a short conversation (a few hundred tokens spread over a text pool and a
media pool or two) is dominated by per-operation overhead on the CPU, not by bytes: the general
path (``reference``) runs per operand and per chunk, then merges. Here every *written* key slot
of every operand is gathered with one ``index_select`` for K and one for V (token rows of the
pool's contiguous page-major view, so unwritten slots are never read), and one softmax over the
concatenated keys gives ``(out, lse)`` exactly; a mask is applied only when some key lies in
some query's causal future. About twenty tensor operations per call, whatever the number of
operands and segments.

The gather indices depend on the operands' tables, not on the layer (a layer is an offset), and
the layers of one step share their tables: they are built once and looked up by the others
(a small LRU keyed by the tables' identity).

Used by ``paged_attention_torch`` for a single batch item whose operands hold at most
``SMALL_TOKENS`` slots, share the KV head count and have contiguous pools; anything else takes
the general path.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ...errors import ShapeError
from .layout import PagedKV
from .unmasked import FLASH_OP, widened

SMALL_TOKENS = 2048          # key slots (pages x page size, all operands) of the small case
SMALL_SCORES = 1 << 22       # and at most this many scores (query rows x key slots)
_KEPT = 64                   # layouts remembered


def small_attention(q: torch.Tensor, q_pos: torch.Tensor, operands: Sequence[PagedKV], *,
                    causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out float32 [n_q, Hq, D], lse [n_q, Hq])`` of one batch item, or ``None`` when the
    case is not small (the caller takes the general path). Operands are validated by the caller."""
    n_q, num_q_heads, head_dim = q.shape
    live = [op for op in operands if op.num_segments and op.page_ids.shape[0]]
    if not live:
        return None
    slots = sum(op.page_ids.shape[0] * op.page_size for op in live)
    hkv = live[0].num_kv_heads
    if (slots > SMALL_TOKENS or slots * n_q * num_q_heads > SMALL_SCORES
            or any(op.num_kv_heads != hkv or not op.kv.is_contiguous() for op in live)):
        return None
    if num_q_heads % hkv:
        raise ShapeError(f"{num_q_heads} query heads are not a multiple of {hkv} KV heads")
    slots_of = _slots(live, q.device)
    if slots_of.rows is not None:                        # one arena: one gather over all operands
        rows = torch.as_strided(live[0].kv, (slots_of.rows, hkv * head_dim), (hkv * head_dim, 1), 0)
        idx = slots_of.base_all if not live[0].layer else slots_of.base_all + live[0].layer * slots_of.stride_all
        k = torch.index_select(rows, 0, idx)
        v = torch.index_select(rows, 0, idx + slots_of.v_all)
    else:
        ks, vs = [], []
        for op, base in zip(live, slots_of.base):
            size = op.page_size
            rows = op.kv.view(-1, hkv * head_dim)        # token rows: ((page*L + layer)*2 + kv)*P + slot
            idx = base + op.layer * 2 * size if op.layer else base
            ks.append(torch.index_select(rows, 0, idx))
            vs.append(torch.index_select(rows, 0, idx + size))
        k, v = (torch.cat(ks), torch.cat(vs)) if len(ks) > 1 else (ks[0], vs[0])
    k, v = k.view(-1, hkv, head_dim), v.view(-1, hkv, head_dim)           # [T, Hkv, D]
    if k.dtype != torch.float32:
        k, v = widened(k), widened(v)
    group = num_q_heads // hkv
    bias = _causal_bias(slots_of, q_pos, group) if causal else None
    if bias is not None and n_q > 1 and q.device.type == "cpu":
        split = _square_split(slots_of, q_pos)
        state = None if split is None else _flash_square(q, k, v, split, hkv, scale)
        if state is not None:
            return state
    if n_q == 1:                                         # [1, Hq, D] -> [Hkv, G, D]: a view
        qh = q.float().view(hkv, group, head_dim)
    else:                                                # [n_q, Hq, D] -> [Hkv, G * n_q, D], h = kv_head * G + g
        qh = q.float().view(n_q, hkv, group, head_dim).permute(1, 2, 0, 3).reshape(hkv, group * n_q, head_dim)
    state = _flash(qh, k, v, scale) if bias is None and k.shape[0] else None
    if state is not None:
        out, lse = state
    else:
        scores = torch.bmm(qh * scale, k.permute(1, 2, 0))               # [Hkv, G*n_q, T]
        if bias is not None:
            scores = scores + bias
        lse = torch.logsumexp(scores, dim=-1)                            # [Hkv, G*n_q]
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) if bias is not None else lse
        out = torch.bmm(torch.exp(scores - lse_safe[..., None]), v.transpose(0, 1))   # rows seeing nothing: 0
    if n_q == 1:
        return out.reshape(1, num_q_heads, head_dim), lse.reshape(1, num_q_heads)
    out = out.view(hkv, group, n_q, head_dim).permute(2, 0, 1, 3).reshape(n_q, num_q_heads, head_dim)
    lse = lse.view(hkv, group, n_q).permute(2, 0, 1).reshape(n_q, num_q_heads)
    return out, lse


def _flash(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Torch's fused CPU kernel (see ``unmasked``) over unmasked keys: ``(out [Hkv, R, D],
    lse [Hkv, R])``, or ``None`` where it is missing or refuses the input."""
    if FLASH_OP is None or qh.device.type != "cpu":
        return None
    try:
        out, lse = FLASH_OP(qh[None], k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], scale=scale)[:2]
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return out[0], lse[0]


def _square_split(slots: _Slots, q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(past, block)`` key indices when the keys at or after the first query's position are
    exactly the queries' own positions: a prefill chunk, whose mask is a causal square over
    ``block`` (put in position order: a chunk over a text span and an image has its keys in two
    operands) and nothing over ``past``. ``None`` otherwise. Remembered per query set."""
    qkey = b"square:" + q_pos.numpy().tobytes()
    if qkey in slots.bias:
        return slots.bias[qkey]
    qp = q_pos.long()
    q0 = int(qp[0])
    block = torch.nonzero(slots.pos >= q0).flatten()
    block = block[torch.argsort(slots.pos[block])]
    split = None
    if (block.numel() == qp.numel() and torch.equal(slots.pos[block], qp)
            and bool((qp[1:] > qp[:-1]).all())):
        split = (torch.nonzero(slots.pos < q0).flatten(), block)
    slots.bias[qkey] = split
    return split


def _flash_square(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split, hkv: int, scale: float):
    """A prefill chunk through torch's fused CPU kernel: the causal square over the chunk's own
    keys (``is_causal``: query ``i`` sees block keys ``<= i``) and the unmasked past, merged
    exactly by log-sum-exp. ``(out [n_q, Hq, D], lse [n_q, Hq])``, or ``None`` where the kernel is
    missing or refuses the input."""
    if FLASH_OP is None:
        return None
    past, block = split
    n_q, num_q_heads, head_dim = q.shape
    group = num_q_heads // hkv
    q4 = q.float().view(n_q, hkv, group, head_dim).permute(1, 2, 0, 3)          # [Hkv, G, n_q, D]

    def heads(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:             # [Hkv, G, n, D], no copy per G
        return t.index_select(0, idx).permute(1, 0, 2)[:, None].expand(hkv, group, idx.numel(), head_dim)

    try:
        out, lse = FLASH_OP(q4, heads(k, block), heads(v, block), is_causal=True, scale=scale)[:2]
        if past.numel():
            o_p, l_p = FLASH_OP(q4, heads(k, past), heads(v, past), scale=scale)[:2]
            m = torch.maximum(lse, l_p)
            w, w_p = torch.exp(lse - m), torch.exp(l_p - m)
            total = w + w_p
            out = (out * w[..., None] + o_p * w_p[..., None]) / total[..., None]
            lse = m + torch.log(total)
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return (out.permute(2, 0, 1, 3).reshape(n_q, num_q_heads, head_dim),
            lse.permute(2, 0, 1).reshape(n_q, num_q_heads))


class _Slots:
    """The written key slots of a layout: per operand the row index of each token's K at layer
    0 (``base``), and every token's absolute position (``pos``, all operands, in order)."""

    __slots__ = ("base", "pos", "last", "bias", "rows", "base_all", "stride_all", "v_all")

    def __init__(self, base: list[torch.Tensor], pos: torch.Tensor):
        self.base = base
        self.pos = pos
        self.rows: int | None = None            # set when every operand is a view of one arena:
        self.base_all = self.stride_all = self.v_all = None   # then arena rows, strides, V offsets
        self.last = int(pos.max()) if pos.numel() else -1
        self.bias: dict[bytes, torch.Tensor | None] = {}


_MEMO: OrderedDict[tuple, tuple[tuple[torch.Tensor, ...], tuple[weakref.ref, ...], _Slots]] = OrderedDict()
_LOCK = threading.Lock()


def _slots(ops: list[PagedKV], device: torch.device) -> _Slots:
    """The layout's slots, remembered. The cache hands the layers of one step the same index
    tensors (``table.compile_segments``) over the same pool views, so the key is their
    identity: the entry holds the index tensors (their ids cannot be reused while it lives)
    and weak references to the views (checked on a hit; a view is never kept alive here)."""
    tensors = tuple(t for op in ops for t in (op.seg_start, op.seg_len, op.seg_page_indptr, op.page_ids))
    key = (tuple(map(id, tensors)), tuple((id(op.kv), op.kv.data_ptr(), tuple(op.kv.shape)) for op in ops))
    with _LOCK:
        hit = _MEMO.get(key)
        if hit is not None and all(r() is op.kv for r, op in zip(hit[1], ops)):
            _MEMO.move_to_end(key)
            return hit[2]
    bases, positions = [], []
    for op in ops:
        base, pos = _op_slots(op)
        bases.append(base.to(device))
        positions.append(pos)
    out = _Slots(bases, torch.cat(positions).to(device))
    _share_arena(out, ops)
    with _LOCK:
        _MEMO[key] = (tensors, tuple(weakref.ref(op.kv) for op in ops), out)
        while len(_MEMO) > _KEPT:
            _MEMO.popitem(last=False)
    return out


def _op_slots(op: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """One operand's written slots on the host, in segment, page and slot order: each token's
    K row at layer 0 (``(page * layers * 2) * page_size + slot``) and its absolute position.
    A segment's tokens are packed from the start of its first page; slots past its length are
    left out. Vectorised over pages (no Python loop per token)."""
    t = op.host if op.host is not None else op
    size, layers = op.page_size, op.kv.shape[1]
    ptr = t.seg_page_indptr.cpu().long()
    pages = t.page_ids.cpu().long()
    counts = ptr[1:] - ptr[:-1]
    seg = torch.repeat_interleave(torch.arange(counts.numel()), counts)     # each page's segment
    lens = torch.minimum(t.seg_len.cpu().long().clamp(min=0), counts * size)[seg]
    slot = torch.arange(size)
    tok = (torch.arange(pages.numel()) - ptr[:-1][seg])[:, None] * size + slot    # [P, size]: token in segment
    keep = tok < lens[:, None]
    base = (pages[:, None] * (layers * 2 * size) + slot)[keep]
    pos = (t.seg_start.cpu().long()[seg][:, None] + tok)[keep]
    return base, pos


def _share_arena(slots: _Slots, ops: list[PagedKV]) -> None:
    """When every operand's pool is a view of one storage (the cache's arena) at a whole number
    of token rows, index that storage once: global row bases, per-token layer strides and V
    offsets, so a call gathers K and V of all operands with one ``index_select`` each."""
    first = ops[0].kv
    row = first.shape[4] * first.shape[5]
    ptr = first.untyped_storage().data_ptr()
    if any(op.kv.dtype != first.dtype or op.kv.untyped_storage().data_ptr() != ptr
           or op.kv.storage_offset() % row or op.kv.shape[4] * op.kv.shape[5] != row for op in ops):
        return
    bases, strides, v_offs = [], [], []
    for op, base in zip(ops, slots.base):
        size = op.page_size
        bases.append(base + op.kv.storage_offset() // row)      # layer 0, in arena rows
        strides.append(torch.full_like(base, 2 * size))
        v_offs.append(torch.full_like(base, size))
    slots.rows = first.untyped_storage().nbytes() // (row * first.element_size())
    slots.base_all, slots.stride_all, slots.v_all = torch.cat(bases), torch.cat(strides), torch.cat(v_offs)


def _causal_bias(slots: _Slots, q_pos: torch.Tensor, group: int) -> torch.Tensor | None:
    """``[1, G*n_q, T]``: 0 where a query may see a key, ``-inf`` where the key is in its
    future; ``None`` when every query sees every key (decode). Remembered per query set."""
    qp = q_pos.long()
    if q_pos.device.type == "cpu":
        qkey = q_pos.numpy().tobytes()
        if qkey in slots.bias:
            return slots.bias[qkey]
    else:
        qkey = None
    if slots.last <= int(qp.min()):
        bias = None
    else:
        future = slots.pos[None, :] > qp[:, None]                        # [n_q, T]
        bias = torch.zeros(future.shape, dtype=torch.float32, device=qp.device)
        bias = bias.masked_fill(future, -math.inf).repeat(group, 1)[None]
    if qkey is not None:
        slots.bias[qkey] = bias
    return bias
