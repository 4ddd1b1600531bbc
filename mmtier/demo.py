"""The in-process demo: a few conversations that send the same images and audio again.

Each media item's K/V comes from a small deterministic "encoder" (a seeded projection of the
media bytes: real tensors, no model download). The demo checks ``contains`` before encoding, so
the table shows what was stored once, what was shared by reference, and what had to be
computed; every conversation's attention is checked against dense float64 attention over the
same K/V.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field

import torch

from .cache import TieredKVCache
from .config import CacheConfig, ModalitySpec

TOKENS = {"vision": 576, "audio": 150}    # a LLaVA-1.5 image; 3 s of Whisper-rate audio


def demo_config(device_bytes: int = 96 << 20) -> CacheConfig:
    return CacheConfig(
        model="tiny-mm", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32",
        modalities={"text": ModalitySpec(page_size=16), "vision": ModalitySpec(page_size=64),
                    "audio": ModalitySpec(page_size=25)},
        device="cpu", device_bytes=device_bytes)


def encode(cfg: CacheConfig, modality: str, media: bytes, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic stand-in encoder: K/V seeded by the media's hash (what a model computes)."""
    spec = cfg.spec(modality)
    seed = int.from_bytes(hashlib.sha256(media).digest()[:8], "little")
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, n, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@dataclass
class ModalityTally:
    items: int = 0
    computed: int = 0
    shared: int = 0
    tokens_computed: int = 0
    tokens_reused: int = 0


@dataclass
class DemoReport:
    tally: dict[str, ModalityTally] = field(default_factory=dict)
    turns: int = 0
    max_rel_err: float = 0.0
    seconds: float = 0.0
    bytes_stored: int = 0
    bytes_without_sharing: int = 0


def run_demo(conversations: int = 6, turns: int = 3, seed: int = 0) -> DemoReport:
    cfg = demo_config()
    rng = random.Random(seed)
    images = [f"image-{i}".encode() * 64 for i in range(max(2, min(4, conversations - 1)))]
    clips = [f"clip-{i}".encode() * 64 for i in range(2)]
    report = DemoReport(tally={m: ModalityTally() for m in ("text", "vision", "audio")})
    t0 = time.perf_counter()
    with TieredKVCache(cfg) as cache:
        for c in range(conversations):
            tenant = f"tenant-{(c // 2) % 2}"       # pairs of conversations per tenant
            seq = cache.create_sequence(tenant=tenant)
            dense_k, dense_v = [], []
            for _ in range(turns):
                items = [("text", None)]
                if rng.random() < 0.8:
                    items.append(("vision", rng.choice(images)))
                if rng.random() < 0.4:
                    items.append(("audio", rng.choice(clips)))
                items.append(("text", None))
                for modality, media in items:
                    tally = report.tally[modality]
                    tally.items += 1
                    if media is None:
                        n = rng.randint(8, 40)
                        k, v = torch.randn(2, n, 2, 64), torch.randn(2, n, 2, 64)
                        cache.append(seq, "text", k, v)
                        tally.computed += 1
                        tally.tokens_computed += n
                    else:
                        n = TOKENS[modality]
                        key = cache.content_key(modality, media, tenant=tenant)
                        if cache.contains(key):
                            tally.shared += 1
                            tally.tokens_reused += n
                        else:
                            k, v = encode(cfg, modality, media, n)
                            cache.put(key, k, v)
                            tally.computed += 1
                            tally.tokens_computed += n
                        k, v = encode(cfg, modality, media, n)   # the dense reference's own copy
                        cache.attach(seq, key)
                    dense_k.append(k)
                    dense_v.append(v)
                report.turns += 1
            q = torch.randn(4, 8, 64)
            out = cache.attention(seq, 1, q)
            report.max_rel_err = max(report.max_rel_err, _dense_check(q, dense_k, dense_v, out))
            cache.release(seq)
        stats = cache.stats()
        report.bytes_stored = sum(stats.total_bytes(t) for t in stats.tiers)
        per_token = {m: cfg.spec(m).token_bytes for m in report.tally}
        report.bytes_without_sharing = sum(
            (t.tokens_computed + t.tokens_reused) * per_token[m] for m, t in report.tally.items()
            if m != "text")
        report.bytes_stored = sum(u.bytes for m, u in stats.tiers["device"].items() if m != "text")
    report.seconds = time.perf_counter() - t0
    return report


def _dense_check(q, ks, vs, out) -> float:
    k = torch.cat(ks, dim=1)[1].double()
    v = torch.cat(vs, dim=1)[1].double()
    t = k.shape[0]
    k = k.repeat_interleave(4, dim=1)
    v = v.repeat_interleave(4, dim=1)
    qpos = torch.arange(t - q.shape[0], t)
    scores = torch.einsum("qhd,thd->hqt", q.double(), k) * 64 ** -0.5
    scores = scores.masked_fill(torch.arange(t)[None, None, :] > qpos[None, :, None], float("-inf"))
    dense = torch.einsum("hqt,thd->qhd", torch.softmax(scores, dim=-1), v)
    return float((out.double() - dense).abs().max() / dense.abs().max())


def format_report(r: DemoReport) -> str:
    lines = [
        f"{'modality':<8} {'items':>6} {'computed':>9} {'shared':>7} {'tokens computed':>16} {'tokens reused':>14}",
    ]
    for m, t in r.tally.items():
        lines.append(f"{m:<8} {t.items:>6} {t.computed:>9} {t.shared:>7} {t.tokens_computed:>16} {t.tokens_reused:>14}")
    lines += [
        "",
        f"media bytes stored: {r.bytes_stored / 2**20:.1f} MiB "
        f"(without sharing: {r.bytes_without_sharing / 2**20:.1f} MiB)",
        f"turns: {r.turns}, attention vs dense float64: max relative error {r.max_rel_err:.2e}",
        f"time: {r.seconds:.2f} s",
    ]
    return "\n".join(lines)
