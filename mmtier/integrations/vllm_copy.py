"""Copies between vLLM's paged KV tensor of one layer and contiguous ``[n, heads, head_dim]``.

vLLM >= 0.33 hands connectors a standardized per-layer view ``[blocks, heads, block_size,
2 * head_dim]`` (K then V along the last axis; the physical order may differ, the strides say
it); older releases a ``[2, blocks, block_size, heads, head_dim]`` tensor. Both become a K and
a V view ``[blocks, block_size, heads, head_dim]`` without a copy, and a slot ``s`` is block
``s // block_size``, offset ``s % block_size``.

A request's slots are whole blocks nearly always (every block but maybe the last full, each
block's slots in order). Those move block by block along the block axis, one ``index_select`` /
``index_copy_`` per layer and side, each block one strided slice copied once; any other slot
list takes the per-slot path.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError


def kv_views(kv_layer: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``[blocks, block_size, heads, head_dim]`` of one layer's paged tensor."""
    if kv_layer.dim() == 4 and kv_layer.shape[-1] == 2 * head_dim:      # [B, H, N, 2D]
        t = kv_layer.transpose(1, 2)
        return t[..., :head_dim], t[..., head_dim:]
    if kv_layer.dim() == 5 and kv_layer.shape[0] == 2 and kv_layer.shape[-1] == head_dim:
        return kv_layer[0], kv_layer[1]                                 # [2, B, N, H, D]
    raise ShapeError(f"unsupported vLLM KV layout {tuple(kv_layer.shape)} for head_dim {head_dim} "
                     "(expected [blocks, heads, block_size, 2*head_dim] or "
                     "[2, blocks, block_size, heads, head_dim]; MLA is not supported)")


def _split(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size


def whole_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """The block ids when ``slots`` are whole blocks, each block's slots in order; else ``None``."""
    n = slots.numel()
    if n == 0 or n % block_size:
        return None
    if n <= 8 * block_size and slots.device.type == "cpu":     # a few blocks: cheaper in Python
        s = slots.tolist()
        firsts = s[::block_size]
        if any(f % block_size for f in firsts) or any(
                s[i] != firsts[i // block_size] + i % block_size for i in range(n)):
            return None
        return torch.tensor([f // block_size for f in firsts], dtype=slots.dtype)
    rows = slots.view(-1, block_size)
    first = rows[:, 0]
    if bool((first % block_size).any()) or not torch.equal(
            rows - first[:, None], torch.arange(block_size, device=slots.device).expand_as(rows)):
        return None
    return torch.div(first, block_size, rounding_mode="floor")


def gather(kv_layer: torch.Tensor, slots: torch.Tensor, head_dim: int,
           out_k: torch.Tensor, out_v: torch.Tensor) -> None:
    """``out_k[i], out_v[i] = K, V at slots[i]`` (``out_*``: ``[n, heads, head_dim]``)."""
    k, v = kv_views(kv_layer, head_dim)
    bs = k.shape[1]
    if k.stride(0) == bs * k.stride(1):          # blocks x offsets is one slot axis already
        _take(k, slots, None, None, out_k)
        _take(v, slots, None, None, out_v)
        return
    blocks = whole_blocks(slots, bs)
    if blocks is not None and out_k.is_contiguous() and out_v.is_contiguous() and out_k.dtype == k.dtype:
        for view, out in ((k, out_k), (v, out_v)):
            torch.index_select(view, 0, blocks, out=out.view(-1, bs, *out.shape[1:]))
        return
    blocks, offs = _split(slots, bs)
    _take(k, slots, blocks, offs, out_k)
    _take(v, slots, blocks, offs, out_v)


def scatter(kv_layer: torch.Tensor, slots: torch.Tensor, head_dim: int,
            k_src: torch.Tensor, v_src: torch.Tensor) -> None:
    """``K, V at slots[i] = k_src[i], v_src[i]`` in place in vLLM's tensor."""
    k, v = kv_views(kv_layer, head_dim)
    bs = k.shape[1]
    blocks = whole_blocks(slots, bs)
    if blocks is not None:
        for view, src in ((k, k_src), (v, v_src)):
            view.index_copy_(0, blocks, src.to(view.device, view.dtype).reshape(-1, bs, *src.shape[1:]))
        return
    blocks, offs = _split(slots, bs)
    k.index_put_((blocks, offs), k_src.to(k.dtype))
    v.index_put_((blocks, offs), v_src.to(v.dtype))


def _take(view: torch.Tensor, slots, blocks, offs, out: torch.Tensor) -> None:
    if view.stride(0) == view.shape[1] * view.stride(1):   # blocks x offsets is one slot axis
        torch.index_select(view.flatten(0, 1), 0, slots, out=out)
    else:
        out.copy_(view[blocks, offs])
