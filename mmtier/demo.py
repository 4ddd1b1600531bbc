"""``mmtier demo``: a multi-turn multimodal workload through mmtier on an embedded local Ray.

What it does, in order:

1. starts a local Ray bound to 127.0.0.1 and mmtier on it (``mmtier.actors.start``: the
   ContentRegistry and a node store), and an engine actor (``mmtier.models.engine``) that runs
   the model and holds its own pool (``PoolHost``): attention reads local pages, the cluster
   is asked only at turn boundaries;
2. runs a seeded workload through the reference model (``mmtier.models``: real attention
   through the cache): several tenants, each with a few conversations of several turns; turns
   carry text, images (a small per-tenant catalogue plus images every tenant sends, so repeats
   are frequent) and audio clips; a few conversations are open at once;
3. keeps the pool under pressure so content moves between tiers: the pool is small, so it
   evicts; and when a modality's device pages pass a watermark, the cross-attention K/V of
   finished conversations (content-only groups, the ones other conversations reuse) is spilled
   to the node store (``HostedCache.offload``: the node's host tier, outside the engine's
   process). A later request for spilled content finds it there through the turn's registry
   lookup and pulls it back whole into the engine's pool;
4. checks correctness: every turn's tokens must equal the dense model's (``chat_dense``: no
   cache, attention over concatenated K/V), and times the same turns without the cache (the
   conversation so far recomputed densely, as a server with no KV reuse must), in the same
   run; ``later_turns_cached_over_dense`` is the median later turn with the cache over the
   median without;
5. prints a table, and writes a flat JSON report and a PNG chart.

The pool-side spill is driven here because the Ray layer's pools keep no lower tier of their
own (pressure inside a pool evicts; the node store is filled by ``offload``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .telemetry import machine

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # Ray binds 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MEDIA_NAMES = {"vision": "image", "audio": "audio"}
PROMPTS = ("Describe this. ", "What changed? ", "Summarise it. ", "Any text in it? ",
           "Compare with before. ", "What is the mood? ", "Count the objects. ", "Transcribe. ")


@dataclass(frozen=True)
class DemoSpec:
    """The workload. ``quick()`` is a smaller one with the same checks."""

    tenants: int = 3
    conversations: int = 3            # per tenant
    turns: int = 3                    # per conversation
    active: int = 2                   # conversations open at once
    new_tokens: int = 6               # greedy tokens per answer
    images_per_tenant: int = 2        # private images of a tenant
    shared_images: int = 2            # images every tenant sends (tenant-salted: never shared across)
    clips_per_tenant: int = 2
    device_bytes: int = 5 << 20       # the pool's page arena: small, so content moves
    spill_watermark: float = 0.5      # of a cross-attention modality's device pages
    copy_after_remote_uses: int = 1   # a spilled group's next use restores it to the pool
    seed: int = 0

    @classmethod
    def quick(cls, **kw) -> DemoSpec:
        return cls(**{"tenants": 2, "conversations": 2, "turns": 2, "new_tokens": 4,
                      "images_per_tenant": 1, "device_bytes": 3 << 20, **kw})

    @property
    def shares(self) -> dict[str, float]:
        """Arena shares: text large enough for the open conversations' private K/V."""
        return {"text": 0.22, "vision": 0.30, "audio": 0.16, "vision_xattn": 0.12,
                "audio_xattn": 0.06, "vision_embed": 0.08, "audio_embed": 0.06}


