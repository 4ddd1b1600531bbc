"""Paged attention against attention over the same KV laid out contiguously, side by side.

``python -m benchmarks.kernels.kernels [--quick] [--device cpu|cuda]``

Decode (one query token per sequence) of one long sequence whose context is split across one
to three pools (text pages of 16 tokens, vision 64, audio 256; segments interleaved as in a
multimodal conversation; page ids shuffled). The same K/V, gathered in position order into
``[1, Hkv, N, D]``, feeds ``torch.nn.functional.scaled_dot_product_attention``.

- CPU: the torch path (``paged_attention(..., backend="torch")``) against SDPA;
  ``cpu_paged_over_contiguous`` is the worst time ratio over the contexts measured, and
  ``cpu_bandwidth_fraction`` the K/V bytes per second of the paged path over the copy
  bandwidth measured in the same run.
- GPU: the Triton kernel against SDPA's flash backend (the memory-efficient one where flash
  refuses GQA) over the same K/V made contiguous, in float16 and bfloat16, with the context
  in one pool of each page size (16, 64, 256 tokens) and across all three;
  ``gpu_paged_over_contiguous`` is the worst ratio at 64K tokens and more,
  ``gpu_bandwidth_fraction`` the worst fraction of the device copy bandwidth (measured in the
  same run) at 64K tokens and more (64K-1M; ``--quick``: 64K-256K). Both paths run inside CUDA
  graphs (launch overhead is the serving engine's business, not the kernel's); the plan
  (index validation and grid, from the tables' host copies: no device sync) is built once
  per step and reused, as an engine does across layers; its host cost is ``gpu_plan_us``.
  Times are medians of 7 timed rounds.

Input sets rotate so that caches never hold the K/V between calls. Inputs are random normal.
Writes ``benchmarks/results/kernels.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks._common import (
    add_out_arg,
    best_time,
    paired_rounds,
    print_table,
    ratio_figures,
    spread,
    write_results,
)
from mmtier.attention.kernels import paged_attention
from mmtier.attention.kernels.layout import PagedKV, build_paged_kv
from mmtier.pages.kernels import INDEX_DTYPE

HQ, HKV, DIM = 32, 8, 128
PAGE_SIZES = (16, 64, 256)  # text, vision, audio
# segment lengths per modality in a multimodal conversation: text turns, images, audio clips
SEGMENT_TOKENS = (200, 576, 750)
# the GPU layouts: the context in one pool of each page size, then across all three
GPU_LAYOUTS = ((16,), (64,), (256,), PAGE_SIZES)


@dataclass
class InputSet:
    q: torch.Tensor  # [1, HQ, DIM]
    q_indptr: torch.Tensor
    q_pos: torch.Tensor
    operands: list[PagedKV]
    k_contig: torch.Tensor  # [1, HKV, N, DIM]
    v_contig: torch.Tensor
    q_sdpa: torch.Tensor  # [1, HQ, 1, DIM]
    q_indptr_host: torch.Tensor  # q_indptr on the CPU (planning reads it there)


def make_set(ctx: int, pools: int | tuple[int, ...], dtype, device, gen: torch.Generator) -> InputSet:
    """One decode input: ``ctx`` tokens in segments cycling over ``pools`` modalities (the
    first ``pools`` of ``PAGE_SIZES``, or the page sizes given)."""
    sizes = PAGE_SIZES[:pools] if isinstance(pools, int) else pools
    seg_tokens = [SEGMENT_TOKENS[PAGE_SIZES.index(p)] if p in PAGE_SIZES else 512 for p in sizes]
    pools = len(sizes)
    segments = []  # (pool, start, length)
    pos, i = 0, 0
    while pos < ctx:
        pool = i % pools
        n = min(seg_tokens[pool], ctx - pos)
        segments.append((pool, pos, n))
        pos += n
        i += 1
    need = [0] * pools
    for pool, _, n in segments:
        need[pool] += -(-n // sizes[pool])
    kvs, free = [], []
    for p in range(pools):
        shape = (need[p] + 1, 1, 2, sizes[p], HKV, DIM)
        kvs.append(torch.randn(shape, generator=gen, device=device, dtype=dtype))
        free.append(torch.randperm(need[p] + 1, generator=gen, device=device).tolist())
    tables = [[[]] for _ in range(pools)]
    k = torch.empty((1, HKV, ctx, DIM), device=device, dtype=dtype)
    v = torch.empty((1, HKV, ctx, DIM), device=device, dtype=dtype)
    for pool, start, n in segments:
        size = sizes[pool]
        pages = [free[pool].pop() for _ in range(-(-n // size))]
        tables[pool][0].append((pages, start, n))
        kv = kvs[pool][torch.tensor(pages, device=device), 0]  # [pages, 2, size, H, D]
        k[0, :, start:start + n] = kv[:, 0].reshape(-1, HKV, DIM)[:n].transpose(0, 1)
        v[0, :, start:start + n] = kv[:, 1].reshape(-1, HKV, DIM)[:n].transpose(0, 1)
    operands = [build_paged_kv(kvs[p], 0, tables[p]) for p in range(pools)]
    q = torch.randn((1, HQ, DIM), generator=gen, device=device, dtype=dtype)
    idx = lambda x: torch.tensor(x, dtype=INDEX_DTYPE, device=device)
    return InputSet(q, idx([0, 1]), idx([ctx - 1]), operands, k, v, q.unsqueeze(2),
                    torch.tensor([0, 1], dtype=INDEX_DTYPE))


class Rotate:
    """A zero-argument callable that runs ``fn`` on the next input set each call."""

    def __init__(self, fn, sets):
        self.fn, self.sets, self.i = fn, sets, 0

    def __call__(self):
        self.i += 1
        return self.fn(self.sets[self.i % len(self.sets)])


def kv_bytes(s: InputSet) -> int:
    return s.k_contig.numel() * s.k_contig.element_size() * 2


def n_sets(one_set_bytes: int, cache_bytes: int, cap: int = 8) -> int:
    """Enough input sets that the rotation spans four times the largest cache."""
    return max(2, min(cap, math.ceil(4 * cache_bytes / max(1, one_set_bytes))))


def sdpa(s: InputSet) -> torch.Tensor:
    return F.scaled_dot_product_attention(s.q_sdpa, s.k_contig, s.v_contig, enable_gqa=True)


# ---------------------------------------------------------------------------------------------
# CPU


def cpu_copy_bandwidth(nbytes: int = 256 << 20) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    t = best_time(lambda: dst.copy_(src), repeat=5)
    return 2 * nbytes / t  # read + write


def bench_cpu(quick: bool) -> dict:
    contexts = (2048, 8192) if quick else (4096, 16384, 65536)     # quick: seconds, a check it runs
    pools_list = (1, 3)
    gen = torch.Generator().manual_seed(0)
    bw = cpu_copy_bandwidth((64 if quick else 256) << 20)
    figures: dict = {"cpu_copy_bandwidth_gbs": bw / 1e9}
    ratios, fractions = [], []
    for ctx in contexts:
        for pools in pools_list:
            first = make_set(ctx, pools, torch.float32, "cpu", gen)
            sets = [first] + [make_set(ctx, pools, torch.float32, "cpu", gen)
                              for _ in range(n_sets(kv_bytes(first), (16 if quick else 64) << 20) - 1)]
            ref = sdpa(first).squeeze(2)
            out, _ = paged_attention(first.q, first.q_indptr, first.q_pos, first.operands,
                                     backend="torch")
            err = (out - ref).abs().max().item() / ref.abs().max().item()
            assert err < 1e-4, f"paged and contiguous disagree: {err}"
            t_paged = best_time(Rotate(lambda s: paged_attention(
                s.q, s.q_indptr, s.q_pos, s.operands, backend="torch"), sets))
            t_sdpa = best_time(Rotate(sdpa, sets))
            ratio = t_paged / t_sdpa
            frac = kv_bytes(first) / t_paged / bw
            ratios.append(ratio)
            fractions.append(frac)
            tag = f"cpu_decode_ctx{ctx}_pools{pools}"
            figures[f"{tag}_paged_ms"] = t_paged * 1e3
            figures[f"{tag}_sdpa_ms"] = t_sdpa * 1e3
            figures[f"{tag}_paged_over_contiguous"] = ratio
            figures[f"{tag}_bandwidth_fraction"] = frac
            figures[f"{tag}_sdpa_bandwidth_fraction"] = kv_bytes(first) / t_sdpa / bw
            del sets, first
    figures["cpu_paged_over_contiguous"] = max(ratios)
    figures["cpu_bandwidth_fraction"] = min(fractions)
    figures["cpu_dtype"] = "float32"
    figures.update(bench_cpu_16bit(quick))
    figures["cpu_load_avg_1min"] = os.getloadavg()[0]  # other work on the machine skews figures
    return figures


def bench_cpu_16bit(quick: bool, repeats: int = 7) -> dict:
    """The torch path over bfloat16 pages against the same K/V in float32 pages, per call, side
    by side: Qwen2.5-VL-7B's per-layer shape (4 KV heads x 128, 28 query heads: GQA 7), one
    layer of a 28-layer pool (a page's layers are apart, as in the cache's arena), text pages
    of 16 and vision pages of 64 tokens, shuffled ids, decode with a query of the pool's dtype.
    Medians of ``repeats`` paired rounds (each round: 5 calls of each side, rotated);
    ``cpu_bf16_over_fp32_time`` < 1 is 16-bit pages decoded faster than float32 ones (they
    hold half the bytes, and are widened to float32 on the way to the kernel)."""
    hkv, dim, hq, layers = 4, 128, 28, 28
    ctx = 8192 if quick else 32768
    sides: dict = {}
    outs = {}
    for dtype in (torch.bfloat16, torch.float32):
        operands = []
        table_gen = torch.Generator().manual_seed(2)      # the same tables and values for both
        for size, tokens in ((16, ctx // 4), (64, ctx - ctx // 4)):
            pages = tokens // size
            kv = torch.randn((pages + 1, layers, 2, size, hkv, dim), generator=table_gen).to(torch.bfloat16)
            ids = torch.randperm(pages + 1, generator=table_gen)[:pages].tolist()
            segs = [(ids[i:i + 9], i * size, len(ids[i:i + 9]) * size) for i in range(0, pages, 9)]
            operands.append(build_paged_kv(kv.to(dtype), layers - 1, [segs]))
        q = torch.randn((1, hq, dim), generator=table_gen).to(torch.bfloat16).to(dtype)
        qi = torch.tensor([0, 1], dtype=INDEX_DTYPE)
        qp = torch.tensor([ctx - 1], dtype=INDEX_DTYPE)

        def call(q=q, qi=qi, qp=qp, operands=operands):
            return paged_attention(q, qi, qp, operands, backend="torch", out_dtype=torch.float32)[0]

        def timed(call=call) -> float:
            t0 = time.perf_counter()
            for _ in range(5):
                call()
            return (time.perf_counter() - t0) / 5

        outs[dtype] = call()
        sides[str(dtype).removeprefix("torch.")] = timed
    err = float((outs[torch.bfloat16] - outs[torch.float32]).abs().max() / outs[torch.float32].abs().max())
    assert err < 1e-5, f"bf16 and fp32 pages of the same values disagree: {err}"
    times = paired_rounds(sides, repeats)
    nbytes = {"bfloat16": 2 * ctx * hkv * dim * 2, "float32": 2 * ctx * hkv * dim * 4}
    figures: dict = {"cpu16_ctx": ctx, "cpu16_shape": f"{hkv} KV heads x {dim}, {hq} query heads, 1 of {layers} layers"}
    for name, ts in times.items():
        med = spread(ts).median
        figures[f"cpu16_{name}_ms"] = med * 1e3
        figures[f"cpu16_{name}_gbs"] = nbytes[name] / med / 1e9
        figures[f"cpu16_{name}_mtok_s"] = ctx / med / 1e6
    figures.update(ratio_figures("cpu_bf16_over_fp32_time", times["bfloat16"], times["float32"], False))
    return figures


# ---------------------------------------------------------------------------------------------
# GPU


def gpu_copy_bandwidth(device, nbytes: int = 2 << 30) -> float:
    src = torch.randn(nbytes // 2, device=device, dtype=torch.float16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    t = gpu_time([lambda: dst.copy_(src)], graphs=False, iters=20)
    return 2 * nbytes / t


def gpu_time(fns, *, graphs: bool, iters: int = 50) -> float:
    """Seconds per call (median of 7 rounds), cycling through ``fns`` (one per input set);
    inside one CUDA graph of ``iters`` calls when ``graphs``."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    if graphs:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for f in fns:  # warm the caching allocator on the side stream, as graphs need
                f()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(iters):
                fns[i % len(fns)]()
        run = graph.replay
        calls = iters
    else:
        def run():
            for i in range(iters):
                fns[i % len(fns)]()
        calls = iters
    run()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(rounds)


