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

Arms, run in one process and interleaved turn by turn (their order alternates each turn):

- **cache**: one ``TieredKVCache`` for the whole replay; each conversation is a
  ``CachedSession`` that keeps its context between turns, and every media item's encoder
  outputs, cross-attention K/V (content-only) and self-attention K/V (prefix-dependent) are
  shared by content key with every other request of the tenant;
- **dense** (the baseline): the same request -- the conversation so far (earlier turns and
  their answers, adjacent text merged into one chunk) plus the new turn -- recomputed through
  ``generate_dense`` (no cache: every encoder runs, torch attention over concatenated K/V),
  the fastest way this model has to answer without re-use.

Both arms are warm before anything is timed: the first ``WARM_TURNS`` turns of the trace run
untimed through each (own throw-away cache), so first calls' one-off costs fall on neither.
TTFT is the time from handing a turn to the model until its first greedy token exists (the
model's ``greedy`` is wrapped to stamp it); the dense arm stops at that token. The whole replay
runs ``--rounds`` times (5) on fresh caches (identical work and answers): a turn's TTFT per arm
is its median over the rounds. The cache arm pays one chunk more per later turn than the dense
arm: ``CachedSession`` feeds the previous answer's last token as a chunk of its own.
``prefill_positions_cache`` counts the decoder positions the cache arm ran before its first
tokens (its counters, decode steps subtracted); ``prefill_positions_dense`` the requests' tokens.

Figures: ``ttft_speedup_vs_dense`` (headline) = the dense arm's summed TTFT over the cache
arm's, per round, median of the rounds (best, worst and every pair beside it);
``..._median_turn`` is the median over turns of the per-turn ratio; ``..._first_turn`` /
``..._later_turns`` split turns that open a conversation (only cross-conversation sharing
helps) from the rest (the conversation's own context helps too). ``ttft_<arm>_p50_s`` /
``_p95_s`` over turns, and per turn index (``__turn0`` ... ``__turn4+``).

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

import numpy as np
import torch

from mmtier import TieredKVCache
from mmtier.models import Audio, Image, Media, ReferenceModel, Text

from ._common import add_out_arg, print_table, write_results
from .multiturn_figures import ARMS, figures, plot
from .workloads import WorkloadConfig, generate, load, save

SCALE = 16                          # trace tokens per reference-model token (text, audio)
IMAGE_BYTES = 32 * 32 * 3           # the reference vision encoder's grid: 64 tokens
AUDIO_FRAME = 32                    # bytes per reference audio token
MIN_CATALOGUE = (8, 4, 2)           # images, audio clips, videos in a shrunk trace
CACHE_BYTES = 1 << 30               # the cache arm's arena (allocated lazily; sized not to evict)
WARM_BYTES = 256 << 20              # the warm-up's throw-away cache
WARM_TURNS = 4                      # turns replayed untimed through both arms first


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
    rounds: dict[str, list[float]] = field(default_factory=dict)
    turn_s: float = 0.0
    answer: list[int] = field(default_factory=list)
    first: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------- replay
def replay(turns: list[Turn], new_tokens: int, seed: int = 0,
           rounds: int = 1) -> tuple[list[Record], list[dict[str, float]], dict]:
    """``rounds`` replays of every turn through both arms, each on fresh caches, after an
    untimed warm-up of both. Returns the records (a turn's TTFT per arm: its median over the
    rounds; ``Record.rounds`` every round's), each round's summed TTFT per arm, and round 0's
    facts (memory, counters)."""
    models = {arm: TimedModel(seed=seed) for arm in ARMS}
    _warm_up(models, turns[:WARM_TURNS], new_tokens)
    records, facts, sums = None, None, []
    for r in range(rounds):
        for m in models.values():
            m.counters = type(m.counters)()
        recs, f = _round(models, turns, new_tokens, r)
        sums.append({arm: sum(rec.ttft[arm] for rec in recs) for arm in ARMS})
        if records is None:
            records, facts = recs, f
            for rec in records:
                rec.rounds = {arm: [rec.ttft[arm]] for arm in ARMS}
            continue
        for rec, again in zip(records, recs):
            if (rec.answer, rec.first) != (again.answer, again.first):
                raise TokenMismatch(f"req {rec.turn.req}: round {r} answered {again.answer} "
                                    f"{again.first}, round 0 {rec.answer} {rec.first}")
            for arm in ARMS:
                rec.rounds[arm].append(again.ttft[arm])
            rec.turn_s = min(rec.turn_s, again.turn_s)
    for rec in records:
        rec.ttft = {arm: statistics.median(v) for arm, v in rec.rounds.items()}
    return records, sums, facts


def _round(models: dict[str, TimedModel], turns: list[Turn], new_tokens: int,
           shift: int) -> tuple[list[Record], dict]:
    """One replay: the cache arm's one cache (sessions per conversation) against dense."""
    cache = TieredKVCache(models["cache"].cache_config(device_bytes=CACHE_BYTES))
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


def _warm_up(models: dict[str, TimedModel], turns: list[Turn], new_tokens: int) -> None:
    """The first turns through both arms, untimed, on a throw-away cache (one-off costs: first
    calls, buffers, code paths), answers discarded."""
    cfg = models["cache"].cache_config(device_bytes=WARM_BYTES)
    with TieredKVCache(cfg) as c:
        history: dict[int, list] = defaultdict(list)
        sessions = {}
        try:
            for turn in turns:
                if turn.conv not in sessions:
                    sessions[turn.conv] = models["cache"].session(c, turn.tenant)
                answer = sessions[turn.conv].send(list(turn.items), new_tokens)
                models["dense"].generate_dense(merge_text([*history[turn.conv], *turn.items]), 1)
                history[turn.conv] += [*turn.items, Text(answer)]
        finally:
            for s in sessions.values():
                s.close()


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
            for arm in ("dense",):
                if rec.first[arm] != want[0]:
                    bad.append(f"req {rec.turn.req} (conv {conv} turn {rec.turn.index}): "
                               f"{arm} first token {rec.first[arm]} != dense {want[0]}")
    return bad




# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short trace: seconds, a check that it runs")
    ap.add_argument("--turns", type=int, default=None, help="turns in the trace (quick 8, full 120)")
    ap.add_argument("--active", type=int, default=None, help="conversations open at once (quick 3, full 5)")
    ap.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per turn (quick 3, full 6)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="replays; a turn's TTFT is its median over them (quick 1, full 5)")
    ap.add_argument("--seed", type=int, default=0)
    add_out_arg(ap)
    a = ap.parse_args(argv)
    turns_n = a.turns or (8 if a.quick else 120)
    active = a.active or (3 if a.quick else 5)
    new_tokens = a.new_tokens or (3 if a.quick else 6)
    rounds = a.rounds or (1 if a.quick else 5)
    if min(turns_n, active, new_tokens, rounds) <= 0:
        ap.error("--turns, --active, --new-tokens and --rounds must be positive")
    out = a.out
    torch.set_num_threads(1)          # tiny matmuls: one thread is faster and steadier here
    t0 = time.perf_counter()

    trace_path = out / f"multiturn_trace{'_quick' if a.quick else ''}.arrow"
    cfg, repeats, repeats_full = trace_config(turns_n, a.seed, active)
    trace = load(save(generate(cfg), trace_path))
    turns = to_turns(trace.table)
    records, sums, facts = replay(turns, new_tokens, a.seed, rounds)
    bad = dense_check(turns, records, new_tokens, a.seed)
    if bad:
        print("\n".join(bad[:20]))
        raise TokenMismatch(f"{len(bad)} answers differ from the dense model (first: {bad[0]})")
    fig = figures(records, sums, facts, new_tokens)
    fig["token_scale"] = SCALE
    fig["note_tokens"] = ("token counts are the reference model's own: text and audio = trace "
                          f"tokens / {SCALE}, every image and video segment = 64 tokens")
    fig["tokens_match"] = True
    if fig["cache_evictions"]:
        raise RuntimeError(f"the cache arm evicted {fig['cache_evictions']} groups: memory figures "
                           "need every group resident; raise CACHE_BYTES")
    fig["quick"] = bool(a.quick)
    fig["rounds"] = rounds
    fig["summary"] = (f"ttft_speedup_vs_dense: median of {rounds} rounds (summed TTFT, paired in "
                      "each round), best and worst beside; per-turn TTFT: median of the rounds")
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
