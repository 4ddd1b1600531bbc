"""Multi-turn multimodal dialogue through the real cache: time to first token and memory.

``python -m benchmarks.multiturn [--quick] [--turns N] [--active N] [--new-tokens N]
[--rounds N] [--seed N] [--out DIR]`` (quick: 8 turns, 1 round; full: 120 turns, 2 rounds)

A seeded trace from ``benchmarks/workloads.py`` (conversations of several turns, interleaved,
over several tenants; Zipf-popular images shared across conversations and tenants; audio clips;
video) is saved as Arrow IPC, loaded back and replayed through ``TieredKVCache`` by the
reference model (``mmtier.models.ReferenceModel``: real attention through the cache).

Scaling (the reference model's token counts are its own, not the trace's):

- text (system prompts, user turns): one reference token (a byte) per ``SCALE`` trace tokens;
  the bytes are seeded by the trace's content id, so a tenant's system prompt is the same text
  in every conversation that uses it;
- an image (LLaVA-1.5 576 tokens or Qwen2-VL dynamic) and a video segment (<= 8 s of Qwen2-VL
  video): one reference ``Image`` of 3072 seeded bytes -> 64 tokens (its fixed budget); the
  same trace media id is the same bytes, whoever sends it;
- an audio clip (Whisper, 1500 tokens per 30 s window): one reference ``Audio`` of
  ``tokens / SCALE`` frames;
- replies: ``--new-tokens`` greedy tokens per turn (the dense reference takes one length per
  conversation), each answer staying in the conversation's context.

Adjacent text in a turn is one ``Text`` item (a system prompt and a user turn with no media
between them are one prompt). A replay is much shorter than the full 2000-turn trace, so the
trace's catalogues (images, clips, videos) shrink until the share of media placements that
repeat an earlier one of the same tenant is the closest to the full trace's, with at least
8 images, 4 clips and 2 videos (both shares are in the figures).

Arms, run in one process and interleaved turn by turn (their order rotates each turn):

- **cache**: one ``TieredKVCache`` for the whole replay; each conversation is a
  ``CachedSession`` that keeps its context between turns, and every media item's encoder
  outputs, cross-attention K/V (content-only) and self-attention K/V (prefix-dependent) are
  shared by content key with every other request of the tenant;
- **recompute** (the baseline the speedup is against): the same request -- the conversation so
  far (earlier turns and their answers, adjacent text merged into one chunk) plus the new
  turn -- through the *same cached code path* with a cache emptied per request (a fresh
  ``TieredKVCache``, created outside the timing). This is a serving engine with paged KV and
  prefix caching off: the same kernels, page writes and encoders as the cache arm, so the
  ratio isolates what re-use saves;
- **dense** (reported, not the baseline): the same full request through ``generate_dense``
  (no cache: torch attention over concatenated K/V). On a CPU its attention is a different,
  much cheaper code path than the paged one (see ``kernels.json``), so cache vs dense mixes
  re-use with the cost of paging on this machine.

TTFT is the time from handing a turn to the model until its first greedy token exists (the
model's ``greedy`` is wrapped to stamp it); the recompute and dense arms stop at that token.
The whole replay runs ``--rounds`` times on fresh caches (identical work and answers) and a
turn's TTFT per arm is its minimum over the rounds: this machine is shared and noisy. The
cache arm pays one chunk more per later turn than the recompute arm: ``CachedSession`` feeds
the previous answer's last token as a chunk of its own, while the recompute request merges it
into the surrounding text. ``prefill_positions_*`` count the decoder positions each arm ran
before its first token (the model's counters; the cache arm's decode steps subtracted).

Figures: ``ttft_*_s`` are means over turns; ``ttft_speedup`` = recompute / cache (ratio of
the sums, i.e. of the means); ``..._median_paired`` is the median of the per-turn ratios;
``..._first_turn`` / ``..._later_turns`` split turns that open a conversation (only
cross-conversation sharing helps) from the rest (the conversation's own context helps too).

Memory, by modality group (vision = vision self K/V + vision_xattn + vision_embed; audio alike;
text = text K/V): every conversation's session stays open until the replay ends, so the
cache then holds every group of the replay (``cache_evictions`` must be 0). *With sharing*:
the bytes the cache stores (``stats()``, page-granular). *Without*: every reference a
sequence holds as its own copy (a repeated image in one conversation counts twice), encoder
outputs not kept at all (a request without sharing discards them). Text is never shared here
(each conversation appends its own), so its ratio is 1.

Hit ratios: per cache modality, the cache's own lookup counters (``hits / (hits + misses)``);
per media modality (video segments are vision), the same over its three modalities;
``hit_ratio_text`` = the share of the
request's text tokens (history and new) the cache arm did not prefill.
``encoder_runs_avoided_fraction`` = 1 - encoder runs of the cache arm / media placements (one
run per media item per turn that sends it: what content-free serving that keeps each
conversation's context would run). ``tokens_match``: every answer of the cache arm equals the
dense model's conversation (``chat_dense``), and the first token of every recompute and dense
request equals it too; anything else raises ``TokenMismatch``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mmtier import TieredKVCache
from mmtier.models import Audio, Image, Media, ReferenceModel, Text

from ._common import add_out_arg, machine, print_table, write_results
from .workloads import WorkloadConfig, generate, load, save

SCALE = 16                          # trace tokens per reference-model token (text, audio)
IMAGE_BYTES = 32 * 32 * 3           # the reference vision encoder's grid: 64 tokens
AUDIO_FRAME = 32                    # bytes per reference audio token
ARMS = ("cache", "recompute", "dense")
GROUPS = {"vision": ("vision", "vision_xattn", "vision_embed"),
          "audio": ("audio", "audio_xattn", "audio_embed"), "text": ("text",)}
MIN_CATALOGUE = (8, 4, 2)           # images, audio clips, videos in a shrunk trace
CACHE_BYTES = 1 << 30               # the cache arm's arena (allocated lazily; sized not to evict)
FRESH_BYTES = 64 << 20              # each recompute request's own empty cache


class TokenMismatch(AssertionError):
    """A cached or recomputed answer differs from the dense model's."""


