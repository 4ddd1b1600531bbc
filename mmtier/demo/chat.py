"""``mmtier demo``: a multi-turn multimodal chat workload through mmtier on an embedded local Ray,
on a real architecture through the transformers adapter.

What it does, in order:

1. starts a local Ray bound to 127.0.0.1 and mmtier on it (``mmtier.cluster.start``: the
   ContentRegistry and a node store), and a ``ChatEngine`` actor
   (``mmtier.chat.actor``) that runs the chat model and holds its own pool
   (``PoolHost``): attention reads local pages, the cluster is asked only at turn boundaries;
2. the chat model (``mmtier.chat.model.ChatModel.tiny``): a small random-weight Qwen2-VL
   (``configs/demo-qwen2-vl.json``) whose images are real PNG / JPEG bytes decoded by its own
   image processor and whose videos are real MP4 bytes (encoded here by PyAV, decoded and
   sampled at 2 fps by ``video_frames``), and a small random-weight Whisper (``configs/demo-whisper.json``) that
   transcribes audio clips (real WAV bytes, through ``WhisperFeatureExtractor``) into the
   conversation; text is byte-level;
3. runs a seeded workload: several tenants, each with a few conversations of several turns;
   turns carry text, images (a small per-tenant catalogue plus images every tenant sends, so
   repeats are frequent), a video (every conversation's second turn: a tenant's short clip, a
   few segments of the ``video`` pool) and audio clips; a few conversations are open at once. A later turn
   attaches the history's groups, prefills only its new tokens and runs no encoder for cached
   media;
4. keeps the pool under pressure so content moves between tiers: the arena is small (groups
   demote to the pool's disk tier and are dropped at the bottom), and when a modality's device
   pages pass a watermark the groups of finished conversations are handed to the node store
   (``HostedCache.offload``, the node's host tier);
5. checks correctness and times the dense path side by side: right after each turn, the same
   engine recomputes the conversation so far with ``DynamicCache`` + sdpa and no reuse
   (``dense_turn``: every image and clip encoded again, every position prefilled), and the
   tokens must be equal; ``later_turns_cached_over_dense`` is the median later turn with the
   cache over the median later turn without;
6. prints a table, and writes a flat JSON report and a PNG chart.
"""

from __future__ import annotations

import datetime as _dt
import io
import os
import random
import statistics
import tempfile
import time
import wave
from collections import Counter
from dataclasses import dataclass, field

from ..stats.machine import machine

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # Ray binds 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MEDIA_NAMES = {"vision": "image", "video": "video", "audio": "audio"}
PROMPTS = ("Describe this. ", "What changed? ", "Summarise it. ", "Any text in it? ",
           "Compare with before. ", "What is the mood? ", "Count the objects. ", "Transcribe. ")
IMAGE_SIZES = ((336, 336), (392, 294), (280, 364))     # 144, 140 and 130 decoder tokens after resizing
VIDEO_SIZE, VIDEO_FPS = (112, 112), 4                  # 16 decoder tokens a temporal patch (2 sampled frames)


@dataclass(frozen=True)
class DemoSpec:
    """The workload. ``quick()`` is a smaller one with the same checks."""

    tenants: int = 3
    conversations: int = 3            # per tenant
    turns: int = 3                    # per conversation
    active: int = 2                   # conversations open at once
    new_tokens: int = 8               # greedy tokens per answer
    images_per_tenant: int = 2        # private images of a tenant
    shared_images: int = 2            # images every tenant sends (tenant-salted: never shared across)
    clips_per_tenant: int = 2
    videos_per_tenant: int = 2        # a tenant's videos (4 s and 6 s: 2 and 3 segments)
    device_bytes: int = 40 << 20      # the pool's page arena: small, so content moves
    spill_watermark: float = 0.5      # of a modality's device pages
    copy_after_remote_uses: int = 1   # a spilled group's next use restores it to the pool
    seed: int = 0

    @classmethod
    def quick(cls, **kw) -> DemoSpec:
        return cls(**{"tenants": 2, "conversations": 2, "turns": 2, "new_tokens": 4,
                      "images_per_tenant": 1, "device_bytes": 32 << 20, **kw})

    @property
    def shares(self) -> dict[str, float]:
        """Arena shares per pool of the chat model."""
        return {"text": 0.32, "vision": 0.27, "vision_embed": 0.06, "video": 0.1, "video_embed": 0.03,
                "transcript": 0.035, "audio": 0.18, "transcript_ids": 0.005}


