"""The torch path of page writes: new tokens' K/V scattered into their pages by index copies
(``write_kv_torch``: every layer at once; ``layer_rows`` / ``write_layer_rows``: a reservation's
token rows built once, then one layer at a time), over CPU (or any) tensors; fp8 pages are
copied as their bytes (``as_bits``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import ShapeError


def write_kv_torch(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   page_ids: torch.Tensor, offsets: torch.Tensor) -> None:
    """Scatter tokens into pages: token ``i`` of ``k, v [L, n, Hkv, D]`` goes to page
    ``page_ids[i]``, slot ``offsets[i]``, in every layer of the page-major view ``kv``."""
    if k.shape != v.shape or k.dim() != 4:
        raise ShapeError(f"k and v must both be [layers, n, kv_heads, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}")
    layers, n, hkv, head_dim = k.shape
    if (layers, hkv, head_dim) != (kv.shape[1], kv.shape[4], kv.shape[5]):
        raise ShapeError(f"k/v of shape {tuple(k.shape)} do not fit pages {tuple(kv.shape[1:])}")
    if page_ids.shape[0] != n or offsets.shape[0] != n:
        raise ShapeError("one page id and one offset per token")
    pid = page_ids.long()
    off = offsets.long()
    rows = _token_rows(kv)
    if rows is not None:             # one index_copy_ each for K and V (no advanced indexing)
        flat, (page_rows, layer_rows, v_rows, slot_rows) = rows
        width = hkv * head_dim
        idx = ((torch.arange(layers, device=kv.device) * layer_rows)[:, None] + (pid * page_rows + off * slot_rows)).reshape(-1)
        flat = as_bits(flat)
        flat.index_copy_(0, idx, as_bits(k.reshape(-1, width).to(kv.dtype)))
        flat.index_copy_(0, idx + v_rows, as_bits(v.reshape(-1, width).to(kv.dtype)))
        return
    kv = as_bits(kv)
    kv[pid, :, 0, off] = as_bits(k.transpose(0, 1).to(kv.dtype))
    kv[pid, :, 1, off] = as_bits(v.transpose(0, 1).to(kv.dtype))


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (``uint8``, a view: torch's CPU copies by index do not take
    fp8); any other tensor as it is. A copy of the bytes is a copy of the values."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


@dataclass(frozen=True)
class LayerRows:
    """Where a reservation's tokens go in a contiguous pool's token rows, built once and used
    for each layer: row of token ``i``'s K at layer ``l`` = ``base[i] + l * layer_rows``."""

    flat: torch.Tensor              # the pool's storage as rows [R, Hkv * D]
    base: torch.Tensor              # int64 [n]
    layer_rows: int
    v_rows: int


def layer_rows(kv: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor) -> LayerRows | None:
    """``LayerRows`` of tokens bound for pages ``page_ids`` / slots ``offsets`` of the page-major
    view ``kv [P, L, 2, S, Hkv, D]``, or ``None`` when its rows are not contiguous."""
    rows = _token_rows(kv)
    if rows is None:
        return None
    flat, (page_rows, layer_stride, v_rows, slot_rows) = rows
    base = page_ids.to(kv.device).long() * page_rows + offsets.to(kv.device).long() * slot_rows
    return LayerRows(flat, base, layer_stride, v_rows)


def write_layer_rows(rows: LayerRows, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """One layer's ``k, v [n, Hkv, D]`` into their rows: one ``index_copy_`` each."""
    idx = rows.base + layer * rows.layer_rows if layer else rows.base
    width = rows.flat.shape[1]
    flat = as_bits(rows.flat)
    flat.index_copy_(0, idx, as_bits(k.reshape(-1, width).to(rows.flat.dtype)))
    flat.index_copy_(0, idx + rows.v_rows, as_bits(v.reshape(-1, width).to(rows.flat.dtype)))


def _token_rows(kv: torch.Tensor):
    """``kv [P, L, 2, S, Hkv, D]`` (a pool's page-major view, or a slice of its layers) as token
    rows of its storage: ``(rows [R, Hkv*D], (page, layer, V, slot) strides in rows)``, or
    ``None`` when its last two dims are not one contiguous row."""
    width = kv.shape[4] * kv.shape[5]
    st = kv.stride()
    if st[5] != 1 or st[4] != kv.shape[5] or any(x % width for x in st[:4]) or kv.storage_offset() % width:
        return None
    total = kv.untyped_storage().nbytes() // kv.element_size() - kv.storage_offset()
    flat = torch.as_strided(kv, (total // width, width), (width, 1))
    return flat, tuple(x // width for x in st[:4])
