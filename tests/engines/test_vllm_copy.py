"""The vLLM connector's copies between vLLM's paged layer tensors and contiguous K/V: whole
blocks by the block axis, any other slot list slot by slot, both equal to indexing by slot."""

from __future__ import annotations

import pytest
import torch

from mmtier.engines.vllm import copy as vc

B, H, N, D = 12, 4, 16, 32


def layer(layout: str) -> torch.Tensor:
    if layout == "standard":                     # [blocks, heads, block_size, 2 * head_dim] view
        return torch.randn(B, N, H, 2 * D).transpose(1, 2)
    if layout == "cpu":                          # vLLM's CPU backend: contiguous, per head K^T then V
        return torch.randn(B, H, N, 2 * D)
    return torch.randn(2, B, N, H, D)            # the older [2, blocks, block_size, heads, head_dim]


def test_the_cpu_backends_block_is_k_transposed_then_v():
    """Per head and block: K as [head_dim, block_size], then V as [block_size, head_dim] (what
    vLLM's CPU cache write stores; tests/engines/test_vllm_cpu_layout.py writes through it)."""
    src = layer("cpu")
    k, v = vc.kv_views(src, D)
    flat = src.reshape(B, H, 2 * N * D)
    b, p, h, d = 3, 5, 2, 7
    assert k[b, p, h, d] == flat[b, h, d * N + p] and v[b, p, h, d] == flat[b, h, N * D + p * D + d]
    assert k.data_ptr() == src.data_ptr()                  # views, no copy


@pytest.mark.parametrize("layout", ["standard", "cpu", "legacy"])
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


@pytest.mark.parametrize("layout", ["standard", "cpu", "legacy"])
def test_stage_mirrors_vllm_layout_and_blocks_copy_as_slices(layout):
    """A stage laid out as vLLM's tensor: blocks copied in by runs of slices land where indexing
    by block puts them, its K/V views are vLLM's K/V of those blocks, and they copy back."""
    src = layer(layout)
    blocks = [7, 8, 9, 2, 3, 11, 0]                       # runs 7-9, 2-3, 11, 0
    stage = vc.new_stage(src, 3, len(blocks))
    stage.fill_(float("nan"))
    phys = sorted(range(src.dim()), key=lambda d: -src.stride(d))
    assert sorted(range(src.dim()), key=lambda d: -stage[1].stride(d)) == phys   # same memory order
    vc.copy_blocks(src, blocks, stage[1], None)
    k, v = vc.kv_views(src, D)
    sk, sv = vc.stage_kv(stage, D)
    assert sk.shape == (3, len(blocks), N, H, D)
    idx = torch.tensor(blocks)
    assert torch.equal(sk[1], k[idx]) and torch.equal(sv[1], v[idx])
    assert torch.isnan(sk[0]).all() and torch.isnan(sv[2]).all()
    dst = torch.full_like(src, float("nan"))
    vc.copy_blocks(stage[1], None, dst, blocks)
    k2, v2 = vc.kv_views(dst, D)
    assert torch.equal(k2[idx], k[idx]) and torch.equal(v2[idx], v[idx])
    rest = torch.ones(B, dtype=torch.bool)
    rest[idx] = False
    assert torch.isnan(k2[rest]).all() and torch.isnan(v2[rest]).all()


@pytest.mark.parametrize("layout", ["standard", "legacy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scattered_blocks_copy_by_memcpy_as_indexing_by_block(layout, dtype):
    """Blocks scattered into many runs (one indexed copy of whole blocks): each lands
    where indexing by block puts it, bitwise, and nothing else is written."""
    src = layer(layout).to(dtype)
    blocks = [int(b) for b in torch.randperm(B)[:9]]
    stage = vc.new_stage(src, 2, len(blocks))
    stage.fill_(float("nan"))
    vc.copy_blocks(src, blocks, stage[0], None)
    k, v = vc.kv_views(src, D)
    sk, sv = vc.stage_kv(stage, D)
    idx = torch.tensor(blocks)
    assert torch.equal(sk[0], k[idx]) and torch.equal(sv[0], v[idx])
    assert torch.isnan(sk[1]).all() and torch.isnan(sv[1]).all()
    dst = torch.full_like(src, float("nan"))
    vc.copy_blocks(stage[0], None, dst, blocks)
    k2, v2 = vc.kv_views(dst, D)
    assert torch.equal(k2[idx], k[idx]) and torch.equal(v2[idx], v[idx])
    rest = torch.ones(B, dtype=torch.bool)
    rest[idx] = False
    assert torch.isnan(k2[rest]).all() and torch.isnan(v2[rest]).all()


def test_aligned_blocks_only_for_whole_blocks_in_order():
    slots = (torch.tensor([4, 5, 1])[:, None] * N + torch.arange(N)).flatten()
    assert vc.aligned_blocks(slots, N) == [4, 5, 1]
    assert vc.aligned_blocks(slots[:-1], N) is None
    assert vc.aligned_blocks(slots[1:].roll(1), N) is None


def test_a_stage_taken_in_inference_mode_is_writable_outside_it():
    """vLLM runs the forward pass (and the connector's save / load calls) under
    ``torch.inference_mode``; the stage is then written on the connector's reader thread,
    outside it (``read_group(out=)``), and reused: it must be a normal tensor."""
    pool = vc.StagePool()
    with torch.inference_mode():
        stage = pool.take(layer("standard"), 2, 3)
        stage.fill_(1.0)                                   # written inside too
    assert not stage.is_inference()
    stage.fill_(2.0)
    pool.give(stage)
    assert pool.take(layer("standard"), 2, 3) is stage   # reused: same kind
    assert pool.take(layer("standard"), 2, 4) is not stage