@dataclass
class Conversation:
    tenant: str
    turns: list[list]                  # prompt items per turn
    answers: list[list[int]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    dense_answers: list[list[int]] = field(default_factory=list)
    dense_seconds: list[float] = field(default_factory=list)       # each turn recomputed without a cache
    counters: list[dict] = field(default_factory=list)
    boundary_seconds: list[float] = field(default_factory=list)    # begin_turn + end_turn, per turn
    calls: list[dict] = field(default_factory=list)                # the engine's Ray calls, per turn


def image_bytes(tag: str, size: tuple[int, int], fmt: str) -> bytes:
    """A seeded picture (gradient, rectangles, noise) as PNG or JPEG bytes."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(_seed(tag))
    w, h = size
    base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * rng.random(3)[None, None, :]
    arr = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
    im = Image.fromarray(arr)
    draw = ImageDraw.Draw(im)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 20))
        draw.rectangle((x0, y0, x0 + int(rng.integers(10, w // 2)), y0 + int(rng.integers(10, h // 2))),
                       fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def audio_bytes(tag: str, seconds: float, rate: int = 16000) -> bytes:
    """A seeded clip (two tones and noise) as WAV PCM16 mono bytes."""
    import numpy as np

    rng = np.random.default_rng(_seed(tag))
    t = np.arange(int(seconds * rate)) / rate
    f1, f2 = rng.uniform(150, 900, 2)
    x = 0.3 * np.sin(2 * np.pi * f1 * t) + 0.2 * np.sin(2 * np.pi * f2 * t) + 0.05 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def video_bytes(tag: str, seconds: float) -> bytes:
    """A seeded clip (a gradient and a rectangle moving across it) as MP4 bytes (MPEG-4 Part 2,
    encoded by PyAV)."""
    import av
    import numpy as np

    rng = np.random.default_rng(_seed(tag))
    (w, h), frames = VIDEO_SIZE, int(seconds * VIDEO_FPS)
    base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * rng.random(3)[None, None, :]
    colour, (dx, dy) = rng.integers(0, 256, 3), rng.integers(2, 8, 2)
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            arr = np.clip(base + rng.normal(0, 10, (h, w, 3)), 0, 255).astype(np.uint8)
            x, y = (i * dx) % (w - 24), (i * dy) % (h - 24)
            arr[y:y + 24, x:x + 24] = colour
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def _seed(tag: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(tag.encode()).digest()[:4], "little")


def workload(spec: DemoSpec) -> list[Conversation]:
    """Seeded conversations, in the order they start."""
    rng = random.Random(spec.seed)

    def picture(tag: str, i: int) -> bytes:
        return image_bytes(f"{spec.seed}:{tag}", IMAGE_SIZES[i % len(IMAGE_SIZES)], "PNG" if i % 2 == 0 else "JPEG")

    shared = [picture(f"shared-image-{i}", i) for i in range(spec.shared_images)]
    convs = []
    for _ in range(spec.conversations):
        for t in range(spec.tenants):
            tenant = f"tenant-{t}"
            images = [picture(f"{tenant}-image-{i}", i + 1) for i in range(spec.images_per_tenant)] + shared
            clips = [audio_bytes(f"{spec.seed}:{tenant}-clip-{i}", 1.5 + i) for i in range(spec.clips_per_tenant)]
            videos = [video_bytes(f"{spec.seed}:{tenant}-video-{i}", 4 + 2 * i) for i in range(spec.videos_per_tenant)]
            system = f"You are {tenant}'s assistant. "
            turns = []
            for i in range(spec.turns):
                # a conversation opens with the tenant's system prompt and an image: the same
                # prefix, so a popular opening image's decoder K/V is reused (prefix-dependent)
                items: list = [system, "Look at this. "] if i == 0 else [rng.choice(PROMPTS)]
                if i == 0 or rng.random() < 0.75:        # images repeat (low indices are popular)
                    items.append(images[min(int(rng.expovariate(0.9)), len(images) - 1)])
                if i == 1 and videos:                    # the video turn (the first video is popular)
                    items += ["Watch: ", videos[min(int(rng.expovariate(1.2)), len(videos) - 1)]]
                if rng.random() < 0.4:
                    items += ["Listen: ", rng.choice(clips)]
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

    from .. import cluster
    from ..chat.actor import ChatEngine
    from ..chat.model import ChatModel
    from ..cluster.engine_pool import host_name

    torch.set_num_threads(1)
    convs = workload(spec)
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mmtier-demo-") as disk:
        cfg = ChatModel.tiny(spec.seed).cache_config(device_bytes=spec.device_bytes, shares=spec.shares,
                                                     disk_dir=disk, disk_bytes=256 << 20)
        settings = cluster.ClusterSettings(namespace="mmtier-demo", copy_after_remote_uses=spec.copy_after_remote_uses,
                                          store_bytes=128 << 20, sweep_interval_s=5.0)
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20,
                 _node_ip_address="127.0.0.1", namespace=settings.namespace, log_to_driver=False,
                 configure_logging=False)
        try:
            started = cluster.start(cfg, settings)
            node = ray.get_runtime_context().get_node_id()
            engine = ray.remote(ChatEngine).options(
                name=host_name(node), namespace=settings.namespace, num_cpus=0, max_concurrency=2,
            ).remote(settings.model_dump(mode="json"), spec.seed)
            ray.get(engine.ping.remote(), timeout=settings.start_timeout_s)
            ray_start_s = time.perf_counter() - t_all
            moved = _run(spec, convs, engine, progress)
            pool = ray.get(engine.stats.remote(), timeout=60)
            runs = ray.get(engine.encoder_runs.remote(), timeout=60)
            with cluster.connect(settings) as cc:
                per_actor = cc.actor_stats()
        finally:
            cluster.shutdown(settings)
            ray.shutdown()
    elapsed = time.perf_counter() - t_all
    mismatches = _check(convs)
    figures = _figures(spec, convs, pool, runs, moved, mismatches, started, per_actor, ray_start_s, elapsed)
    return DemoReport(spec, figures, [s for c in convs for s in c.seconds],
                      [s for c in convs for s in c.dense_seconds],
                      [i for c in convs for i in range(len(c.seconds))], mismatches)


def _run(spec: DemoSpec, convs: list[Conversation], engine, progress: bool) -> Counter:
    """Every turn through the engine, ``active`` conversations interleaved turn by turn; right
    after each, the same turn recomputed densely by the same engine (same process, same
    machine state). Returns what moved to the node store."""
    import ray
    from tqdm import tqdm

    moved: Counter = Counter()
    pending = list(convs)
    open_: list[tuple[Conversation, int, list]] = []          # conversation, its id, its keys
    finished: list[list] = []                       # keys of closed conversations, oldest first
    bar = tqdm(total=sum(len(c.turns) for c in convs), desc="turns (with cache, then dense)", unit="turn",
               disable=not progress, leave=False)
    while pending or open_:
        while pending and len(open_) < spec.active:
            c = pending.pop(0)
            open_.append((c, ray.get(engine.open.remote(c.tenant), timeout=60), []))
        for entry in list(open_):
            c, sid, keys = entry
            i = len(c.answers)
            r = ray.get(engine.turn.remote(sid, c.turns[i], spec.new_tokens), timeout=300)
            c.answers.append(r["tokens"])
            c.seconds.append(r["seconds"])
            c.counters.append(r["counters"])
            c.boundary_seconds.append(r["boundary_seconds"])
            c.calls.append(r["calls"])
            keys[:] = r["keys"]
            history = list(zip(c.turns[:i], c.dense_answers))
            d = ray.get(engine.dense_turn.remote(history, c.turns[i], spec.new_tokens), timeout=300)
            c.dense_answers.append(d["tokens"])
            c.dense_seconds.append(d["seconds"])
            bar.update(1)
            if len(c.answers) == len(c.turns):
                finished.append(list({w["digest"]: w for w in keys}.values()))
                ray.get(engine.close_session.remote(sid), timeout=60)
                open_.remove(entry)
                in_use = {w["digest"] for _, _, o in open_ for w in o}
                _spill(spec, engine, finished, in_use, moved)
    bar.close()
    return moved


def _spill(spec: DemoSpec, engine, finished: list[list], in_use: set, moved: Counter) -> None:
    """Hand the oldest finished conversations' groups to the node store while a modality's
    device pages are above the watermark (the engine's pool)."""
    import ray

    def over() -> set[str]:
        dev = ray.get(engine.stats.remote(), timeout=60)["tiers"].get("device", {})
        return {m for m, u in dev.items() if u["capacity_bytes"] and u["bytes"] > spec.spill_watermark * u["capacity_bytes"]}

    hot = over()
    while hot and finished:
        wires = [w for w in finished.pop(0) if w["modality"] in hot and w["digest"] not in in_use]
        if wires:
            n, nbytes = ray.get(engine.spill.remote(wires), timeout=120)
            moved["spills"] += n
            moved["spill_bytes"] += nbytes
        hot = over()


def _check(convs: list[Conversation]) -> list[str]:
    """Every turn's tokens against the dense path's."""
    out = []
    for n, c in enumerate(convs):
        for i, (got, want) in enumerate(zip(c.answers, c.dense_answers)):
            if got != want:
                out.append(f"conversation {n} ({c.tenant}) turn {i}: cache {got} != dense {want}")
        if len(c.answers) != len(c.dense_answers):
            out.append(f"conversation {n} ({c.tenant}): {len(c.answers)} turns, {len(c.dense_answers)} dense")
    return out


def _figures(spec, convs, pool, runs, moved, mismatches, started, per_actor, ray_start_s, elapsed) -> dict:
    cache_s = [s for c in convs for s in c.seconds]
    nocache_s = [s for c in convs for s in c.dense_seconds]
    later = [s for c in convs for s in c.seconds[1:]]
    later_nc = [s for c in convs for s in c.dense_seconds[1:]]
    ctr = [x for c in convs for x in c.counters]
    fig: dict[str, object] = {
        "model": "qwen2_vl + whisper (random weights, configs/demo-*.json) through the transformers adapter",
        "tenants": spec.tenants, "conversations": len(convs), "turns": len(cache_s),
        "new_tokens": spec.new_tokens, "device_bytes_per_pool": spec.device_bytes,
        "ray_nodes": len(started.nodes),
        "pools": sum(n.startswith("mmtier-pool:") for n in per_actor),
        "stores": sum(n.startswith("mmtier-store:") for n in per_actor),
    }
    kinds = {"vision": lambda x: isinstance(x, bytes) and not x.startswith(b"RIFF") and x[4:8] != b"ftyp",
             "video": lambda x: isinstance(x, bytes) and x[4:8] == b"ftyp",
             "audio": lambda x: isinstance(x, bytes) and x.startswith(b"RIFF")}
    for m, name in MEDIA_NAMES.items():
        fig[f"{name}_placements"] = sum(kinds[m](x) for c in convs for t in c.turns for x in t)
        fig[f"{name}_hits"] = sum(x["media_hits"].get(m, 0) for x in ctr)     # video: segments
        fig[f"{name}_encoder_runs"] = runs["cache"].get(m, 0)
        fig[f"{name}_encoder_runs_dense"] = runs["dense"].get(m, 0)
    fig["image_embedding_hits"] = sum(x["embedding_hits"] for x in ctr)
    fig["video_embedding_hits"] = sum(x["video_embedding_hits"] for x in ctr)     # segments
    fig["span_hits"] = sum(x["span_hits"] for x in ctr)
    fig["span_misses"] = sum(x["span_misses"] for x in ctr)
    fig["prompt_tokens_cached"] = sum(x["cached_tokens"] for x in ctr)
    fig["prompt_tokens_prefilled"] = sum(x["prefilled_tokens"] for x in ctr)
    fig["transcript_tokens"] = sum(x["transcript_tokens"] for x in ctr)
    stats = pool["tiers"]
    for tier in ("device", "disk"):
        per = stats.get(tier, {})
        fig[f"{tier}_bytes"] = sum(u["bytes"] for u in per.values())
        fig[f"{tier}_capacity_bytes"] = sum(u["capacity_bytes"] for u in per.values()) if tier == "device" \
            else max((u["capacity_bytes"] for u in per.values()), default=0)
        for group in GROUPS:
            fig[f"{tier}_bytes_{group}"] = sum(u["bytes"] for mm, u in per.items() if mm in _group_modalities(group))
    store = Counter()
    host = Counter()
    for name, st in per_actor.items():
        if name.startswith("mmtier-store:"):
            store.update(st.get("counters", {}))
            for mm, u in st.get("tiers", {}).get("host", {}).items():
                host[mm] += u["bytes"]
    fig["host_bytes"] = sum(host.values())
    for group in GROUPS:
        fig[f"host_bytes_{group}"] = sum(b for mm, b in host.items() if mm in _group_modalities(group))
    fig["spills"] = store["puts"]                      # groups the node store took from the pool
    fig["spill_bytes"] = moved["spill_bytes"]
    fig["spilled_groups_freed"] = moved["spills"]      # ... whose device pages were freed at once
    fig["restores"] = store["exports"]                 # groups copied back from the store to a pool
    counters = pool.get("counters", {})
    fig["demotions_to_disk"] = counters.get("spills_to_disk", 0)     # device -> the pool's disk tier
    fig["disk_restores"] = counters.get("restores", 0)                # ... and back
    fig["evictions"] = counters.get("evictions", 0)
    fig["turn_s_cache_mean"] = statistics.mean(cache_s)
    fig["turn_s_cache_median"] = statistics.median(cache_s)
    fig["turn_s_nocache_mean"] = statistics.mean(nocache_s)
    fig["turn_s_nocache_median"] = statistics.median(nocache_s)
    fig["turn_s_cache_first_turns"] = statistics.mean(c.seconds[0] for c in convs)
    fig["turn_s_nocache_first_turns"] = statistics.mean(c.dense_seconds[0] for c in convs)
    if later:
        fig["turn_s_cache_later_turns"] = statistics.median(later)
        fig["turn_s_nocache_later_turns"] = statistics.median(later_nc)
        # the headline: later turns' median time with the cache over without it (same run, same process)
        fig["later_turns_cached_over_dense"] = statistics.median(later) / statistics.median(later_nc)
    calls = [x for c in convs for x in c.calls]
    for kind in ("lookup", "fetch", "publish"):      # per turn: at most 1 lookup and 1 publish
        fig[f"max_{kind}_calls_per_turn"] = max((x.get(kind, 0) for x in calls), default=0)
        fig[f"{kind}_calls"] = sum(x.get(kind, 0) for x in calls)
    fig["turn_boundary_s_median"] = statistics.median(s for c in convs for s in c.boundary_seconds)
    fig["nocache_over_cache_time"] = statistics.mean(nocache_s) / statistics.mean(cache_s)
    fig["encoder_runs_cache"] = sum(runs["cache"].values())
    fig["encoder_runs_nocache"] = sum(runs["dense"].values())
    fig["dense_check_turns"] = len(cache_s)
    fig["dense_check_mismatches"] = len(mismatches)
    fig["dense_check_passed"] = not mismatches
    fig["ray_start_s"] = ray_start_s
    fig["elapsed_s"] = elapsed
    fig["baseline"] = ("without cache = the conversation so far recomputed by the same models with DynamicCache "
                       "+ sdpa (dense_turn: every image, video and clip encoded again, every position prefilled), "
                       "in the engine's process right after the cached turn")
    fig["machine"] = machine()
    fig["date"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return fig


GROUPS = ("text", "image", "video", "audio")        # the report's columns of bytes per tier


def _group_modalities(group: str) -> set[str]:
    return {"text": {"text"}, "image": {"vision", "vision_embed"}, "video": {"video", "video_embed"},
            "audio": {"audio", "transcript", "transcript_ids"}}[group]