@dataclass
class Conversation:
    tenant: str
    turns: list[list]                  # prompt items per turn
    answers: list[list[int]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    dense_answers: list[list[int]] = field(default_factory=list)   # the dense model's, all turns so far
    dense_seconds: list[float] = field(default_factory=list)       # each turn recomputed without a cache


def workload(spec: DemoSpec) -> list[Conversation]:
    """Seeded conversations, in the order they start."""
    from .models import Audio, Image, Text

    rng = random.Random(spec.seed)

    def blob(tag: str, n: int) -> bytes:
        r = random.Random(f"{spec.seed}:{tag}")
        return bytes(r.getrandbits(8) for _ in range(n))

    shared = [blob(f"shared-image-{i}", 3072) for i in range(spec.shared_images)]
    convs = []
    for _ in range(spec.conversations):
        for t in range(spec.tenants):
            tenant = f"tenant-{t}"
            images = [blob(f"{tenant}-image-{i}", 3072) for i in range(spec.images_per_tenant)] + shared
            clips = [blob(f"{tenant}-clip-{i}", 1600 + 800 * i) for i in range(spec.clips_per_tenant)]
            system = Text(f"You are {tenant}'s assistant. ")
            turns = []
            for i in range(spec.turns):
                # a conversation opens with the tenant's system prompt and an image: the same
                # prefix, so a popular opening image's decoder K/V is reused (prefix-dependent)
                items = [system, Text("Look at this. ")] if i == 0 else [Text(rng.choice(PROMPTS))]
                if i == 0 or rng.random() < 0.75:        # images repeat (low indices are popular)
                    items.append(Image(images[min(int(rng.expovariate(0.9)), len(images) - 1)]))
                if rng.random() < 0.4:
                    items += [Text("Listen: "), Audio(rng.choice(clips))]
                turns.append(items)
            convs.append(Conversation(tenant, turns))
    return convs


@dataclass
class DemoReport:
    spec: DemoSpec
    figures: dict
    turn_cache_s: list[float]
    turn_nocache_s: list[float]
    turn_index: list[int]
    mismatches: list[str]

    @property
    def passed(self) -> bool:
        return not self.mismatches


def run_demo(spec: DemoSpec, progress: bool = True) -> DemoReport:
    """Start a local Ray and mmtier, run the workload, check it, shut everything down."""
    import ray
    import torch

    from . import actors
    from .actors.pool_host import host_name
    from .models import ReferenceModel
    from .models.engine import ReferenceEngine

    torch.set_num_threads(1)
    convs = workload(spec)
    model = ReferenceModel(seed=spec.seed)
    cfg = model.cache_config(device_bytes=spec.device_bytes, shares=spec.shares)
    settings = actors.ClusterSettings(namespace="mmtier-demo", copy_after_remote_uses=spec.copy_after_remote_uses,
                                      store_bytes=64 << 20, sweep_interval_s=5.0)
    t_all = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 << 20,
             _node_ip_address="127.0.0.1", namespace=settings.namespace, log_to_driver=False,
             configure_logging=False)
    try:
        started = actors.start(cfg, settings)
        node = ray.get_runtime_context().get_node_id()
        engine = ray.remote(ReferenceEngine).options(
            name=host_name(node), namespace=settings.namespace, num_cpus=0, max_concurrency=4,
        ).remote(settings.model_dump(mode="json"), spec.seed)
        ray.get(engine.ping.remote(), timeout=settings.start_timeout_s)
        ray_start_s = time.perf_counter() - t_all
        moved, counters = _run_cached(spec, convs, engine, model, progress)
        with actors.connect(settings) as cc:
            stats = cc.stats()
            client = dict(cc.counters)
            per_actor = cc.actor_stats()
        mismatches, nocache_s, work = _dense(spec, convs, model)
    finally:
        actors.shutdown(settings)
        ray.shutdown()
    elapsed = time.perf_counter() - t_all
    figures = _figures(spec, convs, counters, stats, client, moved, work, nocache_s, mismatches, started,
                       per_actor, ray_start_s, elapsed)
    return DemoReport(spec, figures, [s for c in convs for s in c.seconds], nocache_s,
                      [i for c in convs for i in range(len(c.seconds))], mismatches)


def _run_cached(spec: DemoSpec, convs: list[Conversation], engine, model, progress: bool
                ) -> tuple[Counter, dict]:
    """Every turn through the engine (the model and its pool in one actor), ``active``
    conversations interleaved turn by turn; right after each, the same turn without a cache
    (the conversation so far recomputed densely, here), so both see the same machine state.
    Returns what moved and the model's counters."""
    import ray
    from tqdm import tqdm

    moved: Counter = Counter()
    counters: dict[str, Counter] = {}
    pending = list(convs)
    open_: list[tuple[Conversation, int, list]] = []          # conversation, session, its cross keys
    finished: list[list] = []                       # cross keys of closed conversations, oldest first
    bar = tqdm(total=sum(len(c.turns) for c in convs), desc="turns (with cache, then dense)", unit="turn",
               disable=not progress, leave=False)
    while pending or open_:
        while pending and len(open_) < spec.active:
            c = pending.pop(0)
            open_.append((c, ray.get(engine.open.remote(c.tenant), timeout=60), []))
        for entry in list(open_):
            c, sid, xkeys = entry
            r = ray.get(engine.turn.remote(sid, c.turns[len(c.answers)], spec.new_tokens), timeout=300)
            c.answers.append(r["tokens"])
            c.seconds.append(r["seconds"])                   # the turn's time inside the engine
            t0 = time.perf_counter()
            c.dense_answers = model.chat_dense(c.turns[:len(c.answers)], spec.new_tokens)
            c.dense_seconds.append(time.perf_counter() - t0)
            xkeys[:] = r["xkeys"]
            for name, per in r["counters"].items():
                counters.setdefault(name, Counter()).update(per if isinstance(per, dict) else {"": per})
            bar.update(1)
            if len(c.answers) == len(c.turns):
                finished.append(list({w["digest"]: w for w in xkeys}.values()))
                ray.get(engine.close_session.remote(sid), timeout=60)
                open_.remove(entry)
                in_use = {w["digest"] for _, _, o in open_ for w in o}
                _spill(spec, engine, finished, in_use, moved)
    bar.close()
    return moved, counters