# ---------------------------------------------------------------------------- trace mapping
@dataclass(frozen=True)
class Turn:
    req: int
    tenant: str
    conv: int
    index: int                       # turn within its conversation
    items: tuple                     # reference-model prompt items
    media: Counter                   # placements by media modality (video counts as vision)


def _bytes(ident: int, n: int) -> bytes:
    return np.random.default_rng(ident).integers(0, 256, n, dtype=np.uint8).tobytes()


def _scaled(tokens: int) -> int:
    return max(1, round(tokens / SCALE))


def repeat_fraction(table) -> float:
    """Share of media placements that repeat an earlier one of the same tenant (same bytes)."""
    rows = table.to_pydict()
    seen, n, rep = set(), 0, 0
    for tenant, media, mod in zip(rows["tenant"], rows["media"], rows["modality"]):
        if mod != "text":
            n += 1
            rep += (tenant, media) in seen
            seen.add((tenant, media))
    return rep / n if n else 0.0


def trace_config(turns: int, seed: int, active: int) -> tuple[WorkloadConfig, float, float]:
    """The default trace's shape, ``turns`` long, catalogues shrunk so that the share of
    repeated media is the closest to the full 2000-turn trace's (a short trace over the full
    catalogue would hardly repeat anything), within ``MIN_CATALOGUE``. Returns (config, its
    share, the full trace's)."""
    full = WorkloadConfig(seed=seed)
    target = repeat_fraction(generate(full).table)
    best = None
    for shrink in (1, 2, 4, 8, 16):
        ratio = turns / full.turns / shrink
        cfg = WorkloadConfig(seed=seed, turns=turns, active=active,
                             images=max(MIN_CATALOGUE[0], round(full.images * ratio)),
                             audio_clips=max(MIN_CATALOGUE[1], round(full.audio_clips * ratio)),
                             videos=max(MIN_CATALOGUE[2], round(full.videos * ratio)))
        share = repeat_fraction(generate(cfg).table)
        if best is None or abs(share - target) < abs(best[1] - target):
            best = (cfg, share)
    return best[0], best[1], target


