"""The demo's report: a table on stdout, a flat JSON file and a PNG chart (``mmtier.demo.chat``
makes the ``DemoReport``)."""

from __future__ import annotations

import json
from pathlib import Path

from .chat import GROUPS, MEDIA_NAMES, DemoReport


def format_report(r: DemoReport, json_path: Path | None = None, png_path: Path | None = None) -> str:
    f = r.figures
    mib = lambda b: f"{b / 2**20:.2f}"
    lines = [
        f"mmtier demo: {f['tenants']} tenants, {f['conversations']} conversations, {f['turns']} turns "
        f"({f['new_tokens']} tokens per answer); local Ray on 127.0.0.1: {f['ray_nodes']} node, "
        f"{f['pools']} pool ({mib(f['device_bytes_per_pool'])} MiB), {f['stores']} node store",
        f"model: {f['model']}",
        "",
        "media by modality (hits: attached from the cache, no encoder run; a video's hits and encoder",
        "outputs reused count its segments; encoder runs with the cache vs the dense path, which",
        "encodes every item of the conversation again each turn)",
        f"{'modality':<9}{'placed':>7}{'hits':>6}{'encoder':>9}{'dense enc':>10}",
    ]
    for name in MEDIA_NAMES.values():
        lines.append(f"{name:<9}{f[f'{name}_placements']:>7}{f[f'{name}_hits']:>6}{f[f'{name}_encoder_runs']:>9}"
                     f"{f[f'{name}_encoder_runs_dense']:>10}")
    lines.append(f"         encoder outputs reused at a new place: images (vision_embed hits) "
                 f"{f['image_embedding_hits']}, video segments (video_embed hits) {f['video_embedding_hits']}")
    lines.append(f"text     spans attached {f['span_hits']}, prefilled {f['span_misses']}; prompt tokens "
                 f"attached {f['prompt_tokens_cached']}, prefilled {f['prompt_tokens_prefilled']}; "
                 f"transcript tokens {f['transcript_tokens']}")
    lines += [
        "",
        "bytes per tier at the end (MiB)",
        f"{'tier':<20}" + "".join(f"{g:>8}" for g in GROUPS) + f"{'total':>8}{'capacity':>10}",
    ]
    for tier, label in (("device", "device (pool)"), ("disk", "disk (pool's)"), ("host", "host (node store)")):
        cap = f"{mib(f[f'{tier}_capacity_bytes']):>10}" if f"{tier}_capacity_bytes" in f else ""
        lines.append(f"{label:<20}" + "".join(f"{mib(f[f'{tier}_bytes_{g}']):>8}" for g in GROUPS)
                     + f"{mib(f[f'{tier}_bytes']):>8}{cap}")
    lines += [
        f"spills (pool -> node store): {f['spilled_groups_freed']} groups moved off the device "
        f"({mib(f['spill_bytes'])} MiB; {f['spills']} new to the store); "
        f"restores (node store -> pool): {f['restores']}; pool device -> its disk: "
        f"{f['demotions_to_disk']}, disk -> device: {f['disk_restores']}; evictions (dropped, recomputed on next use): {f['evictions']}",
        "",
        "time per turn (s)          mean  median  first turns  later turns (median)",
        f"with cache             {f['turn_s_cache_mean']:>8.3f}{f['turn_s_cache_median']:>8.3f}"
        f"{f['turn_s_cache_first_turns']:>13.3f}{f.get('turn_s_cache_later_turns', float('nan')):>13.3f}",
        f"without cache (dense)  {f['turn_s_nocache_mean']:>8.3f}{f['turn_s_nocache_median']:>8.3f}"
        f"{f['turn_s_nocache_first_turns']:>13.3f}{f.get('turn_s_nocache_later_turns', float('nan')):>13.3f}",
        f"encoder runs {f['encoder_runs_cache']} with cache vs {f['encoder_runs_nocache']} without; "
        f"turn boundaries (lookup, fetches, publish): median {f['turn_boundary_s_median'] * 1e3:.1f} ms a turn",
        f"later turns, median time with the cache over without: {f.get('later_turns_cached_over_dense', float('nan')):.2f} "
        "(the model and its pool in one process: no Ray call per layer or step)",
        "",
        f"correctness: {f['dense_check_turns'] - f['dense_check_mismatches']}/{f['dense_check_turns']} turns' "
        f"tokens equal the dense path (DynamicCache + sdpa): {'PASSED' if r.passed else 'FAILED'}",
    ]
    lines += [f"  {m}" for m in r.mismatches[:5]]
    lines.append(f"Ray + mmtier start {f['ray_start_s']:.1f} s; whole run {f['elapsed_s']:.1f} s")
    if json_path is not None:
        lines.append(f"report: {json_path}" + (f", chart: {png_path}" if png_path else ""))
    return "\n".join(lines)


def write_json(r: DemoReport, path: Path) -> Path:
    """The flat figures (the benchmark suite's convention: scalars only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r.figures, indent=2, sort_keys=True) + "\n")
    return path


def plot(r: DemoReport, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = r.figures
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.4))
    xs = range(1, len(r.turn_cache_s) + 1)
    a1.plot(xs, r.turn_cache_s, "o-", ms=3, label="with cache (the engine's own pool)")
    a1.plot(xs, r.turn_nocache_s, "s-", ms=3, color="C3", label="without cache (DynamicCache, recompute)")
    later = [x for x, i in zip(xs, r.turn_index) if i > 0]
    a1.scatter(later, [s for s, i in zip(r.turn_cache_s, r.turn_index) if i > 0], s=30, facecolors="none",
               edgecolors="k", label="later turns")
    ratio = f.get("later_turns_cached_over_dense")
    a1.set(xlabel="turn (conversations in start order, their turns in order)", ylabel="seconds",
           title="time per turn" + (f" (later turns, median cache / dense: {ratio:.2f})" if ratio is not None else ""))
    a1.legend(fontsize=8)

    names = list(MEDIA_NAMES.values())
    bars = {"placed": "placements", "hit (K/V attached)": "hits",
            "encoder output reused": "embedding_hits", "encoder (cache)": "encoder_runs",
            "encoder (dense)": "encoder_runs_dense"}
    width = 0.8 / len(bars)
    for i, (label, key) in enumerate(bars.items()):
        a2.bar([j + i * width for j in range(len(names))], [f.get(f"{n}_{key}", 0) for n in names], width,
               label=label)
    a2.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    a2.set(title="media: hits and encoder runs (video: segments)", ylabel="items")
    a2.legend(fontsize=8)

    tiers = ("device", "disk", "host")
    bottom = [0.0] * len(tiers)
    for group in GROUPS:
        vals = [f[f"{t}_bytes_{group}"] / 2**20 for t in tiers]
        a3.bar(["device (pool)", "disk (pool's)", "host (node store)"], vals, bottom=bottom, label=group)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a3.set(title=f"bytes per tier (spills {f['spills']}, restores {f['restores']}, evictions {f['evictions']})",
           ylabel="MiB")
    a3.legend(fontsize=8)
    fig.suptitle(f"mmtier demo (Qwen2-VL + Whisper, random weights): {f['turns']} turns, {f['tenants']} tenants; "
                 f"dense check {'passed' if r.passed else 'FAILED'} ({f['machine']})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
