"""Eviction on the cache's own policy code: prefix-block hit ratio, recompute avoided and cost
per operation, per policy, trace and capacity.

``python -m benchmarks.eviction.eviction [--quick] [--jsonl PATH ...] [--mooncake PATH]`` replays chain
traces through each policy class of ``mmtier.eviction.POLICIES`` as ``TieredKVCache`` drives it
(``benchmarks/eviction/policyreplay.py``: contains / put / attach / release, room made by
``policy.victims`` as ``Room.make_room`` does, the cache's own keys), with a device tier of 5%,
10% and 20% of the distinct pages of the requests replayed (per modality; nothing raises it: a
group that finds no room while the request's own chain holds the pool is not stored,
``uncached__``). The same replay through the whole cache (``cachereplay.replay``) is run for
every policy on the first requests of ``sample`` and must give the same hits, puts and
evictions (``cache_parity_mismatches``: 0); an independent replay of the published form
(``blockreplay.py``: one group per hash id, capacity in blocks) is run for every policy on
``mooncake_2k`` at 5% and 10% beside this replay at 512-token pages, and must give the same
hits request by request (``independent_replay_mismatches``: 0; on ``conversation_2k`` too). Traces:

- ``dialogue``: the multi-turn multimodal generator (``workloads.py``) through ``tracesim.plan``;
- ``multimodal``: the same generator, seeded, with images, video and audio as content-only
  groups (cross-attention / encoder KV) from Zipf catalogues re-sent across conversations and
  by several tenants (whose keys differ: nothing is shared across tenants), 24 conversations
  open at once;
- ``sample``: ``benchmarks/eviction/traces/heavytail_sample.jsonl``, a checked-in file in the published
  prefix-hash form, through the JSONL importer (``chains.py``);
- ``heavytail``: the heavy-tailed generator (``heavytail.py``), written as JSONL and imported;
- ``mooncake``: Mooncake's public synthetic trace (``timestamp``, ``input_length``,
  ``output_length``, ``hash_ids`` of 512-token blocks), all of it, and ``mooncake_2k``: its
  first 2,000 requests only (the cold start: 67% of block references are first ones, against
  36% over the whole trace, whose second half re-reads the first): ``--mooncake PATH``, else
  ``$MMTIER_MOONCAKE_TRACE``, else ``shared/traces/mooncake_synthetic_trace.jsonl`` in the
  folder that holds the repository; skipped, and said so in ``mooncake_skipped``, when absent.
  ``--jsonl`` adds any file of that form;
- ``conversation_2k``: the first 2,000 requests of Mooncake's public conversation trace
  (``benchmarks/eviction/traces/mooncake_conversation_2000.jsonl.gz``, Apache-2.0; its source in
  the README there), a second real trace the default policy was not tuned on.

Policies: every entry of ``POLICIES``, ``page_lru`` (a per-page baseline: every group split into
chained one-page groups under LRU) and ``belady`` (offline: furthest next use, leaf-first). A
request's hit is the longest cached prefix of its chain, scored as blocks (``block_hit__``: the
trace's blocks, a partial last block one; a generated trace's group one), tokens (``hit__``)
and recompute time avoided (``avoided_fraction__``: hit tokens weighed by the measured seconds
per token of their modality, ``benchmarks/eviction/traces/recompute_costs.json``), each also over LRU's
(``block_hit_over_lru__``, ``hit_over_lru__``, ``avoided_over_lru__``) and Belady's.

Targets (``TARGET_FRACTIONS``, 5% and 10%; both scores, ``SCORES``): a policy
``meets_targets__NAME`` when it keeps at least ``FLOOR`` (0.99x) of LRU on every trace and
reaches ``LIFT`` on ``mooncake_2k`` and ``conversation_2k`` (1.3x LRU at 5%, 1.2x at 10%); ``target_policy`` names the
best that does (``none`` when none does, or ``mooncake_2k`` is missing), ``default_policy`` the
presets' default (``CacheConfig``'s). Replays are deterministic (one run each). Cost per
operation: ``op_us__NAME`` is the replay's wall time over its policy calls (hooks and
``victims``) on ``heavytail`` at 5% and 20%, ``op_cost_over_lru__NAME`` the median over 5 paired
rounds (the two in turn first) of its time per call over LRU's at 5%, ``op_cost_growth__NAME``
that ratio at 20% (four times the groups) over the one at 5%: about 1 for a policy whose
decisions cost what LRU's heaps do, O(log n); ``op_cost_growth_lru_alone`` LRU's own time per
call at 20% over 5%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from mmtier.config import CacheConfig
from mmtier.eviction import POLICIES

from .._common import RESULTS, add_out_arg, print_table, write_results
from .blockreplay import block_replay, capacity_for, read_records
from .cachereplay import bench_config, replay
from .chains import ChainTrace, from_plan, load_jsonl, write_jsonl
from .heavytail import HeavyTailConfig, generate
from .policyreplay import replay_policy, trace_keys
from .recompute import load_costs
from .tracesim import plan
from .workloads import WorkloadConfig
from .workloads import generate as generate_dialogue

TRACES = Path(__file__).resolve().parent / "traces"
SAMPLE = TRACES / "heavytail_sample.jsonl"
MOONCAKE = Path(os.environ.get("MMTIER_MOONCAKE_TRACE") or
                Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl")
FRACTIONS = (0.05, 0.1, 0.2)
TARGET_FRACTIONS = (0.05, 0.1)
HEAVY = ("sample", "heavytail")
REFERENCE = ("page_lru", "belady")
PAGE = 128                       # tokens per page of the replay (a 512-token block: 4 pages)
BLOCK = 512                      # tokens a block of the published traces
PARITY_REQUESTS = 150
HEAD, HEAD_REQUESTS = "mooncake_2k", 2000     # the Mooncake trace's first requests (cold: 67%
                                              # first references; the whole trace 36%)
CONVERSATION = TRACES / "mooncake_conversation_2000.jsonl.gz"   # a second real trace, checked in
CONV = "conversation_2k"
FLOOR = 0.99                                  # of LRU, every trace, both scores, 5% and 10%
LIFT = {HEAD: {0.05: 1.3, 0.1: 1.2},          # of LRU there, both scores
        CONV: {0.05: 1.3, 0.1: 1.2}}
SCORES = ("block_hit", "avoided")             # prefix-block hit ratio, recompute avoided


def sample_config() -> HeavyTailConfig:
    """The checked-in sample's generator settings (300 lines)."""
    return HeavyTailConfig(seed=7, requests=300, duration_s=540.0)


