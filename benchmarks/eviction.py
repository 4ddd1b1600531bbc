"""Eviction on the cache's own code: prefix hit ratio and recompute time avoided, per policy.

``python -m benchmarks.eviction [--quick] [--jsonl PATH ...]`` replays chain traces through
``TieredKVCache`` (``benchmarks/cachereplay.py``: real keys, contains / put / attach / release,
the cache's ``_make_room -> policy.victims`` path, tiny payloads) with a device tier sized to
5%, 10% and 20% of the trace's distinct bytes (each pool raised, where needed, to the largest
request's chain plus its largest group, which stay attached while the request runs; the JSON
records the effective fraction). Traces:

- ``dialogue``: the multi-turn multimodal generator (``workloads.py``) through ``tracesim.plan``;
- ``sample``: ``benchmarks/traces/heavytail_sample.jsonl``, a checked-in file in the published
  prefix-hash form, through the JSONL importer (``chains.py``); ``--jsonl`` adds any such file
  (e.g. a published production trace);
- ``heavytail``: the heavy-tailed generator (``heavytail.py``), written as JSONL and imported.

Policies: every entry of ``mmtier.eviction.POLICIES``, ``page_lru`` (a per-page baseline: every
group split into chained one-page groups under LRU) and ``belady`` (offline: furthest next use,
leaf-first). A request's hit is the longest cached prefix of its chain; recompute time avoided
weighs hit tokens by the measured seconds per token of their modality
(``benchmarks/traces/recompute_costs.json``, from ``python -m benchmarks.recompute``). Replays
are deterministic (one run each); ``wall_s`` is reported, not compared.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from mmtier.eviction import POLICIES

from ._common import RESULTS, add_out_arg, print_table, write_results
from .cachereplay import pool_floor, replay
from .chains import ChainTrace, from_plan, load_jsonl, write_jsonl
from .heavytail import HeavyTailConfig, generate
from .recompute import load_costs
from .tracesim import plan
from .workloads import WorkloadConfig
from .workloads import generate as generate_dialogue

TRACES = Path(__file__).resolve().parent / "traces"
SAMPLE = TRACES / "heavytail_sample.jsonl"
FRACTIONS = (0.05, 0.1, 0.2)
REFERENCE = ("page_lru", "belady")
PAGE = 128                       # tokens per page of the replay (a 512-token block: 4 pages)


def sample_config() -> HeavyTailConfig:
    """The checked-in sample's generator settings (300 lines)."""
    return HeavyTailConfig(seed=7, requests=300, duration_s=540.0)


def traces(quick: bool, jsonl: list[str], seed: int) -> list[ChainTrace]:
    """The three traces (``quick``: a few dozen requests each, a check that it runs)."""
    n = 40 if quick else 600
    dialogue = from_plan(plan(generate_dialogue(WorkloadConfig(seed=seed, turns=40 if quick else 300)), 16),
                         "dialogue")
    sample = load_jsonl(SAMPLE, name="sample")
    if quick:
        sample.requests = sample.requests[:40]
    out = [dialogue, sample]
    cfg = HeavyTailConfig(seed=seed, requests=n, duration_s=n * 1.8)
    with tempfile.TemporaryDirectory() as tmp:      # through the file, as a published trace
        path = write_jsonl(generate(cfg), Path(tmp) / "heavytail.jsonl")
        out.append(load_jsonl(path, name="heavytail"))
    out += [load_jsonl(p) for p in jsonl]
    return out


