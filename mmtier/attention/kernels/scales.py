"""fp8 pages' dequantization scales, and attention over scaled pages.

An fp8 KV cache stores ``K / k_scale`` and ``V / v_scale`` (real value = stored value x scale),
with one scale per layer (vLLM's per-tensor ``k_scale`` / ``v_scale`` of each attention layer)
or one per layer and KV head. The kernels dequantize fp8 tiles to float32 as they read them
(the value stored, unscaled); the scales enter once per operand, where they cost nothing per
key:

- ``q . (k_scale[h] * k) == (k_scale[h] * q) . k``: a query head is multiplied by its KV
  head's K scale before the kernel runs (the log-sum-exp comes out right with it);
- ``sum_j p_j (v_scale[h] * v_j) == v_scale[h] * sum_j p_j v_j``: the kernel's output of a
  query head is multiplied by its KV head's V scale.

Both are exact in real arithmetic; in float32 they round once per query row, not once per key.
Operands with scales run one kernel call each (their queries differ), merged with the rest
by log-sum-exp like any other partial states.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class KVScales:
    """``k`` and ``v`` float32 ``[layers, kv_heads]`` on the pages' device; ``layer_offset``:
    the model layer of the operand's layer 0 (a disk batch that holds one layer of each page)."""

    k: torch.Tensor
    v: torch.Tensor
    layer_offset: int = 0

    def at(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V scales ``[kv_heads]`` of the operand's ``layer``."""
        return self.k[layer + self.layer_offset], self.v[layer + self.layer_offset]

    def shifted(self, layer_offset: int) -> KVScales:
        return KVScales(self.k, self.v, layer_offset)


_MEMO: dict[tuple, KVScales | None] = {}
_LOCK = threading.Lock()


def spec_scales(spec, device: torch.device | str) -> KVScales | None:
    """The scales of ``spec``'s fp8 pages as tensors on ``device`` (made once per spec and
    device, read-only); ``None`` where the pages are not fp8 or every scale is 1.0."""
    key = (spec, str(device))
    with _LOCK:
        if key in _MEMO:
            return _MEMO[key]
    k, v = spec.scale_rows("k"), spec.scale_rows("v")
    scales = None
    if k is not None or v is not None:
        ones = ((1.0,) * spec.num_kv_heads,) * spec.num_layers
        scales = KVScales(torch.tensor(k or ones, dtype=torch.float32, device=device),
                          torch.tensor(v or ones, dtype=torch.float32, device=device))
    with _LOCK:
        if len(_MEMO) < 1024:
            _MEMO[key] = scales
    return scales


def fold_query(q: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """``q [n, Hq, D]`` with each query head multiplied by its KV head's K scale (float32)."""
    group = q.shape[1] // k_scale.shape[0]
    return q.float() * k_scale.to(q.device).repeat_interleave(group)[None, :, None]


def unfold_output(out: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """``out [n, Hq, D]`` with each query head multiplied by its KV head's V scale."""
    group = out.shape[1] // v_scale.shape[0]
    return out * v_scale.to(out.device).repeat_interleave(group)[None, :, None].to(out.dtype)
