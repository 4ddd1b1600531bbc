"""The reference decoder: a small decoder-only LM with interleaved media tokens and gated
cross-attention, as pure math over explicit tensors.

Layer ``l`` (pre-norm)::

    h = x + Wo[l] · SelfAttn(RoPE(Wq[l] · norm(x)), RoPE(Wk[l] · norm(x)), Wv[l] · norm(x))
    h = h + tanh(gate[c]) · WoX[c] · CrossAttn(WqX[c] · norm(h), media K/V)   # cross layers only
    x = h + SwiGLU(norm(h))

Self-attention is causal over text and media tokens alike (LLaVA-style: media embeddings go
through ``project`` and sit in the sequence), with RoPE at absolute positions, so its K/V
depend on the whole prefix. Cross-attention (every ``cross_every``-th layer, Llama-3.2-Vision /
Flamingo style) reads K/V computed by ``cross_kv`` from a media item's encoder outputs alone,
with no positions, so they are the same wherever the item sits.

How attention is computed is the caller's business: ``forward`` takes the two attention
functions. The cached path passes functions that go through ``TieredKVCache``; the dense path
passes plain torch attention over concatenated K/V. Everything else is shared, so the two paths
differ only in where attention reads its keys from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .ops import Init, apply_rope, rms_norm, rope_tables

SelfAttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
CrossAttnFn = Callable[[int, torch.Tensor], "torch.Tensor | None"]


@dataclass(frozen=True)
class DecoderDims:
    vocab: int = 256
    hidden: int = 128
    num_layers: int = 4
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    mlp_hidden: int = 256
    cross_every: int = 2          # layers cross_every-1, 2*cross_every-1, ... cross-attend
    rope_base: float = 10000.0

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_q_heads} query heads are not a multiple of "
                             f"{self.num_kv_heads} KV heads")
        if self.cross_every <= 0:
            raise ValueError("cross_every must be positive")

    @property
    def cross_layers(self) -> tuple[int, ...]:
        """Decoder layers that carry a cross-attention block, in order."""
        return tuple(range(self.cross_every - 1, self.num_layers, self.cross_every))

    @property
    def num_cross_layers(self) -> int:
        return len(self.cross_layers)


class Decoder:
    """Seeded weights and the layer math (float32, CPU)."""

    def __init__(self, dims: DecoderDims, media_widths: dict[str, int], seed: int):
        init = Init(seed)
        d, hid = dims, dims.hidden
        qdim, kvdim = d.num_q_heads * d.head_dim, d.num_kv_heads * d.head_dim
        self.dims = d
        self.embed = init.linear(1, d.vocab * hid).view(d.vocab, hid)       # std 1
        self.wq = init.stack(d.num_layers, hid, qdim)
        self.wk = init.stack(d.num_layers, hid, kvdim)
        self.wv = init.stack(d.num_layers, hid, kvdim)
        self.wo = init.stack(d.num_layers, qdim, hid, gain=0.5)
        self.w_gate = init.stack(d.num_layers, hid, d.mlp_hidden)
        self.w_up = init.stack(d.num_layers, hid, d.mlp_hidden)
        self.w_down = init.stack(d.num_layers, d.mlp_hidden, hid, gain=0.5)
        nc = d.num_cross_layers
        self.xq = init.stack(nc, hid, qdim)
        self.xo = init.stack(nc, qdim, hid, gain=0.5)
        self.x_gate = torch.tanh(init.vector(nc, 1.0).abs() + 0.5)
        self.lm_head = init.linear(hid, d.vocab, gain=2.0)
        # per modality: the LLaVA-style projector into the decoder, and cross-attention K/V maps
        self.proj: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.xk: dict[str, torch.Tensor] = {}
        self.xv: dict[str, torch.Tensor] = {}
        for modality in sorted(media_widths):
            width = media_widths[modality]
            self.proj[modality] = (init.linear(width, hid), init.linear(hid, hid))
            self.xk[modality] = init.stack(nc, width, kvdim)
            self.xv[modality] = init.stack(nc, width, kvdim)

    # ------------------------------------------------------------------ inputs
    def embed_tokens(self, ids: list[int]) -> torch.Tensor:
        return self.embed[torch.tensor(ids, dtype=torch.long)]

    def project(self, modality: str, enc: torch.Tensor) -> torch.Tensor:
        """Encoder outputs ``[n, width]`` -> decoder inputs ``[n, hidden]`` (media tokens)."""
        w1, w2 = self.proj[modality]
        return torch.nn.functional.gelu(enc @ w1) @ w2

    def cross_kv(self, modality: str, enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention K/V ``[num_cross_layers, n, Hkv, D]`` from encoder outputs alone."""
        d = self.dims
        shape = (d.num_cross_layers, enc.shape[0], d.num_kv_heads, d.head_dim)
        k = torch.einsum("nw,cwo->cno", enc, self.xk[modality]).reshape(shape)
        v = torch.einsum("nw,cwo->cno", enc, self.xv[modality]).reshape(shape)
        return k.contiguous(), v.contiguous()

    # ------------------------------------------------------------------ the stack
    def forward(self, x: torch.Tensor, positions: torch.Tensor, self_attn: SelfAttnFn,
                cross_attn: CrossAttnFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run ``x [n, hidden]`` at ``positions [n]`` through every layer.

        ``self_attn(layer, q, k, v)`` gets this chunk's post-RoPE ``q [n, Hq, D]`` and
        ``k, v [n, Hkv, D]`` and returns ``[n, Hq, D]`` over the prefix and the chunk itself;
        ``cross_attn(cross_layer, q)`` returns ``[n, Hq, D]``, or None when no media is visible
        (the block then adds nothing). Returns the final hidden states and the chunk's
        self-attention K/V ``[num_layers, n, Hkv, D]``, ready for the cache."""
        d = self.dims
        n = x.shape[0]
        cross_of = {layer: c for c, layer in enumerate(d.cross_layers)}
        ks, vs = [], []
        cos, sin = rope_tables(positions, d.head_dim, d.rope_base, x.dtype)    # one table per chunk
        for layer in range(d.num_layers):
            h = rms_norm(x)
            q = apply_rope((h @ self.wq[layer]).view(n, d.num_q_heads, d.head_dim), cos, sin)
            k = apply_rope((h @ self.wk[layer]).view(n, d.num_kv_heads, d.head_dim), cos, sin)
            v = (h @ self.wv[layer]).view(n, d.num_kv_heads, d.head_dim)
            ks.append(k)
            vs.append(v)
            out = self_attn(layer, q, k, v)
            x = x + out.reshape(n, -1).float() @ self.wo[layer]
            c = cross_of.get(layer)
            if c is not None:
                qx = (rms_norm(x) @ self.xq[c]).view(n, d.num_q_heads, d.head_dim)
                out = cross_attn(c, qx)
                if out is not None:
                    x = x + self.x_gate[c] * (out.reshape(n, -1).float() @ self.xo[c])
            h = rms_norm(x)
            gated = torch.nn.functional.silu(h @ self.w_gate[layer]) * (h @ self.w_up[layer])
            x = x + gated @ self.w_down[layer]
        return x, torch.stack(ks).contiguous(), torch.stack(vs).contiguous()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x) @ self.lm_head

    def causal_mask(self, n: int, past: int) -> torch.Tensor:
        """``[n, past + n]``: query ``i`` (at ``past + i``) sees keys ``0 .. past + i``."""
        return torch.arange(past + n)[None, :] <= (past + torch.arange(n))[:, None]


__all__ = ["CrossAttnFn", "Decoder", "DecoderDims", "SelfAttnFn"]
