"""Multi-turn multimodal dialogue through the real cache: time to first token and memory.

``python -m benchmarks.cache.multiturn [--quick] [--turns N] [--active N] [--new-tokens N]
[--rounds N] [--seed N] [--out DIR]`` (quick: 4 turns, 1 round; full: 40 turns, 3 rounds)

A seeded trace from ``benchmarks/eviction/workloads.py`` (conversations of several turns, interleaved,
over several tenants; Zipf-popular images shared across conversations and tenants; audio clips;
video) is saved as Arrow IPC, loaded back and replayed through ``TieredKVCache`` by the chat
model the demo and Serve run (``mmtier.chat.model.ChatModel.tiny``: a random-weight
Qwen2-VL of SmolLM-135M's width and a Whisper of whisper-tiny's shape, through the transformers
adapter; real PNG / JPEG, MP4 and WAV bytes through the models' own processors).

Mapping (the model's token counts are its own, not the trace's):

- text (system prompts, user turns): one byte-level token per ``SCALE`` trace tokens; the text
  is seeded by the trace's content id, so a tenant's system prompt is the same text in every
  conversation that uses it;
- an image: seeded PNG or JPEG bytes of one of three sizes (130-144 decoder tokens), the same
  trace media id the same bytes whoever sends it;
- a video: seeded MP4 bytes of 4 s (two segments of the ``video`` pool);
- an audio clip: seeded WAV bytes of the clip's length at 1 s per 50 trace tokens (Whisper's
  rate), within 1-4.5 s (the demo Whisper's window is 5 s); it is transcribed into the prompt;
- replies: ``--new-tokens`` greedy tokens per turn, each answer staying in the conversation.

A replay is much shorter than the full 2000-turn trace, so the trace's catalogues (images,
clips, videos) shrink until the share of media placements that repeat an earlier one of the
same tenant is the closest to the full trace's, with at least 8 images, 4 clips and 2 videos
(both shares are in the figures).

Arms, run in one process and interleaved turn by turn (their order alternates each turn):

- **cache**: one ``TieredKVCache`` for the whole replay; each conversation is a
  ``Conversation`` whose turns attach the history's spans and prefill only what is new; every
  image's vision-tower output, every clip's transcript and Whisper K/V are shared by content key
  with every other request of the tenant;
- **dense** (the baseline): the same request -- the conversation so far (earlier turns and
  their answers) plus the new turn -- recomputed through ``dense_turn`` (no cache: every encoder
  runs, transformers' ``DynamicCache`` and sdpa over the whole prompt).

Both arms are warm before anything is timed (``ChatModel.warm_up``, then the first
``WARM_TURNS`` turns untimed through each on a throw-away cache). TTFT is the time from handing
a turn to the model until the logits of its first answer token exist (a forward hook on the
VLM's ``lm_head``, armed when ``generate`` starts); the dense arm stops at that token. The whole
replay runs ``--rounds`` times on fresh caches (identical work and answers): a turn's TTFT per
arm is its median over the rounds. ``prefill_positions_cache`` counts the decoder prompt
positions the cache arm ran (``TurnCounters.prefilled_tokens``), ``prefill_positions_dense`` the
requests' tokens.

Figures: ``ttft_speedup_vs_dense`` (headline) = the dense arm's summed TTFT over the cache
arm's, per round, median of the rounds (best, worst and every pair beside it);
``..._median_turn`` is the median over turns of the per-turn ratio; ``..._first_turn`` /
``..._later_turns`` split turns that open a conversation (only cross-conversation sharing
helps) from the rest. ``ttft_<arm>_p50_s`` / ``_p95_s`` over turns, and per turn index
(``__turn0`` ... ``__turn4+``).

Memory, by modality group (vision = image and video K/V and tower outputs; audio = Whisper's
K/V and transcripts; text = text K/V): conversations stay open until the replay ends, so the
cache then holds every group of the replay (``cache_evictions`` must be 0). *With sharing*: the
bytes the cache stores (``stats()``, page-granular). *Without*: every group a conversation used,
counted once per conversation (what per-request caches hold).

Hit ratios: per cache modality, the cache's own lookup counters (``hits / (hits + misses)``);
``hit_ratio_text`` = the share of the requests' decoder prompt tokens the cache arm attached
instead of prefilling. ``encoder_runs_avoided_fraction`` = 1 - encoder runs of the cache arm /
media placements (a video placement counts its segments). ``tokens_match``: every answer of the
cache arm equals the dense model's conversation (``dense_chat``), and the first token of every
dense request equals it too; anything else raises ``TokenMismatch``.
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
from mmtier.chat.dense import dense_chat, dense_turn
from mmtier.chat.model import ChatModel
from mmtier.demo.chat import IMAGE_SIZES, audio_bytes, image_bytes, video_bytes

from .._common import add_out_arg, print_table, write_results
from ..eviction.workloads import WorkloadConfig, generate, load, save
from .multiturn_figures import ARMS, figures, plot

SCALE = 4                           # trace text tokens per model token
AUDIO_TOKENS_PER_S = 50             # Whisper: 1500 encoder tokens per 30 s
AUDIO_S = (1.0, 4.5)                # a clip's length here (the demo Whisper's window is 5 s)
VIDEO_S = 4.0                       # every video: two segments of the video pool
MIN_CATALOGUE = (8, 4, 2)           # images, audio clips, videos in a shrunk trace
CACHE_BYTES = 1 << 30               # the cache arm's arena (allocated lazily; sized not to evict)
WARM_BYTES = 256 << 20              # the warm-up's throw-away cache
WARM_TURNS = 4                      # turns replayed untimed through both arms first
ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     .,?", dtype=np.uint8)


class TokenMismatch(AssertionError):
    """A cached answer or a dense first token differs from the dense model's conversation."""


