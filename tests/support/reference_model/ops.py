"""Primitives shared by the reference encoders and decoder: seeded weights, RMSNorm, RoPE, and
softmax attention that also returns its log-sum-exp (so it merges exactly with the cache's
partial states).

Everything is float32 on the CPU and deterministic: weights come from one ``torch.Generator``
seeded by the caller, drawn in a fixed order.
"""

from __future__ import annotations

import math

import torch


class Init:
    """Draws weights in a fixed order from one seeded generator (``std = gain / sqrt(fan_in)``)."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def linear(self, fan_in: int, fan_out: int, gain: float = 1.0) -> torch.Tensor:
        """A ``[fan_in, fan_out]`` matrix (``x @ w``)."""
        w = torch.randn(fan_in, fan_out, generator=self.gen, dtype=torch.float32)
        return w * (gain / math.sqrt(fan_in))

    def stack(self, n: int, fan_in: int, fan_out: int, gain: float = 1.0) -> torch.Tensor:
        """``n`` such matrices, ``[n, fan_in, fan_out]``."""
        return torch.stack([self.linear(fan_in, fan_out, gain) for _ in range(n)])

    def vector(self, n: int, std: float) -> torch.Tensor:
        return torch.randn(n, generator=self.gen, dtype=torch.float32) * std


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm without a learned gain (the reference model's gains would all be one)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of ``x [n, heads, dim]`` at absolute
    ``positions [n]``: what makes decoder self-attention KV depend on where it sits."""
    return apply_rope(x, *rope_tables(positions, x.shape[-1], base, x.dtype))


def rope_tables(positions: torch.Tensor, dim: int, base: float = 10000.0,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[n, 1, dim // 2]`` of ``rope`` at ``positions``: computed once per
    chunk, shared by every layer's queries and keys."""
    half = dim // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = positions.to(torch.float64)[:, None] * inv[None, :]
    return torch.cos(angles).to(dtype)[:, None, :], torch.sin(angles).to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q [n, Hq, D]`` over ``k, v [m, Hkv, D]`` (GQA: ``Hq % Hkv == 0``).

    ``mask [n, m]``: True where a query may see a key (None: all). Returns ``(out [n, Hq, D],
    lse [n, Hq])`` in float32, natural log; a query that sees no key gets ``out == 0`` and
    ``lse == -inf``, the convention of ``mmtier.attention.kernels``."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    kk = k.float().repeat_interleave(group, dim=1)
    vv = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[None], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)                              # [Hq, n]
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
    out = torch.einsum("hqk,khd->qhd", probs, vv)
    return out, lse.transpose(0, 1).contiguous()


def gelu_mlp(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ w_in) @ w_out
