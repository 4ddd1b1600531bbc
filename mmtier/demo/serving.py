"""``mmtier demo`` (the default): multi-turn multimodal chats sent with the ``openai`` client to
two OpenAI API servers the way people serve vLLM (``python -m vllm.entrypoints.openai.api_server``
on 127.0.0.1, ``mmtier.demo.engines``), both with vLLM's own prefix cache on and a KV block pool
that holds a fraction of the conversations:

- ``plain``: vLLM alone: what its block pool lost is prefilled (and its images encoded) again;
- ``mmtier``: the same engine with mmtier's KV and encoder-cache connectors, named with sizes only
  (a page pool, a host tier, a disk tier); what vLLM's pool lost comes back from mmtier.

What it does, in order:

1. builds the model (``mmtier.demo.model``: a random-weight LLaVA whose language model is the
   8-layer, 512-wide shape of ``benchmarks/engines/vllm_engine.py``, 256 image tokens a picture) and
   starts both servers (their logs go to one file the summary names);
2. runs a seeded workload: conversations that open with one shared system prompt, carry images
   (PNG / JPEG data URLs from a small catalogue: an image recurs across turns and conversations)
   and interleave turn by turn, so that between two turns of a conversation the others pass
   through vLLM's pool; the working set is several times vLLM's KV pool;
3. sends every turn to both servers, streamed, in alternating order (paired): time to first
   token is the first content chunk; greedy answers (temperature 0) of a length drawn per turn
   (hundreds of tokens, words only: the next turn's prompt repeats the answer's ids, and the
   connector's decode saves hold them) must be equal;
4. midway, restarts the mmtier server the way servers are stopped: SIGTERM to its main process
   with vLLM's default shutdown (which kills the workers: no cache is closed), more than the
   write-behind's lag after the last answer (every saved group is on disk by then,
   ``mmtier.tiers.durability``); ``flush_at_restart`` closes the caches first through
   ``/collective_rpc`` instead (a faster flush). A new server over the same disk folder: the
   conversations continue from mmtier's disk tier;
5. then audio and video turns (``mmtier.demo.media``: the tiny Qwen2-Audio and Qwen2-VL, a pair
   of servers each, ``input_audio`` WAV clips and ``video_url`` MP4 data URLs reused across
   turns and users; answers equal, no times);
6. per phase (first turns, later turns before the restart, later turns after it): cached prompt
   tokens (``usage.prompt_tokens_details.cached_tokens``), the share of the previous turn's
   prompt and answer each later turn found cached, paired time to first token, vision
   encoder runs (counted in the engines' workers, read through ``/collective_rpc``), answers
   equal; per modality (text, image, audio, video): requests, items sent, tower runs, cached
   tokens, answers equal; a table, a flat JSON report, a PNG chart and every request's figures
   (``demo_requests.jsonl``).

Runs in the engines environment (``./run demo`` creates it: vLLM's CPU build here)."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import CacheConfig
from ..serve.tiny_models import SPECIALS, WORDS
from ..stats.machine import machine
from .media import MEDIA, MediaDemoSpec, media_figures, run_media, token_counts
from .streaming import stream_chat

TARGET_RATIO = 0.35          # later turns' paired TTFT, mmtier over plain vLLM (issue 49)
# the ids an answer is sampled from: the tiny tokenizer's words, none of its special tokens
WORD_IDS = list(range(len(SPECIALS), len(SPECIALS) + WORDS))

PHASES = ("first_turns", "later_before_restart", "later_after_restart")
PHASE_TITLES = {"first_turns": "first turns", "later_before_restart": "later, before restart",
                "later_after_restart": "later, after restart"}


@dataclass(frozen=True)
class ServingDemoSpec:
    conversations: int = 10
    turns: int = 5
    restart_after: int = 2              # the mmtier server restarts after this many turns of every conversation
    # each answer's length, drawn per turn: log-normal around ``answer_median`` tokens, clipped to
    # ``answer_range`` (chat answers run to hundreds of tokens; the 3.5K context caps them here);
    # the model samples words only (no special ids), as a chat model's answer is plain text
    answer_median: int = 192
    answer_range: tuple[int, int] = (128, 320)
    system_words: int = 200             # the shared system prompt (one token a word)
    user_words: int = 40                # a chat's user message (the answers are the long part)
    p_image: float = 0.6                # a later turn carries an image (the first always does)
    images: int = 6                     # the catalogue every conversation draws from
    # vLLM's KV block pool, blocks of 32 tokens (both engines): 3,584 tokens, about a seventh of the
    # conversations' working set (10 x 5 with their answers: ~20,000 tokens)
    kv_blocks: int = 112
    device_bytes: int = 512 << 20       # mmtier's page pool (the CPU's memory here, like the host tier)
    host_bytes: int = 1 << 30           # mmtier's host tier
    chunk_blocks: int | None = None     # the KV connector's blocks per text group (None: its default)
    encoder_cache: bool = True          # mmtier's encoder-cache connector beside its KV connector
    # close the mmtier workers' caches (/collective_rpc) before the restart's stop: a faster
    # flush; off, the stop is a plain SIGTERM and the write-behind made every save durable
    flush_at_restart: bool = False
    # the pause before each request: vLLM's worker busy-waits 1 s on its shared-memory queue
    # after each step (shm_broadcast.SpinCondition, not configurable), on a core the other
    # engine then lacks; without the pause whichever engine answered second in a pair took up
    # to 1 s longer to its first token, mmtier's as often as plain's (2 cores, nothing else)
    quiet_s: float = 1.2
    # audio and video turns on the tiny Qwen2-Audio / Qwen2-VL after the image part (None: none)
    media: MediaDemoSpec | None = field(default_factory=MediaDemoSpec)
    seed: int = 0

    @classmethod
    def quick(cls, seed: int = 0, **kw) -> ServingDemoSpec:
        return cls(**{"conversations": 4, "turns": 3, "restart_after": 2, "system_words": 100, "user_words": 60,
                      "images": 3, "kv_blocks": 48, "answer_median": 128, "answer_range": (128, 160),
                      "media": MediaDemoSpec.quick(seed), **kw, "seed": seed})

    @property
    def max_model_len(self) -> int:
        return min(4096, self.kv_blocks * 32 - 64)


@dataclass
class Turn:
    words: str
    image: int | None                   # image seed (None: text only)
    fmt: str = "PNG"
    answer: int = 128                   # the answer's length in tokens


@dataclass
class Conversation:
    index: int
    turns: list[Turn]
    messages: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)


def workload(spec: ServingDemoSpec) -> tuple[str, list[Conversation]]:
    """The shared system prompt and seeded conversations; images come from one catalogue with
    a skew (low seeds are popular), so an image recurs across turns and conversations."""
    from ..serve.tiny_models import text

    rng = random.Random(spec.seed)
    system = text(10_000 + spec.seed, spec.system_words)
    convs = []
    for c in range(spec.conversations):
        turns = []
        for i in range(spec.turns):
            img = None
            if i == 0 or rng.random() < spec.p_image:
                img = 1 + min(int(rng.expovariate(0.6)), spec.images - 1)
            fmt = "JPEG" if rng.random() < 0.3 else "PNG"
            turns.append(Turn(text(rng.randrange(1 << 30), spec.user_words), img, fmt, answer_length(spec, rng)))
        convs.append(Conversation(c, turns))
    return system, convs


def answer_length(spec: ServingDemoSpec, rng: random.Random) -> int:
    lo, hi = spec.answer_range
    return max(lo, min(hi, round(rng.lognormvariate(math.log(spec.answer_median), 0.35))))


def data_url(seed: int, fmt: str) -> str:
    from ..serve.tiny_models import image
    from .model import IMAGE_SIDE

    buf = io.BytesIO()
    image(seed, IMAGE_SIDE).save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def phase_of(spec: ServingDemoSpec, turn: int) -> str:
    if turn == 0:
        return "first_turns"
    return "later_before_restart" if turn < spec.restart_after else "later_after_restart"


@dataclass
class ServingDemoReport:
    spec: ServingDemoSpec
    figures: dict
    mismatches: list[str]
    records: list[dict]
    log_path: Path

    @property
    def passed(self) -> bool:
        return not self.mismatches


def run_serving_demo(spec: ServingDemoSpec, out: Path, progress: bool = True) -> ServingDemoReport:
    """Build the model, start both servers, run the workload (restarting the mmtier server
    midway), stop them. Engine and HTTP logs go to ``out/demo_engines.log``."""
    import openai
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    from .engines import EngineServer, EngineSpec, mmtier_sizes
    from .model import ensure_demo_llava

    hf_logging.disable_progress_bar()      # the models' "Writing model shards": one bar, the demo's
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "demo_engines.log"
    log_path.write_text("")
    system, convs = workload(spec)
    t_all = time.perf_counter()
    order = [(c, i) for i in range(spec.turns) for c in convs]          # conversations interleave
    media_turns = spec.media.conversations * spec.media.turns * len(MEDIA) if spec.media else 0
    bar = tqdm(total=len(order) + 3 + media_turns + bool(spec.media), desc="demo: model", unit="step",
               disable=not progress,
               bar_format="{desc:<34}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")
    model = str(ensure_demo_llava(seed=spec.seed))
    bar.update(1)
    encoded = {name: {p: 0 for p in PHASES} for name in ("plain", "mmtier")}
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="mmtier-demo-disk-") as disk:
        common = dict(model=model, kv_blocks=spec.kv_blocks, max_model_len=spec.max_model_len,
                      images_per_prompt=spec.turns)
        mm_spec = EngineSpec("mmtier", mmtier=mmtier_sizes(disk, device_bytes=spec.device_bytes,
                                                            host_bytes=spec.host_bytes,
                                                            chunk_blocks=spec.chunk_blocks),
                              encoder_cache=spec.encoder_cache, shutdown_timeout_s=None, **common)
        servers = {"plain": EngineServer(EngineSpec("plain", **common), log_path),
                   "mmtier": EngineServer(mm_spec, log_path)}
        try:
            bar.set_description_str("demo: starting both engines")
            for s in servers.values():
                s.start()
            clients = {}
            for name, s in servers.items():
                s.wait_ready()
                clients[name] = openai.OpenAI(base_url=s.base_url + "/v1", api_key="demo", max_retries=0,
                                              timeout=600)
                _warm_up(clients[name], name, s, spec)
            timings["engines_start_s"] = time.perf_counter() - t_all
            bar.update(1)
            restarted = False
            for n, (conv, i) in enumerate(order):
                phase = phase_of(spec, i)
                if phase == "later_after_restart" and not restarted:
                    for name, s in servers.items():
                        encoded[name][_prev(spec, i)] += s.encoded()
                    bar.set_description_str("demo: restarting mmtier's engine")
                    t0 = time.perf_counter()
                    if spec.flush_at_restart:
                        timings["caches_closed_at_restart"] = servers["mmtier"].close_caches()
                    else:                # a plain stop, past the write-behind's lag bound
                        timings["caches_closed_at_restart"] = 0
                        time.sleep(CacheConfig.model_fields["durable_lag_s"].default + 1.0)
                    servers["mmtier"].stop()
                    files = sorted(Path(disk).rglob("*.arrow"))
                    timings["disk_files_at_restart"] = len(files)
                    timings["disk_bytes_at_restart"] = sum(f.stat().st_size for f in files)
                    servers["mmtier"] = EngineServer(mm_spec, log_path).start()
                    servers["mmtier"].wait_ready()
                    clients["mmtier"] = openai.OpenAI(base_url=servers["mmtier"].base_url + "/v1", api_key="demo",
                                                      max_retries=0, timeout=600)
                    _warm_up(clients["mmtier"], "mmtier", servers["mmtier"], spec)
                    timings["restart_s"] = time.perf_counter() - t0
                    restarted = True
                    bar.update(1)
                bar.set_description_str(f"demo: {PHASE_TITLES[phase]}")
                if i == 0:
                    conv.messages.append({"role": "system", "content": system})
                turn = conv.turns[i]
                content: list[dict] = []
                if turn.image is not None:
                    content.append({"type": "image_url", "image_url": {"url": data_url(turn.image, turn.fmt)}})
                content.append({"type": "text", "text": turn.words})
                conv.messages.append({"role": "user", "content": content})
                got: dict[str, dict] = {}
                names = ("plain", "mmtier") if n % 2 == 0 else ("mmtier", "plain")   # paired, alternating
                for name in names:
                    time.sleep(spec.quiet_s)
                    got[name] = stream_chat(clients[name], name, conv.messages, turn.answer,
                                            allowed_token_ids=WORD_IDS)
                conv.records.append({"conversation": conv.index, "turn": i, "phase": phase, "image": turn.image,
                                     "mmtier": got["mmtier"], "plain": got["plain"], "first": names[0]})
                conv.messages.append({"role": "assistant", "content": got["mmtier"]["text"]})
                bar.update(1)
            for name, s in servers.items():
                encoded[name][phase_of(spec, spec.turns - 1)] += s.encoded()
        finally:
            bar.set_description_str("demo: stopping the engines")
            EngineServer.stop_all(servers.values())
        timings["load_1min_image_part"] = os.getloadavg()[0]       # before the media servers start
        media_records: list[dict] = []
        try:
            if spec.media is not None:
                bar.set_description_str("demo: audio and video engines")
                t0 = time.perf_counter()
                media_records = run_media(spec.media, disk, log_path, on_turn=lambda: (
                    bar.set_description_str("demo: audio and video turns"), bar.update(1)))
                timings["media_s"] = time.perf_counter() - t0
                bar.update(1)
        finally:
            bar.close()
    records = [r for c in convs for r in c.records]
    mismatches = [f"conversation {r['conversation']} turn {r['turn']}: {r['mmtier']['text']!r} != "
                  f"{r['plain']['text']!r}" for r in records if r["mmtier"]["text"] != r["plain"]["text"]]
    timings["elapsed_s"] = time.perf_counter() - t_all
    with open(out / "demo_requests.jsonl", "w") as fh:                  # every request, both engines
        for r in records + media_records:
            fh.write(json.dumps(r) + "\n")
    mismatches += [f"{r['medium']} conversation {r['conversation']} turn {r['turn']}: {r['mmtier']['text']!r} != "
                   f"{r['plain']['text']!r}" for r in media_records
                   if "encoded" not in r and r["mmtier"]["text"] != r["plain"]["text"]]
    figures = _figures(spec, convs, records, encoded, timings, mismatches)
    figures.update(media_figures(media_records))
    figures["media_turns"] = sum("encoded" not in r for r in media_records)
    return ServingDemoReport(spec, figures, mismatches, records, log_path)


def _warm_up(client, name: str, server, spec: ServingDemoSpec) -> None:
    """One request that shares nothing with the workload (its own words and image), so that no
    measured turn pays an engine's first-request costs (lazy imports, mmtier's native helpers);
    then the counting hook is installed and the encoder count reset."""
    from ..serve.tiny_models import text

    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(999_999, "PNG")}},
        {"type": "text", "text": text(999_999, spec.user_words)}]}]
    stream_chat(client, name, messages, 2)
    server.encoded()


def _prev(spec: ServingDemoSpec, turn: int) -> str:
    return phase_of(spec, turn - 1)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _figures(spec, convs, records, encoded, timings, mismatches) -> dict:
    answers = [c.turns[r["turn"]].answer for c in convs for r in c.records]
    from .engines import BLOCK
    from .model import HIDDEN, IMAGE_TOKENS, LAYERS

    f: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
        "load_1min": os.getloadavg()[0],
        "path": "openai -> vLLM OpenAI API server (python -m vllm.entrypoints.openai.api_server)",
        "model": f"random-weight LLaVA, Llama {LAYERS} layers x {HIDDEN}, {IMAGE_TOKENS} image tokens, float32",
        "conversations": spec.conversations, "turns": spec.turns, "restart_after_turns": spec.restart_after,
        "requests": 2 * len(records), "answer_tokens_median": statistics.median(answers),
        "answer_tokens_min": min(answers), "answer_tokens_max": max(answers),
        "vllm_kv_tokens": spec.kv_blocks * BLOCK, "mmtier_device_bytes": spec.device_bytes,
        "mmtier_host_bytes": spec.host_bytes,
        "check_turns": len(records), "check_mismatches": len(mismatches), **timings,
    }
    # the working set: every conversation's last prompt and answer, the shared system prompt once
    last = [c.records[-1]["plain"]["prompt_tokens"] + c.turns[len(c.records) - 1].answer for c in convs if c.records]
    system_tokens = spec.system_words + 1
    f["working_set_tokens"] = sum(last) - system_tokens * (len(last) - 1)
    f["working_set_over_vllm_kv"] = f["working_set_tokens"] / f["vllm_kv_tokens"]
    for phase in (*PHASES, "later_turns"):
        sel = [r for r in records if (r["phase"] == phase or (phase == "later_turns" and r["turn"] > 0))]
        f[f"requests__{phase}"] = len(sel)
        for name, (prompt, cached, fraction) in token_counts(sel).items():
            f[f"prompt_tokens_{name}__{phase}"] = prompt
            f[f"cached_tokens_{name}__{phase}"] = cached
            f[f"cached_fraction_{name}__{phase}"] = fraction
            f[f"ttft_s_{name}__{phase}"] = _median([r[name]["ttft_s"] for r in sel])
            if phase != "later_turns":
                f[f"encoder_runs_{name}__{phase}"] = encoded[name][phase]
        f[f"ttft_mmtier_over_plain__{phase}"] = _median(
            [r["mmtier"]["ttft_s"] / r["plain"]["ttft_s"] for r in sel if r["plain"]["ttft_s"] > 0])
        f[f"answers_equal__{phase}"] = sum(r["mmtier"]["text"] == r["plain"]["text"] for r in sel)
    f["encoder_runs_mmtier__later_turns"] = sum(encoded["mmtier"][p] for p in PHASES[1:])
    f["encoder_runs_plain__later_turns"] = sum(encoded["plain"][p] for p in PHASES[1:])
    f["images_sent"] = sum(sum(t.image is not None for t in c.turns[: r["turn"] + 1]) for c in convs
                           for r in c.records)
    _modality_figures(f, records, encoded)
    _share_figures(f, convs)
    f["target_later_turns_ttft_ratio"] = TARGET_RATIO
    f["target_met"] = bool(f["ttft_mmtier_over_plain__later_turns"] <= TARGET_RATIO and not mismatches)
    return f


def _share_figures(f: dict, convs: list[Conversation]) -> None:
    """Per later turn, the share of what the previous turn had (its prompt and its answer, whole
    blocks of 32: all but the answer's last token have KV) that the turn found cached, per
    engine; the median and the lowest over the turns, and the median per turn index."""
    from .engines import BLOCK

    per_turn: dict[int, dict[str, list[float]]] = {}
    for c in convs:
        for prev, r in zip(c.records, c.records[1:]):
            had = (prev["plain"]["prompt_tokens"] + prev["mmtier"]["completion_tokens"] - 1) // BLOCK * BLOCK
            for name in ("mmtier", "plain"):
                share = min(r[name]["cached_tokens"], had) / had if had else 0.0
                per_turn.setdefault(r["turn"], {}).setdefault(name, []).append(share)
    for name in ("mmtier", "plain"):
        every = [x for t in per_turn.values() for x in t[name]]
        f[f"previous_turn_share_{name}__median"] = _median(every) if every else 0.0
        f[f"previous_turn_share_{name}__min"] = min(every) if every else 0.0
        for turn, by in sorted(per_turn.items()):
            f[f"previous_turn_share_{name}__turn{turn}"] = _median(by[name])


def _modality_figures(f: dict, records: list[dict], encoded: dict) -> None:
    """The image part per modality: ``text`` its turns without an image, ``image`` those with
    one (items sent: every image of the prompts, history included; tower runs: every phase)."""
    for modality, sel in (("text", [r for r in records if r["image"] is None]),
                          ("image", [r for r in records if r["image"] is not None])):
        f[f"{modality}__requests"] = len(sel)
        for name, (prompt, cached, fraction) in token_counts(sel).items():
            f[f"{modality}__prompt_tokens_{name}"] = prompt
            f[f"{modality}__cached_tokens_{name}"] = cached
            f[f"{modality}__cached_fraction_{name}"] = fraction
        f[f"{modality}__answers_equal"] = sum(r["mmtier"]["text"] == r["plain"]["text"] for r in sel)
    f["image__items_sent"] = f["images_sent"]
    for name in ("mmtier", "plain"):
        f[f"image__encoder_runs_{name}"] = sum(encoded[name].values())
        f[f"image__encoder_runs_avoided_{name}"] = f["images_sent"] - f[f"image__encoder_runs_{name}"]


def modality_table(f: dict) -> list[str]:
    """The per-modality lines of the console report (the modalities the figures have)."""
    lines = [f"{'modality':<10}{'req':>5}{'items sent':>12}{'tower runs mmtier/plain':>25}{'cached mmtier':>15}"
             f"{'cached plain':>14}{'equal':>8}"]
    for m in ("text", "image", *MEDIA):
        if f"{m}__requests" not in f:
            continue
        items = f.get(f"{m}__items_sent", "-")
        runs = (f"{f[f'{m}__encoder_runs_mmtier']}/{f[f'{m}__encoder_runs_plain']}"
                if f"{m}__encoder_runs_mmtier" in f else "-")
        lines.append(f"{m:<10}{f[f'{m}__requests']:>5}{items:>12}{runs:>25}"
                     f"{100 * f[f'{m}__cached_fraction_mmtier']:>14.0f}%{100 * f[f'{m}__cached_fraction_plain']:>13.0f}%"
                     f"{f[f'{m}__answers_equal']:>5}/{f[f'{m}__requests']}")
    return lines


def format_serving_report(r: ServingDemoReport, json_path: Path | None = None, png_path: Path | None = None) -> str:
    f = r.figures
    lines = [
        f"mmtier demo: {f['conversations']} conversations x {f['turns']} turns, interleaved, images reused; "
        f"answers of {f['answer_tokens_min']}-{f['answer_tokens_max']} tokens (median {f['answer_tokens_median']:.0f})",
        f"engines: vLLM OpenAI API server, prefix caching on, KV pool {f['vllm_kv_tokens']} tokens "
        f"(working set {f['working_set_tokens']} tokens: {f['working_set_over_vllm_kv']:.1f}x); "
        f"mmtier adds a {f['mmtier_device_bytes'] >> 20} MiB page pool, {f['mmtier_host_bytes'] >> 20} MiB host "
        f"tier and a disk tier, and restarts after turn {f['restart_after_turns']}",
        f"model: {f['model']}",
        "",
        f"{'phase':<24}{'req':>4}{'cached mmtier':>15}{'cached plain':>14}{'TTFT mmtier':>13}{'TTFT plain':>12}"
        f"{'paired':>8}{'encoder':>9}{'equal':>7}",
    ]
    for p in (*PHASES, "later_turns"):
        enc = (f"{f[f'encoder_runs_mmtier__{p}']}/{f[f'encoder_runs_plain__{p}']}")
        lines.append(
            f"{PHASE_TITLES.get(p, 'later turns (all)'):<24}{f[f'requests__{p}']:>4}"
            f"{100 * f[f'cached_fraction_mmtier__{p}']:>14.0f}%{100 * f[f'cached_fraction_plain__{p}']:>13.0f}%"
            f"{f[f'ttft_s_mmtier__{p}'] * 1e3:>11.0f}ms{f[f'ttft_s_plain__{p}'] * 1e3:>10.0f}ms"
            f"{f[f'ttft_mmtier_over_plain__{p}']:>7.2f}x{enc:>9}{f[f'answers_equal__{p}']:>4}/{f[f'requests__{p}']}")
    ratio = f["ttft_mmtier_over_plain__later_turns"]
    lines += [
        "(cached: prompt tokens served from cache; paired: median over turns of mmtier's TTFT / plain's; "
        "encoder: images the vision tower encoded, mmtier/plain)",
        "",
        *modality_table(f),
        "(text: turns without an image; image: turns with one; audio / video: the tiny Qwen2-Audio and "
        "Qwen2-VL, items reused across turns and users, no times: see benchmarks/engines/vllm_av.py; items sent: "
        "in every prompt, history included; tower runs: items the encoder towers ran on)",
        "",
        f"share of the previous turn's prompt and answer found cached (median over later turns): "
        f"{f['previous_turn_share_mmtier__median']:.2f} with mmtier (lowest "
        f"{f['previous_turn_share_mmtier__min']:.2f}), {f['previous_turn_share_plain__median']:.2f} plain vLLM",
        f"later turns start in {ratio:.2f}x the time with mmtier (target <= {TARGET_RATIO}): "
        f"{'MET' if f['target_met'] else 'NOT MET'}",
        f"correctness: {f['check_turns'] + f['media_turns'] - f['check_mismatches']}/"
        f"{f['check_turns'] + f['media_turns']} answers equal the engine "
        f"without mmtier: {'PASSED' if r.passed else 'FAILED'}",
    ]
    lines += [f"  {m}" for m in r.mismatches[:5]]
    lines.append(f"engines start {f['engines_start_s']:.0f} s, restart {f.get('restart_s', float('nan')):.0f} s; "
                 f"whole run {f['elapsed_s']:.0f} s; load {f['load_1min_image_part']:.1f} after the image part, "
                 f"{f['load_1min']:.1f} at the end ({f['machine']})")
    lines.append(f"engine and HTTP logs: {r.log_path}")
    if json_path is not None:
        lines.append(f"report: {json_path}")
    if png_path is not None:
        lines.append(f"chart: {png_path}")
    return "\n".join(lines)