def multimodal_config(seed: int, turns: int) -> WorkloadConfig:
    """Content-only media (images, video, audio) re-sent across conversations and tenants."""
    return WorkloadConfig(seed=seed + 1, turns=turns, tenants=4, active=24,
                          vision_sharing="content", audio_sharing="content")


def traces(quick: bool, jsonl: list[str], seed: int, mooncake: Path | None) -> list[ChainTrace]:
    """The traces (``quick``: a few dozen requests each, a check that it runs)."""
    n = 40 if quick else 600
    out = [from_plan(plan(generate_dialogue(WorkloadConfig(seed=seed, turns=40 if quick else 300)), 16),
                     "dialogue"),
           from_plan(plan(generate_dialogue(multimodal_config(seed, 60 if quick else 1500)), 16),
                     "multimodal")]
    out.append(load_jsonl(SAMPLE, name="sample"))
    out.append(load_jsonl(CONVERSATION, name=CONV))
    cfg = HeavyTailConfig(seed=seed, requests=n, duration_s=n * 1.8)
    with tempfile.TemporaryDirectory() as tmp:      # through the file, as a published trace
        path = write_jsonl(generate(cfg), Path(tmp) / "heavytail.jsonl")
        out.append(load_jsonl(path, name="heavytail"))
    if mooncake is not None and mooncake.exists():
        out.append(load_jsonl(mooncake, name="mooncake"))
        out.append(load_jsonl(mooncake, name=HEAD, limit=HEAD_REQUESTS))
    out += [load_jsonl(p) for p in jsonl]
    if quick:
        for t in out:
            t.requests = t.requests[:40]
    return out


