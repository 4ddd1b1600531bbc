"""The vLLM connector's copies between vLLM's paged layer tensors and contiguous K/V: whole
blocks by the block axis, any other slot list slot by slot, both equal to indexing by slot."""

from __future__ import annotations

import pytest
import torch

from mmtier.integrations import vllm_copy as vc

B, H, N, D = 12, 4, 16, 32


def layer(layout: str) -> torch.Tensor:
    if layout == "standard":                     # [blocks, heads, block_size, 2 * head_dim] view
        return torch.randn(B, N, H, 2 * D).transpose(1, 2)
    return torch.randn(2, B, N, H, D)            # the older [2, blocks, block_size, heads, head_dim]


@pytest.mark.parametrize("layout", ["standard", "legacy"])
@pytest.mark.parametrize("which", ["whole_blocks", "partial_last_block", "out_of_order_slots"])
@pytest.mark.parametrize("nblocks", [5, 12])          # checked in Python / with torch ops
def test_gather_and_scatter_equal_indexing_by_slot(layout, which, nblocks):
    blocks = torch.randperm(B)[:nblocks]
    slots = (blocks[:, None] * N + torch.arange(N)).flatten()
    if which == "partial_last_block":
        slots = slots[:-3]
    elif which == "out_of_order_slots":
        slots = slots[torch.randperm(slots.numel())]
    assert (vc.whole_blocks(slots, N) is not None) == (which == "whole_blocks")
    src = layer(layout)
    k, v = vc.kv_views(src, D)
    out_k = torch.full((slots.numel(), H, D), float("nan"))
    out_v = torch.full_like(out_k, float("nan"))
    vc.gather(src, slots, D, out_k, out_v)
    assert torch.equal(out_k, k[slots // N, slots % N]) and torch.equal(out_v, v[slots // N, slots % N])
    dst = torch.full_like(src, float("nan"))
    vc.scatter(dst, slots, D, out_k, out_v)
    k2, v2 = vc.kv_views(dst, D)
    assert torch.equal(k2[slots // N, slots % N], out_k) and torch.equal(v2[slots // N, slots % N], out_v)
    untouched = torch.ones(B, N, dtype=torch.bool)
    untouched[slots // N, slots % N] = False
    assert torch.isnan(k2[untouched]).all() and torch.isnan(v2[untouched]).all()