# ---------------------------------------------------------------------------- trace mapping
@dataclass(frozen=True)
class Turn:
    req: int
    tenant: str
    conv: int
    index: int                       # turn within its conversation
    items: tuple                     # the chat model's prompt items (str, media bytes)
    media: Counter                   # placements by media modality (a video's segments are vision)


def _text(ident: int, n: int) -> str:
    rng = np.random.default_rng(ident)
    return ALPHABET[rng.integers(0, ALPHABET.size, n)].tobytes().decode()


def _scaled(tokens: int) -> int:
    return max(1, round(tokens / SCALE))


class Media:
    """Seeded media bytes per trace content id (made once: encoding a video takes a while)."""

    def __init__(self, seed: int):
        self.seed = seed
        self._made: dict[tuple, bytes] = {}

    def image(self, ident: int) -> bytes:
        return self._get(("image", ident), lambda: image_bytes(
            f"{self.seed}:image:{ident}", IMAGE_SIZES[ident % len(IMAGE_SIZES)], "PNG" if ident % 2 else "JPEG"))

    def video(self, ident: int) -> bytes:
        return self._get(("video", ident), lambda: video_bytes(f"{self.seed}:video:{ident}", VIDEO_S))

    def audio(self, ident: int, tokens: int) -> bytes:
        seconds = min(max(tokens / AUDIO_TOKENS_PER_S, AUDIO_S[0]), AUDIO_S[1])
        return self._get(("audio", ident), lambda: audio_bytes(f"{self.seed}:audio:{ident}", seconds))

    def _get(self, key: tuple, make) -> bytes:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]


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


def to_turns(table, media: Media, video_segments: int = 2) -> list[Turn]:
    """Trace rows -> chat-model turns in arrival order (assistant rows become the answers)."""
    rows = table.to_pydict()
    by_req: dict[int, list[int]] = defaultdict(list)
    for i, req in enumerate(rows["req"]):
        by_req[req].append(i)
    turns = []
    for req in sorted(by_req):
        idx = sorted(by_req[req], key=lambda i: rows["seg"][i])
        items, placed = [], Counter()
        for i in idx:
            role, mod, ident, tokens = (rows[c][i] for c in ("role", "modality", "media", "tokens"))
            if role in ("system", "user"):
                items.append(_text(ident, _scaled(tokens)))
            elif mod == "vision":
                items.append(media.image(ident))
                placed["vision"] += 1
            elif mod == "video":
                items.append(media.video(ident))
                placed["vision"] += video_segments
            elif mod == "audio":
                items.append(media.audio(ident, tokens))
                placed["audio"] += 1
        first = idx[0]
        turns.append(Turn(req, f"tenant{rows['tenant'][first]}", rows["conv"][first],
                          rows["turn"][first], tuple(merge_text(items)), placed))
    return turns


def merge_text(items: Sequence) -> list:
    """Adjacent text items as one (one run of prompt tokens)."""
    out: list = []
    for item in items:
        if isinstance(item, str) and out and isinstance(out[-1], str):
            out[-1] = out[-1] + item
        else:
            out.append(item)
    return out