def _spill(spec: DemoSpec, engine, finished: list[list], in_use: set, moved: Counter) -> None:
    """Spill the oldest finished conversations' cross-attention K/V to the node store while a
    cross-attention modality's device pages are above the watermark (the engine's pool)."""
    import ray

    def over() -> set[str]:
        dev = ray.get(engine.stats.remote(), timeout=60)["tiers"].get("device", {})
        return {m for m, u in dev.items() if m.endswith("_xattn") and u["capacity_bytes"]
                and u["bytes"] > spec.spill_watermark * u["capacity_bytes"]}

    hot = over()
    while hot and finished:
        wires = [w for w in finished.pop(0) if w["modality"] in hot and w["digest"] not in in_use]
        if wires:
            n, nbytes = ray.get(engine.spill.remote(wires), timeout=120)
            moved["spills"] += n
            moved["spill_bytes"] += nbytes
        hot = over()


def _dense(spec: DemoSpec, convs: list[Conversation], model):
    """The check (every turn's tokens against the dense model's), the per-turn times without
    the cache measured beside the cached turns, and the work a cache-less server does
    (decoder positions, encoder runs)."""
    from .models import Media, Text

    mismatches: list[str] = []
    seconds = [s for c in convs for s in c.dense_seconds]
    work: Counter = Counter()
    for n, c in enumerate(convs):
        answers = c.dense_answers
        for i in range(len(c.turns)):
            for j, items in enumerate(c.turns[: i + 1]):
                work["encoder_runs"] += sum(isinstance(x, Media) for x in items)
                work["decoder_tokens"] += sum(len(x.ids) if isinstance(x, Text)
                                              else model.encoders[x.modality].tokens_for(x.data) for x in items)
                work["decoder_tokens"] += max(spec.new_tokens - 1, 0) + (1 if j and spec.new_tokens else 0)
        if len(answers) != len(c.answers):
            mismatches.append(f"conversation {n} ({c.tenant}): {len(c.answers)} turns, {len(answers)} dense")
        for i, (got, want) in enumerate(zip(c.answers, answers)):
            if got != want:
                mismatches.append(f"conversation {n} ({c.tenant}) turn {i}: cache {got} != dense {want}")
    return mismatches, seconds, work


