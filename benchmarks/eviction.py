"""Modality-group eviction measured against Belady, page-granular LRU and page-size schemes.

``python -m benchmarks.eviction [--quick]`` generates a seeded multi-turn multimodal trace
(``benchmarks/workloads.py``), saves it as Arrow IPC and replays the loaded copy through real
``PagePool``s (a tiny arena; page payloads are never written, only the bookkeeping runs),
``ModalityGroup``s and each policy, at several device capacities with host and disk as byte
budgets (cascade device -> host -> disk -> drop). A capacity point is a fraction of the trace's
distinct KV bytes held by all tiers together: a quarter on the device (raised per pool, where
needed, to the peak of pages pinned by the turns in flight), a quarter in host memory and half on
disk.

Model shapes (bytes are real): text, vision and video are decoder KV of Qwen2-VL-7B (28 layers,
4 KV heads, head dim 128, bf16: 56 KiB per token); audio is Whisper-large-v3 cross-attention KV
(32 layers, 20 heads, head dim 64, fp16: 160 KiB per token). Page sizes per modality divide the
token counts each encoder produces: text 16 (groups are sealed in whole pages, the tail carries
to the next turn), vision 16 (576 = 36 x 16 for LLaVA-1.5; Qwen2-VL's (h/28)(w/28) grids pad at
most 15 tokens), audio 100 (1500 = 15 x 100: a page is 2 s of a Whisper window), video 144 (one
16 x 9 grid = one second of 448x252 Qwen2-VL video). Relative recompute cost per token: text 1,
vision 2, video 2, audio 1.5; modality priorities: vision 4, video 3, text 2, audio 1.

Hit ratio = recompute cost of the looked-up groups served from any tier (no recompute) over the
recompute cost of all lookups (cost-weighted; ``device`` variants count device hits only).
``best_policy_over_belady`` = best shipped policy / best Belady approximation (furthest next use,
or its size-aware variant), averaged over the capacities (``_min`` is the worst capacity).
``group_lru_over_page_lru`` = group LRU / page-granular LRU, averaged likewise.
``best_policy_over_belady_device``: the same with device hits only;
``best_policy_reuse_miss`` / ``belady_reuse_miss``: the cost fraction of reusable lookups (not
first uses) that missed, best policy vs best Belady approximation, averaged over capacities.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

from mmtier.config import CacheConfig, ModalitySpec
from mmtier.eviction import POLICIES

from ._common import RESULTS, add_out_arg, print_table, write_results
from .belady import BeladyPolicy, SizeAwareBeladyPolicy
from .tracesim import (
    GroupTiers,
    PageTiers,
    Plan,
    Stats,
    dedup,
    device_pages_for,
    footprint,
    plan,
    replay,
    waste,
)
from .workloads import WorkloadConfig, generate, load, save

GIB = float(1 << 30)
MODS = ("text", "vision", "audio", "video")
REFERENCE = {"belady": BeladyPolicy, "belady_size": SizeAwareBeladyPolicy}


def bench_config(policy: str = "lru") -> CacheConfig:
    return CacheConfig(
        model="qwen2-vl-7b+whisper-large-v3", num_layers=28, num_kv_heads=4, head_dim=128,
        dtype="bfloat16", device_bytes=1 << 30, eviction_policy=policy,
        modalities={
            "text": ModalitySpec(page_size=16, recompute_cost=1.0, priority=2.0),
            "vision": ModalitySpec(page_size=16, recompute_cost=2.0, priority=4.0),
            "audio": ModalitySpec(page_size=100, num_layers=32, num_kv_heads=20, head_dim=64,
                                  dtype="float16", recompute_cost=1.5, priority=1.0),
            "video": ModalitySpec(page_size=144, recompute_cost=2.0, priority=3.0),
        })


class _PinCounter:
    """A store that keeps nothing and counts pinned pages: the schedule's pinned peak."""

    def __init__(self, cfg: CacheConfig):
        self.specs = cfg.modalities
        self.stats = Stats()
        self.refs: Counter = Counter()
        self.pinned: Counter = Counter()
        self.peak: Counter = Counter()

    def set_now(self, now: int) -> None:
        pass

    def _pin(self, key, mod: str, pages: int) -> None:
        self.refs[key] += 1
        if self.refs[key] == 1:
            self.pinned[mod] += pages
            self.peak[mod] = max(self.peak[mod], self.pinned[mod])

    def attach(self, key, mod, tokens):
        self._pin(key, mod, self.specs[mod].pages_for(tokens))
        return None, (key, mod, self.specs[mod].pages_for(tokens))

    def start_private(self, mod, tokens):
        run = [object(), mod, 0]
        self.grow(run, tokens)
        return run

    def grow(self, run, tokens):
        run[2] += tokens
        self.pinned[run[1]] += 1 if tokens else 0
        self.peak[run[1]] = max(self.peak[run[1]], self.pinned[run[1]])

    def seal(self, run, key, tokens):
        pass

    def release(self, handle):
        key, mod, pages = handle if isinstance(handle, tuple) else (handle[0], handle[1], 0)
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.pinned[mod] -= pages