def pages_for(trace: ChainTrace, frac: float) -> tuple[dict[str, int], float]:
    """Pages per pool at ``frac`` of the distinct pages of its modality (at least one), and the
    effective fraction. Nothing raises a pool: a group that finds no room while the request's
    own chain holds the pool is not stored (``uncached``), as a cache of that size serves it."""
    pages, distinct = {}, 0
    for m in sorted({i.modality for i in trace.items.values()}):
        d = sum(-(-i.tokens // PAGE) for i in trace.items.values() if i.modality == m)
        distinct += d
        pages[m] = max(1, int(frac * d))
    return pages, sum(pages.values()) / distinct


def parity(trace: ChainTrace, costs: dict[str, float], names: list[str]) -> int:
    """(policy, capacity) pairs where the policy replay and the whole cache disagree."""
    short = ChainTrace(trace.name, trace.items, trace.requests[:PARITY_REQUESTS])
    bad = 0
    for frac in [f for f in FRACTIONS if f in TARGET_FRACTIONS]:
        pages, _ = pages_for(short, frac)
        for name in names:
            a = replay(short, name, pages, costs, PAGE)
            b = replay_policy(short, name, pages, costs, PAGE)
            bad += ((a.hit_tokens, a.hit_blocks, a.puts, a.evictions, a.uncached)
                    != (b.hit_tokens, b.hit_blocks, b.puts, b.evictions, b.uncached))
    return bad


def independent(trace: ChainTrace, records: list[dict], costs: dict[str, float]) -> dict:
    """Every policy through the independent block replay (``blockreplay``) and through this
    benchmark's replay at one 512-token page a block, at the target capacities in blocks, with
    the same keys: their hits per request, and the (policy, capacity) pairs that disagree."""
    uid_of: dict[int, int] = {}
    for rec, r in zip(records, trace.requests, strict=True):
        uid_of.update(zip(rec["hash_ids"], r.chain, strict=True))
    fig: dict = {}
    bad = 0
    keys = trace_keys(trace, bench_config(trace, {"text": 1}, BLOCK, "lru", costs))
    key_of = {h: keys[u] for h, u in uid_of.items()}
    for frac in TARGET_FRACTIONS:
        cap = capacity_for(records, frac)
        pages = {"text": cap}
        for name in POLICIES:
            a = block_replay(records, name, cap, BLOCK, key_of=key_of.__getitem__)
            b = replay_policy(trace, name, pages, costs, BLOCK, keys)
            tag = f"{trace.name}__cap{frac}__{name}"
            fig[f"independent_block_hit__{tag}"] = a.block_hit_ratio
            fig[f"independent_avoided_fraction__{tag}"] = a.avoided_fraction
            bad += (a.per_request, a.hit_tokens) != (b.hit_blocks_by_request, b.hit_tokens)
        lru = fig[f"independent_block_hit__{trace.name}__cap{frac}__lru"]
        for name in POLICIES:
            tag = f"{trace.name}__cap{frac}__{name}"
            fig[f"independent_block_hit_over_lru__{tag}"] = fig[f"independent_block_hit__{tag}"] / lru if lru else 0.0
    fig["independent_replay_mismatches"] = bad
    return fig


def op_costs(trace: ChainTrace, costs: dict[str, float], rounds: int) -> dict[str, float]:
    """Seconds per policy call, paired with LRU (the two in turn first), at 5% and 20%."""
    fig: dict[str, float] = {}
    ratio: dict[tuple[str, float], list[float]] = {}
    alone: dict[tuple[str, float], list[float]] = {}
    for frac in (0.05, 0.2):
        pages, _ = pages_for(trace, frac)
        keys = trace_keys(trace, bench_config(trace, pages, PAGE, "lru", costs))
        for name in POLICIES:
            for r in range(rounds):
                got = {}
                for p in (["lru", name] if r % 2 == 0 else [name, "lru"]):
                    res = replay_policy(trace, p, pages, costs, PAGE, keys)
                    got[p] = res.wall_s / max(res.ops, 1)
                ratio.setdefault((name, frac), []).append(got[name] / got["lru"])
                alone.setdefault((name, frac), []).append(got[name])
    for name in POLICIES:
        pairs = ratio[(name, 0.05)]
        fig[f"op_cost_over_lru__{name}"] = statistics.median(pairs)
        fig[f"op_cost_over_lru__{name}_n"] = rounds
        fig[f"op_cost_over_lru__{name}_best"] = min(pairs)
        fig[f"op_cost_over_lru__{name}_worst"] = max(pairs)
        fig[f"op_cost_over_lru_cap0.2__{name}"] = statistics.median(ratio[(name, 0.2)])
        for frac in (0.05, 0.2):
            fig[f"op_us__cap{frac}__{name}"] = 1e6 * statistics.median(alone[(name, frac)])
        # four times the groups: the policy's time per call over LRU's there, over the same at 5%
        fig[f"op_cost_growth__{name}"] = fig[f"op_cost_over_lru_cap0.2__{name}"] / fig[f"op_cost_over_lru__{name}"]
    fig["op_cost_growth_lru_alone"] = fig["op_us__cap0.2__lru"] / fig["op_us__cap0.05__lru"]
    return fig


def run(quick: bool = False, jsonl: list[str] | None = None, seed: int = 0, out: Path = RESULTS,
        mooncake: Path | None = MOONCAKE) -> dict:
    t_start = time.perf_counter()
    costs = load_costs()
    names = [*POLICIES, *REFERENCE]
    fig: dict = {"page_tokens": PAGE, "payload_bytes_per_token": 8, "device_only": True,
                 **{f"recompute_s_per_token__{m}": costs[m] for m in ("text", "vision", "audio")}}
    if mooncake is None or not mooncake.exists():
        fig["mooncake_skipped"] = f"not found: {mooncake}"
    rows = []
    all_traces = traces(quick, jsonl or [], seed, mooncake)
    for trace in all_traces:
        t = trace.name
        fig[f"requests__{t}"] = len(trace.requests)
        fig[f"distinct_groups__{t}"] = len(trace.items)
        fig[f"first_reference_fraction__{t}"] = trace.first_reference_fraction()
        fig[f"max_chain_groups__{t}"] = max(len(r.chain) for r in trace.requests)
        keys = None
        for frac in FRACTIONS:
            pages, eff = pages_for(trace, frac)
            keys = keys or trace_keys(trace, bench_config(trace, pages, PAGE, "lru", costs))
            tag = f"{t}__cap{frac}"
            fig[f"effective_fraction__{tag}"] = eff
            for name in names:
                r = replay_policy(trace, name, pages, costs, PAGE, keys)
                fig[f"hit__{tag}__{name}"] = r.hit_ratio
                fig[f"block_hit__{tag}__{name}"] = r.block_hit_ratio
                fig[f"avoided_s__{tag}__{name}"] = r.avoided_s
                fig[f"avoided_fraction__{tag}__{name}"] = r.avoided_fraction
                fig[f"overflow__{tag}__{name}"] = r.overflow
                fig[f"uncached__{tag}__{name}"] = r.uncached
                fig[f"wall_s__{tag}__{name}"] = r.wall_s
                rows.append((t, frac, name, r))
                print(f"{t:<11} {frac:>5} {eff:>6.3f} {name:<13} block hit {r.block_hit_ratio:.4f} "
                      f"avoided {r.avoided_fraction:.4f} uncached {r.uncached} "
                      f"wall {r.wall_s:.1f} s", flush=True)
            ratios(fig, tag, names)
    tnames = [t.name for t in all_traces]
    targets(fig, tnames)
    by_name = {t.name: t for t in all_traces}
    fig["cache_parity_mismatches"] = parity(by_name.get("sample", all_traces[0]), costs, names)
    bad = 0
    for name, path in ((HEAD, mooncake), (CONV, CONVERSATION)):
        if name in by_name:
            got = independent(by_name[name], read_records(path, len(by_name[name].requests)), costs)
            bad += got.pop("independent_replay_mismatches")
            fig.update(got)
    fig["independent_replay_mismatches"] = bad
    fig.update(op_costs(by_name.get("heavytail", all_traces[-1]), costs, 1 if quick else 5))
    fig["wall_s"] = time.perf_counter() - t_start
    report(fig, tnames)
    plot(fig, tnames, names, out)
    write_results("eviction", fig, out)
    return fig


def ratios(fig: dict, tag: str, names: list[str]) -> None:
    fig[f"best_policy__{tag}"] = max(POLICIES, key=lambda n: fig[f"block_hit__{tag}__{n}"])
    for score in ("hit", "block_hit", "avoided_s"):
        lru, bel = fig[f"{score}__{tag}__lru"], fig[f"{score}__{tag}__belady"]
        over = "avoided" if score == "avoided_s" else score
        for name in names:
            fig[f"{over}_over_lru__{tag}__{name}"] = fig[f"{score}__{tag}__{name}"] / lru if lru else 0.0
            fig[f"{over}_over_belady__{tag}__{name}"] = fig[f"{score}__{tag}__{name}"] / bel if bel else 0.0
        fig[f"lru_{over}_over_belady__{tag}"] = lru / bel if bel else 0.0


def targets(fig: dict, tnames: list[str]) -> None:
    """Worst ratios to LRU per policy on both scores, and which policy meets the targets: at
    least ``FLOOR`` of LRU on every trace at 5% and 10%, and ``LIFT`` where it is set (none
    meets them when a ``LIFT`` trace is missing)."""
    caps = [f for f in FRACTIONS if f in TARGET_FRACTIONS]
    lifts = [(t, f, need) for t, by in LIFT.items() for f, need in by.items()]
    meets = []
    for name in POLICIES:
        def over(t: str, f: float, score: str, name: str = name) -> float:
            return fig[f"{score}_over_lru__{t}__cap{f}__{name}"]

        for score in SCORES:
            fig[f"min_{score}_over_lru__{name}"] = min(over(t, f, score) for t in tnames for f in FRACTIONS)
        floor = min(over(t, f, s) for t in tnames for f in caps for s in SCORES)
        # the lift as the worst ratio of what it reached to what each cell asks
        lift = min((over(t, f, s) / need for t, f, need in lifts for s in SCORES if t in tnames),
                   default=0.0)
        fig[f"target_min_over_lru__{name}"] = floor
        fig[f"target_lift_over_asked__{name}"] = lift
        ok = floor >= FLOOR and lift >= 1.0 and all(t in tnames for t, _, _ in lifts) and name != "lru"
        fig[f"meets_targets__{name}"] = ok
        if ok:
            meets.append(name)
    fig["target_policy"] = max(meets, key=lambda n: fig[f"target_lift_over_asked__{n}"]) if meets else "none"
    fig["default_policy"] = CacheConfig.model_fields["eviction_policy"].default


def table(fig: dict, tnames: list[str], score: str = "block_hit") -> str:
    """One score (``block_hit``, ``avoided``, ``hit``), policy x trace x capacity (markdown),
    with the ratio to LRU."""
    key = "avoided_fraction" if score == "avoided" else score
    cols = [(t, f) for t in tnames for f in FRACTIONS]
    head = "| policy | " + " | ".join(f"{t} {int(100 * f)}%" for t, f in cols) + " |"
    lines = [head, "|" + " --- |" * (len(cols) + 1)]
    for name in [*POLICIES, *REFERENCE]:
        cells = [f"{fig[f'{key}__{t}__cap{f}__{name}']:.3f} ({fig[f'{score}_over_lru__{t}__cap{f}__{name}']:.2f}x)"
                 for t, f in cols]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(fig: dict, tnames: list[str]) -> None:
    keys = ["target_policy", "default_policy", "cache_parity_mismatches",
            *(k for k in ("independent_replay_mismatches",) if k in fig),
            *(f"target_min_over_lru__{n}" for n in POLICIES),
            *(f"target_lift_over_asked__{n}" for n in POLICIES),
            *(f"op_cost_over_lru__{n}" for n in POLICIES),
            *(f"op_cost_growth__{n}" for n in POLICIES),
            *(k for k in sorted(fig) if k.startswith("first_reference_fraction__")), "wall_s"]
    print_table("eviction figures", [(k, fig[k]) for k in keys])
    print("prefix-block hit ratio\n" + table(fig, tnames))
    print("recompute avoided\n" + table(fig, tnames, "avoided"))


def plot(fig: dict, tnames: list[str], names: list[str], out: Path = RESULTS) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f, axes = plt.subplots(2, len(tnames), figsize=(4.5 * len(tnames), 8), squeeze=False)
    xs = [100 * c for c in FRACTIONS]
    for j, t in enumerate(tnames):
        for name in names:
            style = "--" if name in REFERENCE else "-"
            axes[0][j].plot(xs, [fig[f"block_hit__{t}__cap{c}__{name}"] for c in FRACTIONS], style,
                            marker="o", label=name)
            axes[1][j].plot(xs, [fig[f"block_hit_over_lru__{t}__cap{c}__{name}"] for c in FRACTIONS],
                            style, marker="o", label=name)
        axes[0][j].set(title=t, xlabel="device tier (% of distinct bytes)", ylabel="prefix-block hit ratio")
        axes[1][j].set(xlabel="device tier (% of distinct bytes)", ylabel="block hits over LRU's")
        axes[1][j].axhline(FLOOR, color="grey", lw=0.8, ls=":")
    axes[0][0].legend(fontsize=7)
    f.suptitle("mmtier eviction policies on prefix traces: hits, and over LRU")
    f.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    f.savefig(out / "eviction.png", dpi=90)
    plt.close(f)


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short traces: seconds, a check that it runs")
    ap.add_argument("--jsonl", action="append", default=[], help="a prefix-hash trace to add")
    ap.add_argument("--mooncake", type=Path, default=MOONCAKE, help="Mooncake's trace (skipped when absent)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-sample", action="store_true",
                    help=f"regenerate {SAMPLE.name} from the generator and exit")
    add_out_arg(ap)
    a = ap.parse_args(argv)
    if a.write_sample:
        write_jsonl(generate(sample_config()), SAMPLE)
        return None
    return run(a.quick, a.jsonl, a.seed, a.out, a.mooncake)


if __name__ == "__main__":
    main()
