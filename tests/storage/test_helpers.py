"""Shared helpers of the storage tests (no tests here): a config with odd shapes, keys, pages
of random non-zero bytes, and byte-exact comparison."""

from __future__ import annotations

import hashlib

import torch
import xxhash

from mmtier.config import CacheConfig
from mmtier.content import KeyMaker

MODEL = "tiny-mm"


def make_config() -> CacheConfig:
    return CacheConfig(
        model=MODEL, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
        modalities={"text": {"page_size": 16},
                    "vision": {"page_size": 64, "head_dim": 80, "dtype": "float32"},
                    "audio": {"page_size": 32, "dtype": "bfloat16"},
                    "vision_embed": {"kind": "embedding", "page_size": 16, "width": 96}},
        device="cpu", device_bytes=1 << 20)


CFG = make_config()
KEYS = KeyMaker(MODEL, "test-secret")


def key(modality: str, i: int, model_keys: KeyMaker = KEYS):
    spec = CFG.spec(modality)
    media = hashlib.sha256(f"{modality}/{i}".encode()).digest()
    return model_keys.derive(modality=modality, layout=spec.layout_fields(), media=media,
                             tenant_salt=b"\x01" * 32)


def rand_pages(spec, n: int, seed: int) -> torch.Tensor:
    """``[n, *page_shape]`` of random bytes in 1..255 (never zero, every bit pattern class)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(1, 256, (n * spec.page_bytes,), dtype=torch.uint8, generator=g)
    return raw.view(spec.torch_dtype).view(n, *spec.page_shape)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and as_bytes(a) == as_bytes(b)


def page_sums(t: torch.Tensor) -> list[int]:
    return [xxhash.xxh3_64_intdigest(as_bytes(t[i])) for i in range(t.shape[0])]