# ---------------------------------------------------------------------------- timing
class FirstToken:
    """Stamps the moment the logits of a ``generate``'s first new token exist: a forward hook
    on the model's ``lm_head``, armed by a wrapper of its ``generate``."""

    def __init__(self, model):
        self.at: float | None = None
        self._armed = False
        model.lm_head.register_forward_hook(self._hook)
        generate = model.generate

        def armed(*args, **kwargs):
            self._armed = True
            try:
                return generate(*args, **kwargs)
            finally:
                self._armed = False

        model.generate = armed

    def _hook(self, *_args) -> None:
        if self._armed and self.at is None:
            self.at = time.perf_counter()

    def time(self, fn):
        """``(fn(), seconds to its first token, seconds in all)``."""
        self.at = None
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        if self.at is None:
            raise RuntimeError("no first token was produced")
        return out, self.at - t0, t1 - t0


@dataclass
class Record:
    turn: Turn
    context_tokens: int = 0          # decoder prompt tokens of the request (history included)
    prefilled: int = 0               # of those, run through the model by the cache arm
    ttft: dict[str, float] = field(default_factory=dict)
    rounds: dict[str, list[float]] = field(default_factory=dict)
    turn_s: float = 0.0
    answer: list[int] = field(default_factory=list)
    first: dict[str, int] = field(default_factory=dict)


class Arms:
    """The chat model and a first-token clock for each arm."""

    def __init__(self, seed: int):
        self.chat = ChatModel.tiny(seed=seed)
        self.chat.warm_up()
        self.clock = {"cache": FirstToken(self.chat.vlm), "dense": FirstToken(self.chat.dense_vlm)}


# ---------------------------------------------------------------------------- replay
def replay(turns: list[Turn], new_tokens: int, seed: int = 0,
           rounds: int = 1) -> tuple[list[Record], list[dict[str, float]], dict, Arms]:
    """``rounds`` replays of every turn through both arms, each on a fresh cache, after an
    untimed warm-up of both. Returns the records (a turn's TTFT per arm: its median over the
    rounds; ``Record.rounds`` every round's), each round's summed TTFT per arm, round 0's facts
    (memory, counters) and the arms."""
    arms = Arms(seed)
    _warm_up(arms, turns[:WARM_TURNS], new_tokens)
    records, facts, sums = None, None, []
    for r in range(rounds):
        arms.chat.encoder_runs.clear()
        recs, f = _round(arms, turns, new_tokens, r)
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
    return records, sums, facts, arms


def _round(arms: Arms, turns: list[Turn], new_tokens: int, shift: int) -> tuple[list[Record], dict]:
    """One replay: the cache arm's one cache (a conversation each) against dense."""
    chat = arms.chat
    cache = TieredKVCache(chat.cache_config(device_bytes=CACHE_BYTES))
    convs: dict[int, object] = {}
    history: dict[int, list] = defaultdict(list)
    used: dict[int, set] = defaultdict(set)
    records: list[Record] = []
    try:
        for n, turn in enumerate(turns):
            rec = Record(turn)
            k = (n + shift) % len(ARMS)
            for arm in ARMS[k:] + ARMS[:k]:
                if arm == "cache":
                    if turn.conv not in convs:
                        convs[turn.conv] = chat.conversation(cache, turn.tenant)
                    c = convs[turn.conv]
                    res, rec.ttft[arm], rec.turn_s = arms.clock[arm].time(
                        lambda c=c, items=list(turn.items): c.send(items, new_tokens))
                    rec.answer, rec.first[arm] = list(res.tokens), res.tokens[0]
                    rec.prefilled = res.counters.prefilled_tokens
                    rec.context_tokens = res.counters.cached_tokens + res.counters.prefilled_tokens
                    used[turn.conv].update(res.keys)
                else:
                    toks, rec.ttft[arm], _ = arms.clock[arm].time(
                        lambda h=list(history[turn.conv]), items=list(turn.items): dense_turn(chat, h, items, 1))
                    rec.first[arm] = toks[0]
            history[turn.conv].append((list(turn.items), rec.answer))
            records.append(rec)
        facts = _memory(cache, used)
        stats = cache.stats()
        facts["by_modality"] = stats.by_modality
        facts["evictions"] = stats.counters.get("evictions", 0)
        facts["encoder_runs"] = dict(chat.encoder_runs)
    finally:
        for c in convs.values():
            c.close()
        cache.close()
    return records, facts