def to_turns(table) -> list[Turn]:
    """Trace rows -> reference-model turns in arrival order (assistant rows become replies)."""
    rows = table.to_pydict()
    by_req: dict[int, list[int]] = defaultdict(list)
    for i, req in enumerate(rows["req"]):
        by_req[req].append(i)
    turns = []
    for req in sorted(by_req):
        idx = sorted(by_req[req], key=lambda i: rows["seg"][i])
        items, media = [], Counter()
        for i in idx:
            role, mod, ident, tokens = (rows[c][i] for c in ("role", "modality", "media", "tokens"))
            if role in ("system", "user"):
                items.append(Text(_bytes(ident, _scaled(tokens))))
            elif mod in ("vision", "video"):
                items.append(Image(_bytes(ident, IMAGE_BYTES)))
                media["vision"] += 1
            elif mod == "audio":
                items.append(Audio(_bytes(ident, AUDIO_FRAME * _scaled(tokens))))
                media["audio"] += 1
        first = idx[0]
        turns.append(Turn(req, f"tenant{rows['tenant'][first]}", rows["conv"][first],
                          rows["turn"][first], tuple(merge_text(items)), media))
    return turns


def merge_text(items: Sequence) -> list:
    """Adjacent ``Text`` items as one chunk (one prefill of the whole text run)."""
    out: list = []
    for item in items:
        if isinstance(item, Text) and out and isinstance(out[-1], Text):
            out[-1] = Text(out[-1].ids + item.ids)
        else:
            out.append(item)
    return out


def ref_tokens(model: ReferenceModel, items: Sequence) -> tuple[int, int]:
    """(text tokens, all tokens) of a prompt in the reference model's own counts."""
    text = sum(len(i.ids) for i in items if isinstance(i, Text))
    media = sum(model.encoders[i.modality].tokens_for(i.data) for i in items if isinstance(i, Media))
    return text, text + media


# ---------------------------------------------------------------------------- timing
class TimedModel(ReferenceModel):
    """The reference model, stamping the moment each greedy decode has its first token."""

    first_token_at: float | None = None

    def greedy(self, last, max_new_tokens, step):
        if max_new_tokens <= 0:
            return super().greedy(last, max_new_tokens, step)
        first = super().greedy(last, 1, step)
        self.first_token_at = time.perf_counter()
        if max_new_tokens == 1:
            return first
        return first + super().greedy(step(first), max_new_tokens - 1, step)


def _ttft(model: TimedModel, fn) -> tuple[list[int], float, float]:
    model.first_token_at = None
    t0 = time.perf_counter()
    tokens = fn()
    t1 = time.perf_counter()
    if model.first_token_at is None:
        raise RuntimeError("no first token was produced")
    return tokens, model.first_token_at - t0, t1 - t0


@dataclass
class Record:
    turn: Turn
    context_tokens: int = 0
    text_total: int = 0
    text_new: int = 0
    ttft: dict[str, float] = field(default_factory=dict)
    turn_s: float = 0.0
    answer: list[int] = field(default_factory=list)
    first: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------- replay
def replay(turns: list[Turn], new_tokens: int, seed: int = 0, rounds: int = 1) -> tuple[list[Record], dict]:
    """``rounds`` replays of every turn through the three arms, each on fresh caches; a turn's
    TTFT per arm is its minimum over the rounds (the work is identical: only noise differs)."""
    models = {arm: TimedModel(seed=seed) for arm in ARMS}
    _warm_up(models, new_tokens)
    records, facts = None, None
    for r in range(rounds):
        for m in models.values():
            m.counters = type(m.counters)()
        recs, f = _round(models, turns, new_tokens, r)
        if records is None:
            records, facts = recs, f
            continue
        for rec, again in zip(records, recs):
            if (rec.answer, rec.first) != (again.answer, again.first):
                raise TokenMismatch(f"req {rec.turn.req}: round {r} answered {again.answer} "
                                    f"{again.first}, round 0 {rec.answer} {rec.first}")
            rec.ttft = {arm: min(rec.ttft[arm], again.ttft[arm]) for arm in ARMS}
            rec.turn_s = min(rec.turn_s, again.turn_s)
    return records, facts