def pages_for(trace: ChainTrace, frac: float) -> tuple[dict[str, int], float]:
    """Pages per pool at ``frac`` of distinct bytes (per modality), raised to the floor; and
    the effective fraction."""
    floor = pool_floor(trace, PAGE)
    pages, distinct = {}, 0
    for m in sorted({i.modality for i in trace.items.values()}):
        d = sum(-(-i.tokens // PAGE) for i in trace.items.values() if i.modality == m)
        distinct += d
        pages[m] = max(floor[m], int(frac * d))
    return pages, sum(pages.values()) / distinct


def run(quick: bool = False, jsonl: list[str] | None = None, seed: int = 0,
        out: Path = RESULTS) -> dict:
    t_start = time.perf_counter()
    costs = load_costs()
    names = [*POLICIES, *REFERENCE]
    fig: dict = {"page_tokens": PAGE, "payload_bytes_per_token": 8, "device_only": True,
                 **{f"recompute_s_per_token__{m}": costs[m] for m in ("text", "vision", "audio")}}
    rows = []
    for trace in traces(quick, jsonl or [], seed):
        t = trace.name
        fig[f"requests__{t}"] = len(trace.requests)
        fig[f"distinct_groups__{t}"] = len(trace.items)
        fig[f"first_reference_fraction__{t}"] = trace.first_reference_fraction()
        fig[f"max_chain_groups__{t}"] = max(len(r.chain) for r in trace.requests)
        for frac in FRACTIONS:
            pages, eff = pages_for(trace, frac)
            tag = f"{t}__cap{frac}"
            fig[f"effective_fraction__{tag}"] = eff
            for name in names:
                r = replay(trace, name, pages, costs, PAGE)
                fig[f"hit__{tag}__{name}"] = r.hit_ratio
                fig[f"avoided_s__{tag}__{name}"] = r.avoided_s
                fig[f"avoided_fraction__{tag}__{name}"] = r.avoided_s / r.recompute_s
                fig[f"overflow__{tag}__{name}"] = r.overflow
                fig[f"wall_s__{tag}__{name}"] = r.wall_s
                rows.append((t, frac, eff, name, r))
                print(f"{t:<10} {frac:>5} {eff:>6.3f} {name:<13} hit {r.hit_ratio:.4f} "
                      f"avoided {r.avoided_s:9.1f} s ({r.avoided_s / r.recompute_s:.4f}) "
                      f"overflow {r.overflow} wall {r.wall_s:.1f} s", flush=True)
            lru = fig[f"avoided_s__{tag}__lru"]
            best = max(POLICIES, key=lambda n: fig[f"avoided_s__{tag}__{n}"])
            fig[f"best_policy__{tag}"] = best
            for name in names:
                fig[f"avoided_over_lru__{tag}__{name}"] = fig[f"avoided_s__{tag}__{name}"] / lru if lru else 0.0
                hl = fig[f"hit__{tag}__lru"]
                fig[f"hit_over_lru__{tag}__{name}"] = fig[f"hit__{tag}__{name}"] / hl if hl else 0.0
            bel = fig[f"hit__{tag}__belady"]
            fig[f"lru_hit_over_belady__{tag}"] = fig[f"hit__{tag}__lru"] / bel if bel else 0.0
    tnames = sorted({t for t, *_ in rows})
    for name in POLICIES:      # a policy's worst ratio to LRU over every trace and capacity
        fig[f"min_avoided_over_lru__{name}"] = min(
            fig[f"avoided_over_lru__{t}__cap{f}__{name}"] for t in tnames for f in FRACTIONS)
        fig[f"min_hit_over_lru__{name}"] = min(
            fig[f"hit_over_lru__{t}__cap{f}__{name}"] for t in tnames for f in FRACTIONS)
    fig["heavytail_best_avoided_over_lru_cap0.05"] = max(
        fig[f"avoided_over_lru__heavytail__cap0.05__{n}"] for n in POLICIES)
    fig["heavytail_lru_hit_over_belady_cap0.05"] = fig["lru_hit_over_belady__heavytail__cap0.05"]
    fig["wall_s"] = time.perf_counter() - t_start
    report(fig)
    plot(fig, tnames, names, out)
    write_results("eviction", fig, out)
    return fig


def report(fig: dict) -> None:
    keys = ["heavytail_best_avoided_over_lru_cap0.05", "heavytail_lru_hit_over_belady_cap0.05",
            *(f"min_avoided_over_lru__{n}" for n in POLICIES),
            *(f"min_hit_over_lru__{n}" for n in POLICIES),
            *(k for k in sorted(fig) if k.startswith("first_reference_fraction__")), "wall_s"]
    print_table("eviction figures", [(k, fig[k]) for k in keys])


def plot(fig: dict, tnames: list[str], names: list[str], out: Path = RESULTS) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f, axes = plt.subplots(2, len(tnames), figsize=(5 * len(tnames), 8), squeeze=False)
    xs = [100 * c for c in FRACTIONS]
    for j, t in enumerate(tnames):
        for name in names:
            style = "--" if name in REFERENCE else "-"
            axes[0][j].plot(xs, [fig[f"hit__{t}__cap{c}__{name}"] for c in FRACTIONS], style,
                            marker="o", label=name)
            axes[1][j].plot(xs, [fig[f"avoided_fraction__{t}__cap{c}__{name}"] for c in FRACTIONS],
                            style, marker="o", label=name)
        axes[0][j].set(title=t, xlabel="device tier (% of distinct bytes)", ylabel="prefix hit ratio")
        axes[1][j].set(xlabel="device tier (% of distinct bytes)",
                       ylabel="recompute time avoided (fraction)")
    axes[0][0].legend(fontsize=7)
    f.suptitle("mmtier eviction on TieredKVCache: prefix hits and recompute avoided")
    f.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    f.savefig(out / "eviction.png", dpi=100)
    plt.close(f)


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short traces: seconds, a check that it runs")
    ap.add_argument("--jsonl", action="append", default=[], help="a prefix-hash trace to add")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-sample", action="store_true",
                    help=f"regenerate {SAMPLE.name} from the generator and exit")
    add_out_arg(ap)
    a = ap.parse_args(argv)
    if a.write_sample:
        write_jsonl(generate(sample_config()), SAMPLE)
        return None
    return run(a.quick, a.jsonl, a.seed, a.out)


if __name__ == "__main__":
    main()