def _warm_up(arms: Arms, turns: list[Turn], new_tokens: int) -> None:
    """The first turns through both arms, untimed, on a throw-away cache (one-off costs: first
    calls, buffers, code paths), answers discarded."""
    chat = arms.chat
    with TieredKVCache(chat.cache_config(device_bytes=WARM_BYTES)) as c:
        history: dict[int, list] = defaultdict(list)
        convs = {}
        for turn in turns:
            if turn.conv not in convs:
                convs[turn.conv] = chat.conversation(c, turn.tenant)
            answer = convs[turn.conv].send(list(turn.items), new_tokens).tokens
            dense_turn(chat, history[turn.conv], list(turn.items), 1)
            history[turn.conv].append((list(turn.items), list(answer)))


def _memory(cache: TieredKVCache, used: dict[int, set]) -> dict:
    """Bytes stored (with sharing) and bytes of the groups each conversation used, counted once
    per conversation (without), by modality."""
    stats = cache.stats()
    stored: Counter = Counter()
    for tier in stats.tiers.values():
        for mod, usage in tier.items():
            stored[mod] += usage.bytes
    size = {key: nbytes for key, _tier, nbytes in cache.inventory()}
    referenced: Counter = Counter()
    for keys in used.values():
        for key in keys:
            referenced[key.modality] += size.get(key, 0)
    return {"stored": dict(stored), "referenced": dict(referenced)}


def dense_check(chat: ChatModel, turns: list[Turn], records: list[Record], new_tokens: int) -> list[str]:
    """Every conversation through ``dense_chat``; the mismatches, as lines (none: all equal)."""
    by_conv: dict[int, list[Record]] = defaultdict(list)
    for rec in records:
        by_conv[rec.turn.conv].append(rec)
    bad = []
    for conv, recs in by_conv.items():
        answers = dense_chat(chat, [list(r.turn.items) for r in recs], new_tokens)
        for rec, want in zip(recs, answers):
            where = f"req {rec.turn.req} (conv {conv} turn {rec.turn.index})"
            if rec.answer != want:
                bad.append(f"{where}: cache {rec.answer} != dense {want}")
            if rec.first.get("dense") != want[0]:
                bad.append(f"{where}: dense first token {rec.first.get('dense')} != dense {want[0]}")
    return bad


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short trace: seconds, a check that it runs")
    ap.add_argument("--turns", type=int, default=None, help="turns in the trace (quick 4, full 40)")
    ap.add_argument("--active", type=int, default=None, help="conversations open at once (quick 2, full 5)")
    ap.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per turn (quick 2, full 6)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="replays; a turn's TTFT is its median over them (quick 1, full 3)")
    ap.add_argument("--seed", type=int, default=0)
    add_out_arg(ap)
    a = ap.parse_args(argv)
    turns_n = a.turns or (4 if a.quick else 40)
    active = a.active or (2 if a.quick else 5)
    new_tokens = a.new_tokens or (2 if a.quick else 6)
    rounds = a.rounds or (1 if a.quick else 3)
    if min(turns_n, active, new_tokens, rounds) <= 0:
        ap.error("--turns, --active, --new-tokens and --rounds must be positive")
    out = a.out
    torch.set_num_threads(1)          # small matmuls on a shared 2-core machine: one thread is steadier
    t0 = time.perf_counter()

    trace_path = out / f"multiturn_trace{'_quick' if a.quick else ''}.arrow"
    cfg, repeats, repeats_full = trace_config(turns_n, a.seed, active)
    trace = load(save(generate(cfg), trace_path))
    turns = to_turns(trace.table, Media(a.seed))
    records, sums, facts, arms = replay(turns, new_tokens, a.seed, rounds)
    bad = dense_check(arms.chat, turns, records, new_tokens)
    if bad:
        print("\n".join(bad[:20]))
        raise TokenMismatch(f"{len(bad)} answers differ from the dense model (first: {bad[0]})")
    fig = figures(records, sums, facts, new_tokens)
    fig["token_scale"] = SCALE
    fig["note_tokens"] = ("token counts are the chat model's own: text = trace tokens / "
                          f"{SCALE}, an image 130-144 decoder tokens, a video {VIDEO_S:g} s (two "
                          "segments), a clip 1-4.5 s transcribed into the prompt")
    fig["model"] = "ChatModel.tiny: random-weight Qwen2-VL (hidden 576, 12 layers) + Whisper (whisper-tiny's shape)"
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