def _round(models: dict[str, TimedModel], turns: list[Turn], new_tokens: int,
           shift: int) -> tuple[list[Record], dict]:
    """One replay: the cache arm's one cache, a fresh cache per recompute request, dense."""
    cache = TieredKVCache(models["cache"].cache_config(device_bytes=CACHE_BYTES))
    fresh_cfg = models["recompute"].cache_config(device_bytes=FRESH_BYTES)
    sessions: dict[int, object] = {}
    history: dict[int, list] = defaultdict(list)
    records: list[Record] = []
    try:
        for n, turn in enumerate(turns):
            rec = Record(turn)
            request = merge_text([*history[turn.conv], *turn.items])
            rec.text_total, rec.context_tokens = ref_tokens(models["cache"], request)
            rec.text_new = ref_tokens(models["cache"], turn.items)[0] + (1 if history[turn.conv] else 0)
            k = (n + shift) % len(ARMS)
            for arm in ARMS[k:] + ARMS[:k]:
                model = models[arm]
                if arm == "cache":
                    if turn.conv not in sessions:
                        sessions[turn.conv] = model.session(cache, turn.tenant)
                    s = sessions[turn.conv]
                    rec.answer, rec.ttft[arm], rec.turn_s = _ttft(
                        model, lambda s=s, items=list(turn.items): s.send(items, new_tokens))
                    rec.first[arm] = rec.answer[0]
                elif arm == "recompute":
                    with TieredKVCache(fresh_cfg) as fresh:
                        toks, rec.ttft[arm], _ = _ttft(model, lambda m=model, f=fresh, t=turn.tenant,
                                                       r=request: m.generate(f, t, r, 1))
                    rec.first[arm] = toks[0]
                else:
                    toks, rec.ttft[arm], _ = _ttft(model, lambda m=model, r=request: m.generate_dense(r, 1))
                    rec.first[arm] = toks[0]
            history[turn.conv] += [*turn.items, Text(rec.answer)]
            records.append(rec)
        facts = _memory(cache, sessions)
        stats = cache.stats()
        facts["by_modality"] = stats.by_modality
        facts["evictions"] = stats.counters.get("evictions", 0)
        facts["counters"] = {arm: m.counters.snapshot() for arm, m in models.items()}
    finally:
        for s in sessions.values():
            s.close()
        cache.close()
    return records, facts


def _warm_up(models: dict[str, TimedModel], new_tokens: int) -> None:
    """One request per arm on throw-away caches (first calls pay one-off costs)."""
    prompt = [Text("warm up "), Image(_bytes(1, IMAGE_BYTES)), Audio(_bytes(2, 640)), Text("?")]
    for arm, model in models.items():
        if arm == "dense":
            model.generate_dense(prompt, 2)
        else:
            with TieredKVCache(model.cache_config(device_bytes=FRESH_BYTES)) as c:
                model.generate(c, "warm-up", prompt, 2)


def _memory(cache: TieredKVCache, sessions: dict) -> dict:
    """Bytes stored (with sharing) and bytes referenced per sequence (without), by modality."""
    stats = cache.stats()
    stored: Counter = Counter()
    for tier in stats.tiers.values():
        for mod, usage in tier.items():
            stored[mod] += usage.bytes
    referenced: Counter = Counter()
    for s in sessions.values():
        for seq in (s.seq, s.xseq):
            for seg in cache.sequence(seq).segments:
                referenced[seg.group.modality] += seg.group.nbytes
    return {"stored": dict(stored), "referenced": dict(referenced)}


def dense_check(turns: list[Turn], records: list[Record], new_tokens: int, seed: int = 0) -> list[str]:
    """Every conversation through ``chat_dense``; the mismatches, as lines (none: all equal)."""
    model = ReferenceModel(seed=seed)
    by_conv: dict[int, list[Record]] = defaultdict(list)
    for rec in records:
        by_conv[rec.turn.conv].append(rec)
    bad = []
    for conv, recs in by_conv.items():
        answers = model.chat_dense([list(r.turn.items) for r in recs], new_tokens)
        for rec, want in zip(recs, answers):
            if rec.answer != want:
                bad.append(f"req {rec.turn.req} (conv {conv} turn {rec.turn.index}): "
                           f"cache {rec.answer} != dense {want}")
            for arm in ("recompute", "dense"):
                if rec.first[arm] != want[0]:
                    bad.append(f"req {rec.turn.req} (conv {conv} turn {rec.turn.index}): "
                               f"{arm} first token {rec.first[arm]} != dense {want[0]}")
    return bad


