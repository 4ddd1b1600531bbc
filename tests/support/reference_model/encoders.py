"""The reference model's media encoders: media bytes in, encoder outputs ``[n_tokens, width]`` out.

- ``VisionEncoder``: the bytes, tiled or truncated, fill a fixed ``size x size x 3`` uint8
  grid (a stand-in for decoding an image); non-overlapping ``patch x patch`` patches are
  embedded linearly, a learned position table is added, and a few bidirectional transformer
  blocks run. Always ``(size / patch) ** 2`` tokens (a LLaVA-style fixed image budget).
- ``AudioEncoder``: the bytes are cut into frames of ``frame_bytes`` samples (uint8 PCM, the
  last frame zero-padded), one token per frame; a linear frame embedding plus sinusoidal
  positions, then the same kind of blocks. The token count follows the clip's length.

Both are deterministic functions of (seed, bytes). ``params`` are the preprocessing parameters
that change the tokens; they enter the media's content keys. Empty or oversized media raise
``MediaError`` before anything runs.
"""

from __future__ import annotations

import torch

from mmtier.errors import MMTierError

from .ops import Init, attend, gelu_mlp, rms_norm


class ModelError(MMTierError):
    """The reference model refused its input (bad prompt, bad media, mismatched cache)."""


class MediaError(ModelError, ValueError):
    """A media item the encoders cannot take: not bytes, empty, or too long."""


class _Blocks:
    """Pre-norm bidirectional transformer blocks (MHA + GELU MLP) of one encoder."""

    def __init__(self, init: Init, width: int, heads: int, layers: int):
        self.heads = heads
        self.wqkv = init.stack(layers, width, 3 * width)
        self.wo = init.stack(layers, width, width, gain=0.5)
        self.w_in = init.stack(layers, width, 2 * width)
        self.w_out = init.stack(layers, 2 * width, width, gain=0.5)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, width = x.shape
        d = width // self.heads
        for layer in range(self.wqkv.shape[0]):
            q, k, v = (rms_norm(x) @ self.wqkv[layer]).view(n, 3, self.heads, d).unbind(1)
            out, _ = attend(q, k, v)
            x = x + out.reshape(n, width) @ self.wo[layer]
            x = x + gelu_mlp(rms_norm(x), self.w_in[layer], self.w_out[layer])
        return rms_norm(x)


def _check_media(data: object, modality: str) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MediaError(f"{modality} media must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise MediaError(f"{modality} media is empty (0 bytes)")
    return data


class VisionEncoder:
    """Patch-embedding vision encoder: image bytes -> ``[(size // patch) ** 2, width]``."""

    modality = "vision"

    def __init__(self, seed: int, *, size: int = 32, patch: int = 4, width: int = 64,
                 heads: int = 4, layers: int = 2):
        if size % patch:
            raise ValueError(f"image size {size} is not a multiple of the patch size {patch}")
        init = Init(seed)
        self.size, self.patch, self.width = size, patch, width
        self.num_tokens = (size // patch) ** 2
        self.w_patch = init.linear(3 * patch * patch, width)
        self.pos = init.vector(self.num_tokens * width, 0.5).view(self.num_tokens, width)
        self.blocks = _Blocks(init, width, heads, layers)

    @property
    def params(self) -> dict[str, object]:
        return {"encoder": "patch", "size": self.size, "patch": self.patch}

    def check(self, data: object) -> bytes:
        return _check_media(data, self.modality)

    def tokens_for(self, data: bytes) -> int:
        return self.num_tokens

    def pixels(self, data: bytes) -> torch.Tensor:
        """The ``[size, size, 3]`` uint8 grid the bytes fill (tiled when short, cut when long)."""
        need = self.size * self.size * 3
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        raw = raw.repeat(-(-need // raw.numel()))[:need]
        return raw.view(self.size, self.size, 3)

    def __call__(self, data: bytes) -> torch.Tensor:
        data = self.check(data)
        img = self.pixels(data).float() / 127.5 - 1.0
        g, p = self.size // self.patch, self.patch
        patches = img.view(g, p, g, p, 3).permute(0, 2, 1, 3, 4).reshape(g * g, p * p * 3)
        return self.blocks(patches @ self.w_patch + self.pos)


class AudioEncoder:
    """Frame audio encoder: clip bytes -> ``[ceil(len / frame_bytes), width]``."""

    modality = "audio"

    def __init__(self, seed: int, *, frame_bytes: int = 32, width: int = 48, heads: int = 4,
                 layers: int = 2, max_tokens: int = 4096):
        init = Init(seed)
        self.frame_bytes, self.width, self.max_tokens = frame_bytes, width, max_tokens
        self.w_frame = init.linear(frame_bytes, width)
        self.blocks = _Blocks(init, width, heads, layers)

    @property
    def params(self) -> dict[str, object]:
        return {"encoder": "frames", "frame_bytes": self.frame_bytes}

    def check(self, data: object) -> bytes:
        data = _check_media(data, self.modality)
        if self.tokens_for(data) > self.max_tokens:
            raise MediaError(f"audio clip of {len(data)} bytes is {self.tokens_for(data)} tokens, "
                             f"more than {self.max_tokens}")
        return data

    def tokens_for(self, data: bytes) -> int:
        return -(-len(data) // self.frame_bytes)

    def __call__(self, data: bytes) -> torch.Tensor:
        data = self.check(data)
        n = self.tokens_for(data)
        raw = torch.zeros(n * self.frame_bytes, dtype=torch.float32)
        raw[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).float() - 128.0
        frames = raw.view(n, self.frame_bytes) / 128.0
        return self.blocks(frames @ self.w_frame + _sinusoid(n, self.width))


def _sinusoid(n: int, width: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    inv = 10000.0 ** (-torch.arange(0, width, 2, dtype=torch.float64) / width)
    table = torch.zeros(n, width, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv)
    return (table * 0.5).float()