def pinned_peak(p: Plan, cfg: CacheConfig, concurrency: int) -> dict[str, int]:
    """Peak device pages each pool holds pinned under the replay's schedule (an upper bound:
    private text runs count one page per decode step)."""
    counter = _PinCounter(cfg)
    replay(p, counter, concurrency)
    return dict(counter.peak)


def run(quick: bool, seed: int, turns: int | None, concurrency: int = 4, out: Path = RESULTS) -> dict:
    t_start = time.perf_counter()
    wcfg = WorkloadConfig(seed=seed, turns=turns or (200 if quick else 3000))
    path = save(generate(wcfg), out / f"trace_{'quick' if quick else 'full'}.arrow")
    trace = load(path)
    cfg = bench_config()
    specs = cfg.modalities
    p = plan(trace, specs["text"].page_size)
    fp = footprint(p, specs)
    total = sum(fp.values())
    shares = {m: fp.get(m, 0) / total for m in specs}
    floor = pinned_peak(p, cfg, concurrency)
    fig: dict = {
        "trace_turns": wcfg.turns, "trace_rows": len(trace), "trace_seed": seed,
        "distinct_groups": len(p.groups), "footprint_gib": total / GIB,
        "concurrency": concurrency, "payloads_written": False,
        "hit_ratio_weighting": "recompute cost (tokens x per-token cost), any tier",
        "waste_fraction_modality_pages": waste(p, specs),
        "waste_fraction_uniform16": waste(p, specs, {m: 16 for m in specs}),
        "waste_fraction_padded": waste(p, specs, {m: 16 for m in specs}, padded=True),
    }
    fig["dedup_bytes_ratio"], fig["dedup_bytes_ratio_per_request"] = dedup(p, specs)
    seen: set[int] = set()
    lookup_cost = compulsory = 0.0
    for turn in p.turns:
        for key, mod, tokens in turn.lookups:
            lookup_cost += tokens * specs[mod].recompute_cost
            if key not in seen:
                seen.add(key)
                compulsory += tokens * specs[mod].recompute_cost
        if turn.seal_key is not None:             # sealed by decode: its first lookup can hit
            seen.add(turn.seal_key)
    fig["compulsory_miss_cost_fraction"] = compulsory / lookup_cost
    fractions = (0.1, 0.2, 0.3, 0.5)
    names = [*POLICIES, *REFERENCE, "page_lru"]
    results: dict[tuple[str, float], object] = {}
    for frac in fractions:
        pages = device_pages_for(specs, int(total * frac / 4), shares)
        pages = {m: max(pages[m], floor.get(m, 1)) for m in specs}
        dev = sum(pages[m] * specs[m].page_bytes for m in specs)
        host, disk = int(total * frac / 4), int(total * frac / 2)
        fig[f"device_gib__cap{frac}"] = dev / GIB
        fig[f"host_gib__cap{frac}"] = host / GIB
        fig[f"disk_gib__cap{frac}"] = disk / GIB
        for name in names:
            if name == "page_lru":
                store = PageTiers(cfg, pages, host, disk)
            else:
                cls = POLICIES.get(name) or REFERENCE[name]
                store = GroupTiers(cfg, cls(cfg), pages, host, disk, p)
            stats = replay(p, store, concurrency)
            if isinstance(store, GroupTiers):
                store.check()
            results[(name, frac)] = stats
            tag = f"{name}__cap{frac}"
            fig[f"hit__{tag}"] = stats.ratio("cost")
            fig[f"hit_bytes__{tag}"] = stats.ratio("bytes")
            fig[f"device_hit__{tag}"] = stats.ratio("device_cost")
            reusable = lookup_cost - compulsory
            fig[f"reuse_miss__{tag}"] = (reusable - sum(stats.hit_cost.values())) / reusable
            for m in MODS:
                fig[f"hit__{tag}__{m}"] = stats.ratio("cost", m)
            fig[f"moved_gib__{tag}"] = stats.bytes_moved / GIB
            fig[f"avoided_cost_mtok__{tag}"] = sum(stats.hit_cost.values()) / 1e6
            fig[f"dropped_gib__{tag}"] = stats.dropped_bytes / GIB
            fig[f"overflow__{tag}"] = stats.overflow
    over_belady, over_page, device_over, miss_over = [], [], [], []
    for frac in fractions:
        best = max(fig[f"hit__{n}__cap{frac}"] for n in POLICIES)
        ref = max(fig[f"hit__{n}__cap{frac}"] for n in REFERENCE)
        device_over.append(max(fig[f"device_hit__{n}__cap{frac}"] for n in POLICIES)
                           / max(fig[f"device_hit__{n}__cap{frac}"] for n in REFERENCE))
        miss_over.append((min(fig[f"reuse_miss__{n}__cap{frac}"] for n in POLICIES),
                          min(fig[f"reuse_miss__{n}__cap{frac}"] for n in REFERENCE)))
        fig[f"best_policy__cap{frac}"] = max(POLICIES, key=lambda n: fig[f"hit__{n}__cap{frac}"])
        fig[f"best_policy_over_belady__cap{frac}"] = best / ref
        fig[f"group_lru_over_page_lru__cap{frac}"] = (
            fig[f"hit__lru__cap{frac}"] / fig[f"hit__page_lru__cap{frac}"])
        over_belady.append(best / ref)
        over_page.append(fig[f"group_lru_over_page_lru__cap{frac}"])
    fig["best_policy_over_belady"] = sum(over_belady) / len(over_belady)
    fig["best_policy_over_belady_min"] = min(over_belady)
    fig["best_policy_over_belady_device"] = sum(device_over) / len(device_over)
    fig["best_policy_reuse_miss"] = sum(m for m, _ in miss_over) / len(miss_over)
    fig["belady_reuse_miss"] = sum(r for _, r in miss_over) / len(miss_over)
    fig["group_lru_over_page_lru"] = sum(over_page) / len(over_page)
    fig["group_lru_over_page_lru_min"] = min(over_page)
    fig["wall_s"] = time.perf_counter() - t_start
    report(fig, fractions, names)
    plot(fig, fractions, names, out)
    write_results("eviction", fig, out)
    return fig