# ---------------------------------------------------------------------------- figures
def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def figures(records: list[Record], facts: dict, new_tokens: int) -> dict:
    fig: dict[str, object] = {}
    sums = {arm: sum(r.ttft[arm] for r in records) for arm in ARMS}
    n = len(records)
    for arm in ARMS:
        fig[f"ttft_{arm}_s"] = sums[arm] / n
        fig[f"ttft_{arm}_p50_s"] = statistics.median(r.ttft[arm] for r in records)
    fig["ttft_speedup"] = _ratio(sums["recompute"], sums["cache"])
    fig["ttft_speedup_median_paired"] = statistics.median(
        r.ttft["recompute"] / r.ttft["cache"] for r in records)
    fig["ttft_speedup_vs_dense"] = _ratio(sums["dense"], sums["cache"])
    for name, keep in (("first_turn", lambda r: r.turn.index == 0),
                       ("later_turns", lambda r: r.turn.index > 0)):
        sel = [r for r in records if keep(r)]
        fig[f"ttft_speedup_{name}"] = _ratio(sum(r.ttft["recompute"] for r in sel),
                                             sum(r.ttft["cache"] for r in sel)) if sel else None
        fig[f"turns_{name.split('_')[0]}"] = len(sel)
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
            fig[f"hit_ratio_{m if m != group else group + '_self'}"] = _ratio(h, h + mi)
            hits, misses = hits + h, misses + mi
        fig[f"hit_ratio_{group}"] = _ratio(hits, hits + misses)
    text_total = sum(r.text_total for r in records)
    fig["hit_ratio_text"] = 1 - sum(r.text_new for r in records) / text_total

    placements = Counter()
    for r in records:
        placements.update(r.turn.media)
    runs = {arm: facts["counters"][arm]["encoder_runs"] for arm in ("cache", "recompute")}
    total_runs = sum(runs["cache"].values())
    fig["media_placements"] = sum(placements.values())
    fig["encoder_runs_cache"] = total_runs
    fig["encoder_runs_recompute"] = sum(runs["recompute"].values())
    fig["encoder_runs_avoided_fraction"] = _ratio(fig["media_placements"] - total_runs,
                                                  fig["media_placements"])
    for m in ("vision", "audio"):
        fig[f"encoder_runs_avoided_fraction_{m}"] = _ratio(
            placements[m] - runs["cache"].get(m, 0), placements[m])
    dec = {arm: facts["counters"][arm]["decoder_tokens"] for arm in ("cache", "recompute")}
    prefill_cache = dec["cache"] - n * (new_tokens - 1)
    fig["prefill_positions_cache"] = prefill_cache
    fig["prefill_positions_recompute"] = dec["recompute"]
    fig["prefill_positions_recompute_over_cache"] = _ratio(dec["recompute"], prefill_cache)

    fig["conversations"] = len({r.turn.conv for r in records})
    fig["turns"] = n
    fig["tenants"] = len({r.turn.tenant for r in records})
    fig["new_tokens_per_turn"] = new_tokens
    fig["context_tokens_mean"] = sum(r.context_tokens for r in records) / n
    fig["context_tokens_max"] = max(r.context_tokens for r in records)
    fig["token_scale"] = SCALE
    fig["baseline"] = ("recompute = the full conversation so far through the same cached code "
                       "path with a cache emptied per request (prefix caching off)")
    fig["note_tokens"] = ("token counts are the reference model's own: text and audio = trace "
                          f"tokens / {SCALE}, every image and video segment = 64 tokens")
    return fig


