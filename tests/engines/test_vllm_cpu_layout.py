"""vLLM's CPU backend lays each head's KV block out as K ``[head_dim, block_size]`` then V
``[block_size, head_dim]`` (its ``vec`` cache write), not as the ``[block_size, 2 * head_dim]``
its tensor's shape says. Rows written through vLLM's own ``cpu_attn_reshape_and_cache`` at
scattered slots (parts of blocks) must come back through the connector's copies: reading the
shape as K|V along the last axis once mixed positions within a block, so a group of part of a
block shared by two requests brought the other request's rows with it.

Needs the engines environment (``./run engines``); skipped with the reason otherwise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm._custom_ops", reason="no vLLM here: run ./run engines (vLLM's CPU build in "
                    ".venv-engines); ./run test then runs this file there")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from mmtier.engines.vllm import copy as vc  # noqa: E402

B, H, N, D = 6, 2, 32, 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_vllm_writes_at_parts_of_blocks_come_back_through_the_connectors_copies(dtype):
    isa = _get_attn_isa(dtype, N, D)
    cache = torch.full((B, H, N, 2 * D), float("nan"), dtype=dtype)
    key_cache, value_cache = cache.view(B, H, 2 * N, D).chunk(2, dim=2)     # as vLLM's forward does
    slots = torch.randperm(B * N)[:45]                                      # parts of blocks, any order
    key = torch.randn(len(slots), H, D).to(dtype)
    value = torch.randn(len(slots), H, D).to(dtype)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    if not vc.check_cpu_layout(cache, D, isa):
        pytest.skip(f"vLLM picked the {isa!r} ISA here, whose packed blocks the connector refuses for media")
    out_k = torch.full_like(key, float("nan"))
    out_v = torch.full_like(value, float("nan"))
    vc.gather(cache, slots, D, out_k, out_v)
    assert torch.equal(out_k, key) and torch.equal(out_v, value)
    back = torch.zeros_like(cache)
    vc.scatter(back, slots, D, out_k, out_v)
    k1, v1 = vc.kv_views(cache, D)
    k2, v2 = vc.kv_views(back, D)
    blocks, offs = slots // N, slots % N
    assert torch.equal(k2[blocks, offs], k1[blocks, offs]) and torch.equal(v2[blocks, offs], v1[blocks, offs])


def test_the_amx_layout_is_told_apart():
    """vLLM's AMX cache write packs K and V for its tiles: the check says so (the connector then
    refuses a model with media, whose groups are parts of blocks). Where this CPU has no AMX kernel
    at all (an AVX2-only EPYC: vLLM's build raises for it), the check answers ``None`` and vLLM
    never picks that layout here, so no engine on this machine meets it."""
    assert vc.check_cpu_layout(torch.zeros(1, H, N, 2 * D, dtype=torch.bfloat16), D, "vec")
    amx = vc.check_cpu_layout(torch.zeros(1, H, N, 2 * D, dtype=torch.bfloat16), D, "amx")
    if amx is None:
        assert not torch.cpu._is_amx_tile_supported()
        assert _get_attn_isa(torch.bfloat16, N, D) != "amx"
    else:
        assert amx is False


def test_a_head_size_vllms_cpu_attention_has_no_kernel_for_is_not_checked():
    """vLLM's CPU attention runs no head size of 16 (its cache write raises): no engine attends
    over such a tensor, the check answers ``None`` and the connector keeps its ``vec`` reading
    (the connector's own tests hand it such tensors)."""
    assert vc.check_cpu_layout(torch.zeros(1, H, N, 2 * 16, dtype=torch.float32), 16, "vec16") is None
