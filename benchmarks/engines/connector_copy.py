"""The vLLM connector's worker-side copies against a plain tensor copy of the same bytes.

``python -m benchmarks.engines.connector_copy [--quick]``

One request's prompt of ``tokens`` positions sits in vLLM-layout paged KV tensors (one per
layer, ``[blocks, heads, block_size, 2 * head_dim]``, physically block-then-token-major) on
shuffled blocks. Measured side by side in paired rounds (``--repeat`` >= 5): each round runs the plain
copy, then a save and a load of fresh groups over the same bytes (random values); each ratio is
the median of the per-round ratios (best, worst and every pair beside it, the load per round):

- plain copy: ``copy_`` of a contiguous ``[layers, tokens, heads, 2 * head_dim]`` tensor into
  another (the floor: the bytes moved once, no indexing);
- slot gather / scatter: vLLM's tensors to contiguous and back by ``slot_mapping`` (what any
  connector pays, no store behind it);
- save: what ``MMTierConnector`` does per step for groups of whole blocks. On a CPU: ``put``
  straight from vLLM's tensors (``vllm.copy.engine_blocks``; the connector's writer thread does
  this after ``wait_for_save`` and the next step waits for it before vLLM writes a block): one
  copy, the NaN / Inf test inside it. On a GPU: each group's runs of consecutive blocks copied
  as they lie into a stage laid out as vLLM's tensors (``save_kv_layer``), then ``put`` of the
  stage's block-split K/V views (timed here inline, its cost): the layout change in the second;
- load: what ``start_load_kv`` does for a whole group of whole blocks: ``read_group(out=)``
  straight into vLLM's blocks of every layer (``vllm.copy.engine_blocks``: one copy from the
  cache's pages, no stage); checked equal to the source;
- beside them (``save_staged_*``, ``load_staged_*``): the staged save (as on a GPU) and the
  staged load (``read_group(out=)`` into a stage laid out as vLLM's tensors, then per layer
  each group's blocks copied as they lie into vLLM's tensor: the connector's path for a load
  of part of a group).

Save and load run twice: with one group per block (``mmtier_chunk_blocks=1``) and with the
connector's default chunks of 16 blocks. On a CPU the torch thread count is pinned
(``--threads``, default 1): on a shared machine oversubscribed threads make every figure noise.

Figures: GB/s of each, ``save_over_plain_copy`` / ``load_over_plain_copy`` (ratios of GB/s,
chunks of 16 blocks) and the same with ``_block_groups``.
Writes ``benchmarks/results/connector_copy.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks._common import add_out_arg, print_table, ratio_figures, write_results
from mmtier import CacheConfig, TieredKVCache
from mmtier.engines.vllm import copy as vllm_copy


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.repeat < 5:
        ap.error("--repeat must be >= 5 (medians of at least five rounds)")
    L, H, D, BS = (4, 4, 64, 16) if args.quick else (16, 8, 128, 16)
    tokens = 512 if args.quick else 2048
    dtype, dev = torch.float16, torch.device(args.device)
    nblk = tokens // BS
    num_blocks = 2 * nblk
    assert tokens % (16 * BS) == 0
    g = torch.Generator().manual_seed(0)
    blocks = torch.randperm(num_blocks, generator=g)[:nblk]
    slots = (blocks[:, None] * BS + torch.arange(BS)).flatten().to(dev)

    def paged(fill: bool):
        t = torch.full((num_blocks, BS, H, 2 * D), float("nan"), dtype=dtype, device=dev)
        if fill:
            t.copy_(torch.randn(t.shape, generator=g).to(dtype))
        return t.transpose(1, 2)
    src = [paged(True) for _ in range(L)]
    dst = [paged(False) for _ in range(L)]
    nbytes = L * tokens * H * 2 * D * src[0].element_size()

    cfg = CacheConfig(model="bench-connector", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float16",
                      modalities={"text": {"page_size": BS}}, device=str(dev),
                      device_bytes=3 * nbytes, host_bytes=0, disk_dir=None)
    cache = TieredKVCache(cfg)
    cache.pools["text"].view.zero_()       # the arena resident, as a GPU's is (no first-touch faults timed)
    # keys are the scheduler's work (computed there, once per request): made before timing
    made = iter(range(1 << 30))
    keys: list = []
    group = [BS]                                      # tokens per group (one block, or a chunk)

    def new_keys():
        r = next(made)
        return [cache.content_key("text", f"r{r}g{i}".encode()) for i in range(tokens // group[0])]

    plain_a = torch.randn(L, tokens, H, 2 * D, generator=g).to(dtype).to(dev)
    plain_b = torch.empty_like(plain_a)
    stage_k = torch.empty(L, tokens, H, D, dtype=dtype, device=dev)
    stage_v = torch.empty_like(stage_k)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def plain():
        plain_b.copy_(plain_a)
        sync()

    def gather_scatter():
        for layer in range(L):
            vllm_copy.gather(src[layer], slots, D, stage_k[layer], stage_v[layer])
        for layer in range(L):
            vllm_copy.scatter(dst[layer], slots, D, stage_k[layer], stage_v[layer])
        sync()

    block_ids = [int(b) for b in blocks]
    pool = vllm_copy.StagePool(keep=tokens // BS)      # the connector's: stages reused

    def save_staged(batch):
        """The connector's path for groups of whole blocks on a GPU: per layer, each group's runs
        of blocks copied as they lie into a stage laid out as vLLM's tensors (``save_kv_layer``),
        then ``put`` of the stage's block-split K/V views (the writer thread's work)."""
        keys[:] = batch
        nb = group[0] // BS
        stages = [pool.take(src[0], L, nb) for _ in keys]
        for layer in range(L):
            for i, stage in enumerate(stages):
                vllm_copy.copy_blocks(src[layer], block_ids[i * nb:(i + 1) * nb], stage[layer], None)
        for key, stage in zip(keys, stages):
            cache.put(key, *vllm_copy.stage_kv(stage, D))
            pool.give(stage)
        sync()

    def load_staged():
        """``read_group`` of every group into a stage laid out as vLLM's tensors (the reader
        thread), then per layer each group's blocks copied as they lie into vLLM's tensor."""
        nb = group[0] // BS
        stages = [pool.take(dst[0], L, nb) for _ in keys]
        for key, stage in zip(keys, stages):
            cache.read_group(key, out=vllm_copy.stage_kv(stage, D))
        for layer in range(L):
            for i, stage in enumerate(stages):
                vllm_copy.copy_blocks(stage[layer], None, dst[layer], block_ids[i * nb:(i + 1) * nb])
        for stage in stages:
            pool.give(stage)
        sync()

    def save_direct(batch):
        """The connector's path on a CPU (``vllm.copy.engine_blocks``): ``put`` straight from
        vLLM's tensors, one copy."""
        keys[:] = batch
        nb = group[0] // BS
        for i, key in enumerate(keys):
            blocks = vllm_copy.engine_blocks(src, D, block_ids[i * nb:(i + 1) * nb])
            cache.put(key, blocks, blocks)
        sync()

    def load():
        """The connector's load of whole groups: ``read_group(out=)`` straight into vLLM's
        blocks of every layer (``vllm.copy.engine_blocks``)."""
        nb = group[0] // BS
        for i, key in enumerate(keys):
            cache.read_group(key, out=vllm_copy.engine_blocks(dst, D, block_ids[i * nb:(i + 1) * nb]))
        sync()

    # paired rounds: each round runs the plain copy, then save and load of fresh groups, so
    # that every ratio is taken within one round (a shared machine's load moves between rounds)
    plain()
    gather_scatter()
    rounds: dict[str, list[float]] = {"plain": [], "gather_scatter": [], "load_avg": []}
    save, save_alt = (save_direct, save_staged) if dev.type == "cpu" else (save_staged, save_direct)
    for label, n, save_fn, load_fn in (("block", BS, save, load), ("chunk", 16 * BS, save, load),
                                       ("alt", 16 * BS, save_alt, load_staged)):
        group[0] = n
        batches = [new_keys() for _ in range(args.repeat + 1)]   # outside the timed rounds
        save_fn(batches[0])                                      # warm-up (stages, first-touch)
        load_fn()
        for r in range(args.repeat):
            rounds["load_avg"].append(os.getloadavg()[0])
            rounds["plain"].append(_timed(plain))
            if label == "chunk":
                rounds["gather_scatter"].append(_timed(gather_scatter))
            rounds.setdefault(f"save_{label}", []).append(_timed(lambda b=batches[r + 1], f=save_fn: f(b)))
            for t in dst:                           # poisoned again: only load can restore them
                t.fill_(float("nan"))
            rounds.setdefault(f"load_{label}", []).append(_timed(load_fn))
            if not all(_slots_equal(d, s, slots) for d, s in zip(dst, src, strict=True)):
                raise AssertionError("load did not restore the saved bytes")
    cache.close()
    med = {k: statistics.median(v) for k, v in rounds.items()}
    gbs = lambda t: nbytes / t / 1e9  # noqa: E731
    plain_b, plain_c, plain_d = (rounds["plain"][i * args.repeat:(i + 1) * args.repeat] for i in range(3))
    fig = {"quick": args.quick, "device": str(dev), "layers": L, "kv_heads": H, "head_dim": D,
           "block_size": BS, "tokens": tokens, "bytes": nbytes, "repeat": args.repeat,
           "plain_copy_gbs": gbs(med["plain"]), "slot_gather_scatter_gbs": gbs(med["gather_scatter"] / 2),
           "threads": torch.get_num_threads(),
           "round_loads": "; ".join(f"{x:.2f}" for x in rounds["load_avg"]),
           "save_gbs": gbs(med["save_chunk"]), "load_gbs": gbs(med["load_chunk"]),
           "save_block_groups_gbs": gbs(med["save_block"]), "load_block_groups_gbs": gbs(med["load_block"]),
           "save_path": "direct" if dev.type == "cpu" else "staged",
           f"save_{'staged' if dev.type == 'cpu' else 'direct'}_gbs": gbs(med["save_alt"]),
           "load_staged_gbs": gbs(med["load_alt"])}
    # ratios of speeds = plain seconds over the op's seconds, per round, medians
    fig.update(ratio_figures("save_over_plain_copy", plain_c, rounds["save_chunk"], higher_is_better=True))
    fig.update(ratio_figures("load_over_plain_copy", plain_c, rounds["load_chunk"], higher_is_better=True))
    fig.update(ratio_figures("save_over_plain_copy_block_groups", plain_b, rounds["save_block"],
                             higher_is_better=True))
    fig.update(ratio_figures("load_over_plain_copy_block_groups", plain_b, rounds["load_block"],
                             higher_is_better=True))
    fig.update(ratio_figures(f"save_{'staged' if dev.type == 'cpu' else 'direct'}_over_plain_copy", plain_d,
                             rounds["save_alt"], higher_is_better=True))
    fig.update(ratio_figures("load_staged_over_plain_copy", plain_d, rounds["load_alt"], higher_is_better=True))
    print_table(f"connector worker-side copy, {nbytes / 2**20:.0f} MiB, {dev} (medians of {args.repeat})",
                [(k, v) for k, v in fig.items() if k.endswith(("gbs", "copy", "groups", "_best", "_worst"))])
    write_results("connector_copy", fig, args.out)
    return fig


def _slots_equal(a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> bool:
    fa = a.transpose(1, 2).flatten(0, 1)[slots]
    fb = b.transpose(1, 2).flatten(0, 1)[slots]
    return torch.equal(fa, fb)


if __name__ == "__main__":
    main()