def bench_gpu(quick: bool, device: str) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    contexts = (65536, 262144) if quick else (65536, 262144, 1 << 20)
    gen = torch.Generator(device=dev).manual_seed(0)
    bw = gpu_copy_bandwidth(dev)
    figures: dict = {"gpu_copy_bandwidth_gbs": bw / 1e9, "gpu_name": props.name,
                     "gpu_dtypes": "float16,bfloat16",
                     "gpu_layouts": ";".join("+".join(map(str, lay)) for lay in GPU_LAYOUTS)}
    backend = SDPBackend.FLASH_ATTENTION
    probe = make_set(4096, 1, torch.float16, dev, gen)
    try:  # flash with GQA; older builds refuse it, then the memory-efficient kernel stands in
        with sdpa_kernel(backend):
            sdpa(probe)
    except RuntimeError:
        backend = SDPBackend.EFFICIENT_ATTENTION
    figures["gpu_sdpa_backend"] = backend.name
    del probe
    ratios, fractions = [], []
    for dtype in (torch.float16, torch.bfloat16):
        for layout in GPU_LAYOUTS:
            for ctx in contexts:
                ratio, frac = _gpu_case(figures, ctx, layout, dtype, dev, gen, l2, bw, backend)
                ratios.append(ratio)
                fractions.append(frac)
    figures["gpu_paged_over_contiguous"] = max(ratios)
    figures["gpu_bandwidth_fraction"] = min(fractions)
    figures["gpu_plan_us"] = max(v for k, v in figures.items() if k.endswith("_plan_us"))
    return figures


