"""Pool allocate+free throughput, and the CPU attention path against contiguous SDPA.

``python -m benchmarks.pages.alloc [--quick]``

Figures:
- ``alloc_free_pages_per_s_batched``: pages allocated and freed per second in batches of 64
  (how the cache allocates: a group's pages at once); target >= 1,000,000.
- ``alloc_free_pages_per_s_single``: the same, one page per call.
- ``cpu_paged_over_sdpa_decode`` / ``cpu_paged_over_sdpa_prefill``: time of the torch paged path
  over shuffled pages against ``scaled_dot_product_attention`` over the same K/V laid out
  contiguously (ratio; lower is better; target <= 1.3).
"""

from __future__ import annotations

import argparse
import random

import torch

from benchmarks._common import add_out_arg, best_time, print_table, write_results
from mmtier.attention.kernels.layout import build_paged_kv
from mmtier.attention.kernels.reference import paged_attention_torch
from mmtier.config import CacheConfig, ModalitySpec
from mmtier.pages.pool import DeviceArena


def bench_alloc(rounds: int) -> tuple[float, float]:
    cfg = CacheConfig(model="bench", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                      modalities={"text": ModalitySpec(page_size=16)}, device_bytes=64 << 20)
    pool = DeviceArena(cfg).pools["text"]
    batch = 64

    def batched():
        held = [pool.allocate(batch) for _ in range(rounds)]
        for ids in held:
            pool.free(ids)

    def single():
        held = [pool.allocate(1) for _ in range(rounds * 4)]
        for ids in held:
            pool.free(ids)

    t_b = best_time(batched, repeat=3)
    t_s = best_time(single, repeat=3)
    assert pool.num_free == pool.num_pages
    return rounds * batch / t_b, rounds * 4 / t_s


def bench_attention(tokens: int, n_q: int, page_size: int = 16, hkv: int = 8, hq: int = 32,
                    head_dim: int = 128) -> tuple[float, float, float]:
    """(paged seconds, contiguous SDPA seconds, max abs difference)."""
    num_pages = tokens // page_size
    kv = torch.randn(num_pages + 7, 1, 2, page_size, hkv, head_dim)
    ids = list(range(num_pages + 7))
    random.Random(0).shuffle(ids)
    ids = ids[:num_pages]
    op = build_paged_kv(kv, 0, [[(ids, 0, tokens)]])
    q = torch.randn(n_q, hq, head_dim)
    q_indptr = torch.tensor([0, n_q], dtype=torch.int32)
    q_pos = torch.arange(tokens - n_q, tokens, dtype=torch.int32)
    # the same K/V laid out contiguously, in SDPA's [B, H, T, D] with GQA expanded by SDPA itself
    k = kv[ids, 0, 0].reshape(tokens, hkv, head_dim).transpose(0, 1).unsqueeze(0).contiguous()
    v = kv[ids, 0, 1].reshape(tokens, hkv, head_dim).transpose(0, 1).unsqueeze(0).contiguous()
    qs = q.transpose(0, 1).unsqueeze(0)
    causal = n_q > 1
    mask = None
    if causal:
        mask = torch.arange(tokens)[None, :] <= q_pos.long()[:, None]

    def paged():
        return paged_attention_torch(q, q_indptr, q_pos, [op], causal=causal)

    def contiguous():
        return torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)

    a = paged()[0]
    b = contiguous()[0].transpose(0, 1)
    diff = float((a - b).abs().max())
    return best_time(paged, repeat=3), best_time(contiguous, repeat=3), diff


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds, a check that it runs")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    batched, single = bench_alloc(200 if args.quick else 800)
    tokens = 8192 if args.quick else 65536
    dec = bench_attention(tokens, 1)
    pre = bench_attention(tokens // 4, 256)
    figures = {
        "alloc_free_pages_per_s_batched": batched,
        "alloc_free_pages_per_s_single": single,
        "cpu_decode_tokens": tokens,
        "cpu_paged_decode_s": dec[0],
        "cpu_sdpa_decode_s": dec[1],
        "cpu_paged_over_sdpa_decode": dec[0] / dec[1],
        "cpu_prefill_tokens": tokens // 4,
        "cpu_prefill_queries": 256,
        "cpu_paged_over_sdpa_prefill": pre[0] / pre[1],
        "max_abs_diff_vs_sdpa": max(dec[2], pre[2]),
        "shape": "page 16, 8 KV heads, 32 query heads, head dim 128, float32, shuffled pages",
    }
    print_table("pool and CPU attention", list(figures.items()))
    path = write_results("alloc", figures, args.out)
    print(f"\nwrote {path}")
    return figures


if __name__ == "__main__":
    main()