def plot(records: list[Record], fig: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"cache": ("C0", "with the cache"), "recompute": ("C3", "recompute (cache emptied per request)"),
              "dense": ("C7", "dense recompute (no cache)")}
    f, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.4))
    xs = [r.turn.req for r in records]
    for arm, (color, label) in styles.items():
        a1.plot(xs, [r.ttft[arm] * 1e3 for r in records], "o", ms=3, color=color, label=label,
                alpha=0.5 if arm == "dense" else 0.9)
    a1.set(xlabel="request (arrival order)", ylabel="TTFT (ms)", yscale="log",
           title="TTFT per turn")
    a1.legend(fontsize=8)
    by_index: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        by_index[r.turn.index].append(r)
    idx = sorted(by_index)
    for arm, (color, label) in styles.items():
        a2.plot(idx, [1e3 * statistics.mean(r.ttft[arm] for r in by_index[i]) for i in idx],
                "-o", color=color, label=label)
    for i in idx:
        a2.annotate(f"n={len(by_index[i])}", (i, 1e3 * statistics.mean(r.ttft["cache"] for r in by_index[i])),
                    textcoords="offset points", xytext=(0, -12), fontsize=7, ha="center")
    a2.set(xlabel="turn within the conversation", ylabel="mean TTFT (ms)", yscale="log",
           title="TTFT by turn index")
    a2.legend(fontsize=8)
    f.suptitle(f"mmtier multi-turn: {fig['turns']} turns, {fig['conversations']} conversations, "
               f"reference model on CPU; speedup {fig['ttft_speedup']:.2f}x vs recompute "
               f"({machine()})", fontsize=9)
    f.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    f.savefig(path, dpi=110)
    plt.close(f)


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short trace: seconds, a check that it runs")
    ap.add_argument("--turns", type=int, default=None, help="turns in the trace (quick 8, full 120)")
    ap.add_argument("--active", type=int, default=None, help="conversations open at once (quick 3, full 5)")
    ap.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per turn (quick 3, full 6)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="replays; a turn's TTFT is its minimum over them (quick 1, full 2)")
    ap.add_argument("--seed", type=int, default=0)
    add_out_arg(ap)
    a = ap.parse_args(argv)
    turns_n = a.turns or (8 if a.quick else 120)
    active = a.active or (3 if a.quick else 5)
    new_tokens = a.new_tokens or (3 if a.quick else 6)
    rounds = a.rounds or (1 if a.quick else 2)
    if min(turns_n, active, new_tokens, rounds) <= 0:
        ap.error("--turns, --active, --new-tokens and --rounds must be positive")
    out = a.out
    torch.set_num_threads(1)          # tiny matmuls: one thread is faster and steadier here
    t0 = time.perf_counter()

    trace_path = out / f"multiturn_trace{'_quick' if a.quick else ''}.arrow"
    cfg, repeats, repeats_full = trace_config(turns_n, a.seed, active)
    trace = load(save(generate(cfg), trace_path))
    turns = to_turns(trace.table)
    records, facts = replay(turns, new_tokens, a.seed, rounds)
    bad = dense_check(turns, records, new_tokens, a.seed)
    if bad:
        print("\n".join(bad[:20]))
        raise TokenMismatch(f"{len(bad)} answers differ from the dense model (first: {bad[0]})")
    fig = figures(records, facts, new_tokens)
    fig["tokens_match"] = True
    if fig["cache_evictions"]:
        raise RuntimeError(f"the cache arm evicted {fig['cache_evictions']} groups: memory figures "
                           "need every group resident; raise CACHE_BYTES")
    fig["quick"] = bool(a.quick)
    fig["rounds"] = rounds
    fig["trace_media_repeat_fraction"] = repeats
    fig["full_trace_media_repeat_fraction"] = repeats_full
    fig["trace_catalogue_images"] = cfg.images
    fig["trace_catalogue_audio_clips"] = cfg.audio_clips
    fig["trace_catalogue_videos"] = cfg.videos
    fig["wall_s"] = time.perf_counter() - t0

    print(f"trace: {trace_path} ({len(trace)} rows); {fig['note_tokens']}")
    print(f"baseline: {fig['baseline']}")
    print(f"\n{'req':>4} {'conv':>4} {'turn':>4} {'ctx tok':>7} " + " ".join(f"{a + ' ms':>13}" for a in ARMS))
    for r in records:
        print(f"{r.turn.req:>4} {r.turn.conv:>4} {r.turn.index:>4} {r.context_tokens:>7} "
              + " ".join(f"{r.ttft[arm] * 1e3:>13.1f}" for arm in ARMS))
    print_table("multiturn figures", [(k, v) for k, v in sorted(fig.items())
                                      if k not in ("baseline", "note_tokens")])
    path = write_results("multiturn", fig, out)
    png = out / "multiturn.png"
    plot(records, fig, png)
    print(f"\nwrote {path} and {png}")
    return fig


if __name__ == "__main__":
    main()