def _gpu_case(figures, ctx, layout, dtype, dev, gen, l2, bw, backend) -> tuple[float, float]:
    """One decode case side by side (paged Triton vs SDPA over the same K/V made contiguous);
    its figures go into ``figures``; returns (paged / contiguous time, bandwidth fraction)."""
    from torch.nn.attention import sdpa_kernel

    from mmtier.attention.kernels.triton_attention import (
        paged_attention_triton,
        plan_paged_attention,
    )

    first = make_set(ctx, layout, dtype, dev, gen)
    count = n_sets(kv_bytes(first), l2)
    sets = [first] + [make_set(ctx, layout, dtype, dev, gen) for _ in range(count - 1)]

    def plan(s):
        return plan_paged_attention(s.q, s.q_indptr, s.operands, host_q_indptr=s.q_indptr_host)

    plans = [plan(s) for s in sets]
    t0 = time.perf_counter()
    for _ in range(20):
        plan(first)
    plan_us = (time.perf_counter() - t0) / 20 * 1e6

    def paged(s, p):
        return lambda: paged_attention_triton(s.q, s.q_indptr, s.q_pos, s.operands, plan=p)

    def contiguous(s):
        def f():
            with sdpa_kernel(backend):
                return sdpa(s)
        return f

    out, _ = paged(first, plans[0])()
    with sdpa_kernel(backend):
        ref = sdpa(first).squeeze(2)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < 2e-2, f"paged and contiguous disagree: {err}"
    iters = max(10, min(200, int(2e9 / kv_bytes(first))))
    t_paged = gpu_time([paged(s, p) for s, p in zip(sets, plans)], graphs=True, iters=iters)
    t_sdpa = gpu_time([contiguous(s) for s in sets], graphs=True, iters=iters)
    t_eager = gpu_time([paged(s, p) for s, p in zip(sets, plans)], graphs=False, iters=iters)
    ratio = t_paged / t_sdpa
    frac = kv_bytes(first) / t_paged / bw
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    tag = f"gpu_{name}_decode_ctx{ctx}_pages{'+'.join(map(str, layout))}"
    figures[f"{tag}_paged_us"] = t_paged * 1e6
    figures[f"{tag}_paged_eager_us"] = t_eager * 1e6
    figures[f"{tag}_sdpa_us"] = t_sdpa * 1e6
    figures[f"{tag}_paged_over_contiguous"] = ratio
    figures[f"{tag}_bandwidth_fraction"] = frac
    figures[f"{tag}_sdpa_bandwidth_fraction"] = kv_bytes(first) / t_sdpa / bw
    figures[f"{tag}_splits"] = max(p.num_splits for p in plans[0].operands if p is not None)
    figures[f"{tag}_plan_us"] = plan_us
    figures[f"{tag}_max_rel_err_vs_sdpa"] = err
    print(f"{tag}: paged {t_paged * 1e6:.1f} us, sdpa {t_sdpa * 1e6:.1f} us, "
          f"ratio {ratio:.3f}, bandwidth {frac:.3f}", flush=True)
    del sets, first, plans, out, ref
    torch.cuda.empty_cache()
    return ratio, frac


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer and shorter contexts")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda[:N] for the Triton kernel")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    figures = {"quick": args.quick, "heads_q": HQ, "heads_kv": HKV, "head_dim": DIM}
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here")
        figures.update(bench_gpu(args.quick, args.device))
        targets = [("gpu_paged_over_contiguous (target <= 1.10)", "gpu_paged_over_contiguous"),
                   ("gpu_bandwidth_fraction (target >= 0.85)", "gpu_bandwidth_fraction")]
    else:
        figures.update(bench_cpu(args.quick))
        targets = [("cpu_paged_over_contiguous (target <= 1.3)", "cpu_paged_over_contiguous"),
                   ("cpu_bandwidth_fraction", "cpu_bandwidth_fraction")]
    path = write_results("kernels", figures, args.out)
    rows = [(k, v) for k, v in figures.items()]
    print_table("paged attention vs contiguous SDPA (decode)", rows)
    print_table("headline", [(label, figures[key]) for label, key in targets])
    print(f"\nwrote {path}")
    return figures


if __name__ == "__main__":
    main()