def _figures(spec, convs, model_counters, stats, client, moved, work, nocache_s, mismatches, started,
             per_actor, ray_start_s, elapsed) -> dict:
    counters = {name: dict(per) for name, per in model_counters.items()}
    counters["decoder_tokens"] = model_counters.get("decoder_tokens", {}).get("", 0)
    for name in ("encoder_runs", "embedding_hits", "cross_hits", "cross_misses", "self_hits", "self_misses"):
        counters.setdefault(name, {})
    cache_s = [s for c in convs for s in c.seconds]
    first = [c.seconds[0] for c in convs]
    later = [s for c in convs for s in c.seconds[1:]]
    first_nc, later_nc, k = [], [], 0
    for c in convs:
        first_nc.append(nocache_s[k])
        later_nc += nocache_s[k + 1: k + len(c.turns)]
        k += len(c.turns)
    fig: dict[str, object] = {
        "tenants": spec.tenants, "conversations": len(convs), "turns": len(cache_s),
        "new_tokens": spec.new_tokens, "device_bytes_per_pool": spec.device_bytes,
        "ray_nodes": len(started.nodes),
        "pools": sum(n.startswith("mmtier-pool:") for n in per_actor),
        "stores": sum(n.startswith("mmtier-store:") for n in per_actor),
    }
    for m, name in MEDIA_NAMES.items():
        fig[f"{name}_placements"] = sum(isinstance(x, _media_type()) and x.modality == m
                                        for c in convs for t in c.turns for x in t)
        for ctr in ("encoder_runs", "embedding_hits", "cross_hits", "cross_misses", "self_hits", "self_misses"):
            fig[f"{name}_{ctr}"] = counters[ctr].get(m, 0)
    fig["text_tokens_appended"] = stats.counters.get("appended_tokens", 0)
    for tier in ("device", "host"):
        per = stats.tiers.get(tier, {})
        fig[f"{tier}_bytes"] = sum(u.bytes for u in per.values())
        fig[f"{tier}_capacity_bytes"] = sum(u.capacity_bytes for u in per.values()) if tier == "device" \
            else max((u.capacity_bytes for u in per.values()), default=0)
        for group in ("text", "image", "audio"):
            mods = _group_modalities(group)
            fig[f"{tier}_bytes_{group}"] = sum(u.bytes for mm, u in per.items() if mm in mods)
    store = Counter()
    for name, st in per_actor.items():
        if name.startswith("mmtier-store:"):
            store.update(st.get("counters", {}))
    fig["spills"] = store["puts"]                      # groups the node store took from the pool
    fig["spill_bytes"] = moved["spill_bytes"]
    fig["spilled_groups_freed"] = moved["spills"]      # ... whose device pages were freed at once
    fig["restores"] = store["exports"]                 # groups copied back from the store to a pool
    fig["store_attentions"] = store["attentions"]      # partial attentions served in place by the store
    fig["store_evictions"] = store["evictions"]
    fig["client_copies"] = client.get("copies", 0)
    fig["evictions"] = stats.counters.get("evictions", 0)
    fig["turn_s_cache_mean"] = statistics.mean(cache_s)
    fig["turn_s_cache_median"] = statistics.median(cache_s)
    fig["turn_s_nocache_mean"] = statistics.mean(nocache_s)
    fig["turn_s_nocache_median"] = statistics.median(nocache_s)
    fig["turn_s_cache_first_turns"] = statistics.mean(first)
    fig["turn_s_nocache_first_turns"] = statistics.mean(first_nc)
    if later:
        fig["turn_s_cache_later_turns"] = statistics.mean(later)
        fig["turn_s_nocache_later_turns"] = statistics.mean(later_nc)
        # the headline: later turns' median time with the cache over without it (same run)
        fig["later_turns_cached_over_dense"] = statistics.median(later) / statistics.median(later_nc)
    fig["nocache_over_cache_time"] = statistics.mean(nocache_s) / statistics.mean(cache_s)
    fig["decoder_tokens_cache"] = counters["decoder_tokens"]
    fig["decoder_tokens_nocache"] = work["decoder_tokens"]
    fig["encoder_runs_cache"] = sum(counters["encoder_runs"].values())
    fig["encoder_runs_nocache"] = work["encoder_runs"]
    fig["dense_check_turns"] = len(cache_s)
    fig["dense_check_mismatches"] = len(mismatches)
    fig["dense_check_passed"] = not mismatches
    fig["ray_start_s"] = ray_start_s
    fig["elapsed_s"] = elapsed
    fig["baseline"] = ("without cache = the conversation so far recomputed by the dense model "
                       "(generate_dense/chat_dense: every encoder, every position) per turn")
    fig["machine"] = machine()
    fig["date"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return fig


def _media_type():
    from .models import Media

    return Media


def _group_modalities(group: str) -> set[str]:
    if group == "text":
        return {"text"}
    m = {"image": "vision", "audio": "audio"}[group]
    return {m, f"{m}_xattn", f"{m}_embed"}


# ---------------------------------------------------------------------- output
def format_report(r: DemoReport, json_path: Path | None = None, png_path: Path | None = None) -> str:
    f = r.figures
    mib = lambda b: f"{b / 2**20:.2f}"
    lines = [
        f"mmtier demo: {f['tenants']} tenants, {f['conversations']} conversations, {f['turns']} turns "
        f"({f['new_tokens']} tokens per answer); local Ray on 127.0.0.1: {f['ray_nodes']} node, "
        f"{f['pools']} pool ({mib(f['device_bytes_per_pool'])} MiB), {f['stores']} node store",
        "",
        "hits and misses by modality (per media placement; cross = cross-attention K/V, content-only;",
        "self = decoder K/V, reused under the same prefix only; embed = encoder outputs)",
        f"{'modality':<9}{'placed':>7}{'encoder':>9}{'embed hit':>10}{'cross hit':>10}{'cross miss':>11}"
        f"{'self hit':>9}{'self miss':>10}",
    ]
    for name in MEDIA_NAMES.values():
        lines.append(f"{name:<9}{f[f'{name}_placements']:>7}{f[f'{name}_encoder_runs']:>9}"
                     f"{f[f'{name}_embedding_hits']:>10}{f[f'{name}_cross_hits']:>10}"
                     f"{f[f'{name}_cross_misses']:>11}{f[f'{name}_self_hits']:>9}{f[f'{name}_self_misses']:>10}")
    lines.append(f"{'text':<9}{f['text_tokens_appended']:>7} tokens appended (private to each conversation)")
    lines += [
        "",
        "bytes per tier at the end (MiB)",
        f"{'tier':<20}{'text':>8}{'image':>8}{'audio':>8}{'total':>8}{'capacity':>10}",
    ]
    for tier, label in (("device", "device (pool)"), ("host", "host (node store)")):
        lines.append(f"{label:<20}{mib(f[f'{tier}_bytes_text']):>8}{mib(f[f'{tier}_bytes_image']):>8}"
                     f"{mib(f[f'{tier}_bytes_audio']):>8}{mib(f[f'{tier}_bytes']):>8}"
                     f"{mib(f[f'{tier}_capacity_bytes']):>10}")
    lines += [
        f"spills (pool -> node store): {f['spilled_groups_freed']} groups moved off the device "
        f"({mib(f['spill_bytes'])} MiB; {f['spills']} new to the store); "
        f"restores (node store -> pool): {f['restores']}; partial attentions served by the store: "
        f"{f['store_attentions']}; evictions (dropped, recomputed on next use): {f['evictions']}",
        "",
        "time per turn (s)          mean  median  first turns  later turns",
        f"with cache             {f['turn_s_cache_mean']:>8.3f}{f['turn_s_cache_median']:>8.3f}"
        f"{f['turn_s_cache_first_turns']:>13.3f}{f.get('turn_s_cache_later_turns', float('nan')):>13.3f}",
        f"without cache (dense)  {f['turn_s_nocache_mean']:>8.3f}{f['turn_s_nocache_median']:>8.3f}"
        f"{f['turn_s_nocache_first_turns']:>13.3f}{f.get('turn_s_nocache_later_turns', float('nan')):>13.3f}",
        f"work: decoder positions {f['decoder_tokens_cache']} with cache vs {f['decoder_tokens_nocache']} "
        f"without; encoder runs {f['encoder_runs_cache']} vs {f['encoder_runs_nocache']}",
        f"later turns, median time with the cache over without: {f.get('later_turns_cached_over_dense', float('nan')):.2f} "
        "(the model and its pool in one process: no Ray call per layer or step)",
        "",
        f"correctness: {f['dense_check_turns'] - f['dense_check_mismatches']}/{f['dense_check_turns']} turns' "
        f"tokens equal generate_dense: {'PASSED' if r.passed else 'FAILED'}",
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
    a1.plot(xs, r.turn_nocache_s, "s-", ms=3, color="C3", label="without cache (dense recompute)")
    ratio = f.get("later_turns_cached_over_dense")
    a1.set(xlabel="turn (conversations in start order, their turns in order)", ylabel="seconds",
           title="time per turn" + (f" (later turns, cache / dense: {ratio:.2f})" if ratio is not None else ""))
    a1.legend(fontsize=8)

    names = list(MEDIA_NAMES.values())
    bars = {"cross hit": "cross_hits", "cross miss": "cross_misses", "self hit": "self_hits",
            "self miss": "self_misses", "encoder run": "encoder_runs"}
    width = 0.8 / len(bars)
    for i, (label, key) in enumerate(bars.items()):
        a2.bar([j + i * width for j in range(len(names))], [f[f"{n}_{key}"] for n in names], width, label=label)
    a2.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    a2.set(title="hits and misses by modality", ylabel="groups")
    a2.legend(fontsize=8)

    tiers = ("device", "host")
    bottom = [0.0, 0.0]
    for group in ("text", "image", "audio"):
        vals = [f[f"{t}_bytes_{group}"] / 2**20 for t in tiers]
        a3.bar(["device (pool)", "host (node store)"], vals, bottom=bottom, label=group)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a3.set(title=f"bytes per tier (spills {f['spills']}, restores {f['restores']}, evictions {f['evictions']})",
           ylabel="MiB")
    a3.legend(fontsize=8)
    fig.suptitle(f"mmtier demo: {f['turns']} turns, {f['tenants']} tenants; dense check "
                 f"{'passed' if r.passed else 'FAILED'} ({f['machine']})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
