"""The float64 oracle: plain softmax attention over gathered K/V."""

from __future__ import annotations

import math

import torch


def oracle_attention(q, q_pos, keys, values, key_pos, causal: bool = True, scale: float | None = None):
    """``q [n_q, Hq, D]``, ``keys/values [T, Hkv, D]``, positions int; returns float64
    ``(out [n_q, Hq, D], lse [n_q, Hq])`` (lse -inf and out 0 where nothing is visible)."""
    q = q.double()
    k = keys.double()
    v = values.double()
    n_q, hq, d = q.shape
    hkv = k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,thd->hqt", q, k) * scale
    if causal:
        allowed = key_pos.long()[None, :] <= q_pos.long()[:, None]
        scores = scores.masked_fill(~allowed[None], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    p = torch.where(torch.isfinite(lse)[..., None], p, torch.zeros_like(p))
    out = torch.einsum("hqt,thd->qhd", p, v)
    return out, lse.transpose(0, 1)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs error over the max abs of the expected value."""
    expected = expected.double()
    return float((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


class Logical:
    """What a sequence holds, kept independently of the cache, for the oracle."""

    def __init__(self):
        self.k, self.v, self.tags = [], [], []

    def add(self, k, v, tag):
        self.k.append(k)
        self.v.append(v)
        self.tags.extend([tag] * k.shape[1])

    def gathered(self, layer, select=None):
        k = torch.cat(self.k, dim=1)[layer]
        v = torch.cat(self.v, dim=1)[layer]
        pos = torch.arange(k.shape[0])
        if select is not None:
            idx = torch.tensor([i for i, t in enumerate(self.tags) if t in select])
            return k[idx], v[idx], pos[idx]
        return k, v, pos
