"""The multi-turn benchmark's figures and plot, from its per-turn records (``multiturn.py``)."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from pathlib import Path

from .._common import machine, ratio_figures

ARMS = ("cache", "dense")
GROUPS = {"vision": ("vision", "vision_embed", "video", "video_embed"),
          "audio": ("audio", "transcript", "transcript_ids"), "text": ("text",)}   # the chat model's pools
TURN_BUCKETS = 4                    # per-turn-index figures for turns 0..3, then "4+"


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _bucket(index: int) -> str:
    return f"turn{index}" if index < TURN_BUCKETS else f"turn{TURN_BUCKETS}+"


def ttft_figures(records: list, sums: list[dict[str, float]]) -> dict:
    """Speedup against dense (median of the rounds' summed TTFT ratios) and TTFT percentiles,
    over all turns and per turn index; a turn's TTFT per arm is its median over the rounds."""
    fig: dict[str, object] = {}
    fig.update(ratio_figures("ttft_speedup_vs_dense", [s["dense"] for s in sums],
                             [s["cache"] for s in sums], higher_is_better=True))
    fig["ttft_speedup_vs_dense_median_turn"] = statistics.median(
        r.ttft["dense"] / r.ttft["cache"] for r in records)
    for name, keep in (("first_turn", lambda r: r.turn.index == 0),
                       ("later_turns", lambda r: r.turn.index > 0)):
        sel = [r for r in records if keep(r)]
        fig[f"ttft_speedup_vs_dense_{name}"] = _ratio(sum(r.ttft["dense"] for r in sel),
                                                      sum(r.ttft["cache"] for r in sel)) if sel else None
        fig[f"turns_{name.split('_')[0]}"] = len(sel)
    for arm in ARMS:
        vals = [r.ttft[arm] for r in records]
        fig[f"ttft_{arm}_mean_s"] = statistics.fmean(vals)
        fig[f"ttft_{arm}_p50_s"] = percentile(vals, 0.5)
        fig[f"ttft_{arm}_p95_s"] = percentile(vals, 0.95)
    by_bucket: dict[str, list] = defaultdict(list)
    for r in records:
        by_bucket[_bucket(r.turn.index)].append(r)
    for bucket, recs in sorted(by_bucket.items()):
        fig[f"turns__{bucket}"] = len(recs)
        for arm in ARMS:
            vals = [r.ttft[arm] for r in recs]
            fig[f"ttft_{arm}_p50_s__{bucket}"] = percentile(vals, 0.5)
            fig[f"ttft_{arm}_p95_s__{bucket}"] = percentile(vals, 0.95)
    return fig


def figures(records: list, sums: list[dict[str, float]], facts: dict, new_tokens: int) -> dict:
    fig = ttft_figures(records, sums)
    n = len(records)
    fig["turn_cache_s"] = sum(r.turn_s for r in records) / n

    stored, referenced = facts["stored"], facts["referenced"]
    all_with = sum(stored.values())
    all_without = sum(referenced.values())
    fig["memory_with_sharing_bytes"] = all_with
    fig["memory_without_sharing_bytes"] = all_without
    fig["memory_sharing_over_without"] = _ratio(all_with, all_without)
    for group, mods in GROUPS.items():
        w = sum(stored.get(m, 0) for m in mods)
        wo = sum(referenced.get(m, 0) for m in mods)
        fig[f"memory_with_sharing_bytes_{group}"] = w
        fig[f"memory_without_sharing_bytes_{group}"] = wo
        fig[f"memory_sharing_over_without_{group}"] = _ratio(w, wo)
    fig["memory_embeddings_bytes"] = sum(stored.get(m, 0) for m in ("vision_embed", "audio_embed"))
    fig["cache_evictions"] = facts["evictions"]

    by_mod = facts["by_modality"]
    for group, mods in GROUPS.items():
        if group == "text":
            continue
        hits = misses = 0
        for m in mods:
            c = by_mod.get(m, {})
            h, mi = c.get("hits", 0), c.get("misses", 0)
            fig[f"hit_ratio_{m if m != group else group + '_kv'}"] = _ratio(h, h + mi)
            hits, misses = hits + h, misses + mi
        fig[f"hit_ratio_{group}"] = _ratio(hits, hits + misses)
    fig["hit_ratio_text"] = 1 - sum(r.prefilled for r in records) / sum(r.context_tokens for r in records)

    placements: Counter = Counter()
    for r in records:
        placements.update(r.turn.media)
    runs = Counter(facts["encoder_runs"])
    runs["vision"] += runs.pop("video", 0)            # a video segment's tower run is a vision run
    total_runs = sum(runs.values())
    fig["media_placements"] = sum(placements.values())
    fig["encoder_runs_cache"] = total_runs
    fig["encoder_runs_avoided_fraction"] = _ratio(fig["media_placements"] - total_runs,
                                                  fig["media_placements"])
    for m in ("vision", "audio"):
        fig[f"encoder_runs_avoided_fraction_{m}"] = _ratio(placements[m] - runs.get(m, 0), placements[m])
    prefill_cache = sum(r.prefilled for r in records)
    prefill_dense = sum(r.context_tokens for r in records)
    fig["prefill_positions_cache"] = prefill_cache
    fig["prefill_positions_dense"] = prefill_dense
    fig["prefill_positions_dense_over_cache"] = _ratio(prefill_dense, prefill_cache)

    fig["conversations"] = len({r.turn.conv for r in records})
    fig["turns"] = n
    fig["tenants"] = len({r.turn.tenant for r in records})
    fig["new_tokens_per_turn"] = new_tokens
    fig["context_tokens_mean"] = sum(r.context_tokens for r in records) / n
    fig["context_tokens_max"] = max(r.context_tokens for r in records)
    fig["baseline"] = ("dense = the full conversation so far recomputed without a cache "
                       "(dense_turn: every encoder, transformers' DynamicCache + sdpa); "
                       "both arms warmed up untimed first")
    return fig


def plot(records: list, fig: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"cache": ("C0", "with the cache"), "dense": ("C3", "dense recompute (no cache)")}
    f, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.4))
    xs = [r.turn.req for r in records]
    for arm, (color, label) in styles.items():
        a1.plot(xs, [r.ttft[arm] * 1e3 for r in records], "o", ms=3, color=color, label=label, alpha=0.8)
    a1.set(xlabel="request (arrival order)", ylabel="TTFT (ms, median of rounds)", yscale="log",
           title="TTFT per turn")
    a1.legend(fontsize=8)
    by_bucket: dict[str, list] = defaultdict(list)
    for r in records:
        by_bucket[_bucket(r.turn.index)].append(r)
    buckets = sorted(by_bucket)
    for arm, (color, label) in styles.items():
        for q, style in ((0.5, "-o"), (0.95, ":^")):
            a2.plot(buckets, [1e3 * percentile([r.ttft[arm] for r in by_bucket[b]], q) for b in buckets],
                    style, color=color, label=f"{label}, p{round(q * 100)}")
    for b in buckets:
        a2.annotate(f"n={len(by_bucket[b])}", (b, 1e3 * percentile([r.ttft["cache"] for r in by_bucket[b]], 0.5)),
                    textcoords="offset points", xytext=(0, -12), fontsize=7, ha="center")
    a2.set(xlabel="turn within the conversation", ylabel="TTFT (ms)", yscale="log",
           title="TTFT p50 / p95 by turn index")
    a2.legend(fontsize=7)
    f.suptitle(f"mmtier multi-turn: {fig['turns']} turns, {fig['conversations']} conversations, "
               f"tiny Qwen2-VL + Whisper on CPU; speedup {fig['ttft_speedup_vs_dense']:.2f}x vs dense recompute "
               f"(median of {fig['ttft_speedup_vs_dense_n']} rounds; {machine()})", fontsize=9)
    f.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    f.savefig(path, dpi=110)
    plt.close(f)