def report(fig: dict, fractions, names) -> None:
    print(f"trace: {fig['trace_turns']} turns, {fig['distinct_groups']} distinct groups, "
          f"{fig['footprint_gib']:.1f} GiB distinct KV; payloads not written (bookkeeping only)")
    head = (f"{'cap':>5} {'dev GiB':>10} {'policy':<13} {'hit':>6} {'dev hit':>7} "
            + " ".join(f"{m:>6}" for m in MODS) + f" {'moved GiB':>10} {'avoided Mtok':>12}")
    print(head)
    for frac in fractions:
        for n in names:
            t = f"{n}__cap{frac}"
            print(f"{frac:>5} {fig[f'device_gib__cap{frac}']:>10.2f} {n:<13} {fig[f'hit__{t}']:>6.3f} "
                  f"{fig[f'device_hit__{t}']:>7.3f} "
                  + " ".join(f"{fig[f'hit__{t}__{m}']:>6.3f}" for m in MODS)
                  + f" {fig[f'moved_gib__{t}']:>10.1f} {fig[f'avoided_cost_mtok__{t}']:>12.3f}")
    print_table("eviction figures", [(k, fig[k]) for k in (
        "best_policy_over_belady", "best_policy_over_belady_min",
        "best_policy_over_belady_device", "best_policy_reuse_miss", "belady_reuse_miss",
        "compulsory_miss_cost_fraction", "group_lru_over_page_lru",
        "group_lru_over_page_lru_min", "waste_fraction_modality_pages", "waste_fraction_uniform16",
        "waste_fraction_padded", "dedup_bytes_ratio", "dedup_bytes_ratio_per_request", "wall_s")])


def plot(fig: dict, fractions, names, out: Path = RESULTS) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [100 * f for f in fractions]
    f, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.2))
    for n in names:
        style = "--" if n in REFERENCE else (":" if n == "page_lru" else "-")
        a1.plot(xs, [fig[f"hit__{n}__cap{c}"] for c in fractions], style, marker="o", label=n)
        a2.plot(xs, [fig[f"moved_gib__{n}__cap{c}"] for c in fractions], style, marker="o", label=n)
    xlabel = "cache size, all tiers (% of distinct KV)"
    a1.set(xlabel=xlabel, ylabel="hit ratio (recompute-cost weighted)",
           title="hits, any tier")
    a2.set(xlabel=xlabel, ylabel="GiB moved between tiers", title="tier traffic")
    a1.legend(fontsize=7)
    keys = ["waste_fraction_modality_pages", "waste_fraction_uniform16", "waste_fraction_padded"]
    a3.bar(["modality pages", "uniform 16", "padded (max bytes)"], [fig[k] for k in keys])
    a3.set(ylabel="padding / allocated bytes", title="memory waste, same trace")
    f.suptitle(f"mmtier eviction: {fig['trace_turns']} turns, bookkeeping replay (payloads not written)")
    f.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    f.savefig(out / "eviction.png", dpi=110)
    plt.close(f)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short trace: seconds, a check that it runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=4)
    add_out_arg(ap)
    a = ap.parse_args(argv)
    return run(a.quick, a.seed, a.turns, a.concurrency, a.out)


if __name__ == "__main__":
    main()
