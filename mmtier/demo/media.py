"""The serving demo's audio and video part: multi-turn chats with audio clips (``input_audio``, WAV)
and videos (``video_url``, an MP4 data URL) sent with the ``openai`` client to vLLM's OpenAI API
server, plain and with mmtier's connectors, the way the image part does (``mmtier.demo.serving``):

- models: the tiny Qwen2-Audio (``mmtier.serve.tiny_audio``) for audio and the tiny Qwen2-VL
  (``mmtier.serve.tiny_video``, its video processor through mmtier's vLLM plugin) for video, one
  pair of servers per medium, both with vLLM's prefix cache on and a KV pool smaller than the
  conversations;
- the workload: conversations (a user each) whose every turn carries a clip or a video from a
  small catalogue with a skew, so an item recurs across turns and users, and interleave turn by
  turn; every turn goes to both servers, paired and alternating; greedy answers must be equal;
- per medium: items sent (a request carries every item of its conversation so far), the items
  each engine's tower encoded (counted in its workers; the rest are runs avoided), cached prompt
  tokens, answers equal.

The models are tiny (2 layers, width 128): their prefill costs too little for times to say
anything, so none are reported here (every request's are in the demo's request log); the
times of a repeated audio or video prompt at a prefill-dominated shape are
``benchmarks/engines/vllm_av.py --lm 8x512``'s. The four servers start side by side and run one after
the other."""

from __future__ import annotations

import base64
import io
import random
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path

MEDIA = ("audio", "video")


@dataclass(frozen=True)
class MediaDemoSpec:
    conversations: int = 4              # per medium
    turns: int = 3
    items: int = 3                      # the catalogue per medium
    user_words: int = 120
    clip_seconds: float = 2.0           # 50 audio tokens
    video_frames: int = 16              # 32 video tokens
    video_fps: int = 4
    kv_blocks: int = 24                 # vLLM's KV block pool, blocks of 32 tokens (both engines)
    max_tokens: int = 8
    quiet_s: float = 0.0                # no times are reported here (see the module's docstring)
    seed: int = 0

    @classmethod
    def quick(cls, seed: int = 0, **kw) -> MediaDemoSpec:
        return cls(**{"conversations": 4, "turns": 2, "items": 2, "user_words": 30, "clip_seconds": 1.0,
                      "video_frames": 8, "kv_blocks": 8, **kw, "seed": seed})

    @property
    def max_model_len(self) -> int:
        return self.kv_blocks * 32 - 64


@dataclass
class MediaTurn:
    words: str
    item: int                           # the catalogue's item (a seed)


@dataclass
class MediaConversation:
    index: int
    turns: list[MediaTurn]
    messages: list[dict] = field(default_factory=list)


def media_workload(spec: MediaDemoSpec, medium: str) -> list[MediaConversation]:
    """Seeded conversations; every turn carries an item of the catalogue, low seeds popular."""
    from ..serve.tiny_models import text

    rng = random.Random(f"{spec.seed}-{medium}")
    return [MediaConversation(c, [MediaTurn(text(rng.randrange(1 << 30), spec.user_words),
                                            1 + min(int(rng.expovariate(0.8)), spec.items - 1))
                                  for _ in range(spec.turns)])
            for c in range(spec.conversations)]


def wav_bytes(seed: int, seconds: float) -> bytes:
    """The tiny audio model's clip ``seed`` (``tiny_audio.clip``) as 16 kHz PCM16 mono WAV."""
    import numpy as np

    from ..serve.tiny_audio import SAMPLE_RATE, clip

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes((np.clip(clip(seed, seconds), -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def mp4_bytes(seed: int, frames: int, fps: int) -> bytes:
    """The tiny video model's frames ``seed`` (``tiny_video.frames``) as an H.264 MP4 (PyAV)."""
    import av

    from ..serve.tiny_video import frames as video_frames

    out = io.BytesIO()
    pixels = video_frames(seed, frames)
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = pixels[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for frame in pixels:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def media_part(medium: str, item: int, spec: MediaDemoSpec) -> dict:
    """The OpenAI content part of an item: ``input_audio`` (WAV) or ``video_url`` (MP4 data URL)."""
    if medium == "audio":
        data = base64.b64encode(wav_bytes(item, spec.clip_seconds)).decode()
        return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    data = base64.b64encode(mp4_bytes(item, spec.video_frames, spec.video_fps)).decode()
    return {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{data}"}}


def media_engines(medium: str, spec: MediaDemoSpec, disk: str, *, device_bytes: int, host_bytes: int):
    """The (plain, mmtier) engine specs of ``medium``'s tiny model."""
    from ..serve.tiny_audio import ensure_tiny_qwen2_audio
    from ..serve.tiny_models import HEAD_DIM, KV_HEADS, LAYERS
    from ..serve.tiny_video import ensure_tiny_qwen2_vl
    from .engines import EngineSpec, mmtier_sizes

    model = str(ensure_tiny_qwen2_audio() if medium == "audio" else ensure_tiny_qwen2_vl())
    common = dict(model=model, kv_blocks=spec.kv_blocks, max_model_len=spec.max_model_len, mm_limits={medium: spec.turns},
                  token_kv_bytes=2 * LAYERS * KV_HEADS * HEAD_DIM * 4)
    return (EngineSpec(f"plain-{medium}", **common),
            EngineSpec(f"mmtier-{medium}", mmtier=mmtier_sizes(Path(disk) / medium, device_bytes=device_bytes,
                                                              host_bytes=host_bytes), **common))


def run_media(spec: MediaDemoSpec, disk: str, log_path: Path, *, media: tuple[str, ...] = MEDIA,
              device_bytes: int = 64 << 20, host_bytes: int = 128 << 20, on_turn=None) -> list[dict]:
    """Start every medium's two servers side by side, send each medium's turns to its pair
    (paired, alternating), stop them; one record a turn (both engines' answers, usage and time
    to first token) and one ``{"medium": m, "encoded": {...}}`` record a medium of the items its
    towers encoded per engine."""
    import openai

    from .engines import EngineServer
    from .streaming import stream_chat

    specs = {m: dict(zip(("plain", "mmtier"), media_engines(m, spec, disk, device_bytes=device_bytes,
                                                            host_bytes=host_bytes), strict=True)) for m in media}
    servers = {m: {name: EngineServer(s, log_path) for name, s in pair.items()} for m, pair in specs.items()}
    every = [s for pair in servers.values() for s in pair.values()]
    records: list[dict] = []
    try:
        for s in every:
            s.start()
        for s in every:
            s.wait_ready()
            s.encoded()                                  # the hooks in, the count at 0
        for m in media:
            clients = {name: openai.OpenAI(base_url=s.base_url + "/v1", api_key="demo", max_retries=0, timeout=600)
                       for name, s in servers[m].items()}
            convs = media_workload(spec, m)
            for n, (conv, i) in enumerate([(c, i) for i in range(spec.turns) for c in convs]):
                turn = conv.turns[i]
                conv.messages.append({"role": "user", "content": [media_part(m, turn.item, spec),
                                                                  {"type": "text", "text": turn.words}]})
                got: dict[str, dict] = {}
                names = ("plain", "mmtier") if n % 2 == 0 else ("mmtier", "plain")
                for name in names:
                    time.sleep(spec.quiet_s)
                    got[name] = stream_chat(clients[name], specs[m][name].name, conv.messages, spec.max_tokens)
                records.append({"medium": m, "conversation": conv.index, "turn": i, "item": turn.item,
                                "items_in_prompt": i + 1, "mmtier": got["mmtier"], "plain": got["plain"],
                                "first": names[0]})
                conv.messages.append({"role": "assistant", "content": got["mmtier"]["text"]})
                if on_turn is not None:
                    on_turn()
            records.append({"medium": m, "encoded": {name: s.encoded() for name, s in servers[m].items()}})
    finally:
        EngineServer.stop_all(every)
    return records


def token_counts(records: list[dict]) -> dict[str, tuple[int, int, float]]:
    """Per engine (``mmtier``, ``plain``) over ``records``: prompt tokens, cached prompt tokens
    and the cached fraction."""
    out = {}
    for name in ("mmtier", "plain"):
        prompt = sum(r[name]["prompt_tokens"] for r in records)
        cached = sum(r[name]["cached_tokens"] for r in records)
        out[name] = (prompt, cached, cached / prompt if prompt else 0.0)
    return out


def media_figures(records: list[dict]) -> dict:
    """Per medium: items sent (a request carries every item of its conversation so far), the
    items each engine's tower encoded and those mmtier's engine did not, cached prompt tokens,
    answers equal. No times: the tiny models' prefill costs too little to say anything."""
    f: dict = {}
    for medium in MEDIA:
        turns = [r for r in records if r.get("medium") == medium and "encoded" not in r]
        if not turns:
            continue
        encoded = next(r["encoded"] for r in records if r.get("medium") == medium and "encoded" in r)
        sent = sum(r["items_in_prompt"] for r in turns)
        f[f"{medium}__requests"] = len(turns)
        f[f"{medium}__items_sent"] = sent
        f[f"{medium}__items_distinct"] = len({r["item"] for r in turns})
        for name, (prompt, cached, fraction) in token_counts(turns).items():
            f[f"{medium}__encoder_runs_{name}"] = encoded[name]
            f[f"{medium}__encoder_runs_avoided_{name}"] = sent - encoded[name]
            f[f"{medium}__prompt_tokens_{name}"] = prompt
            f[f"{medium}__cached_tokens_{name}"] = cached
            f[f"{medium}__cached_fraction_{name}"] = fraction
        f[f"{medium}__answers_equal"] = sum(r["mmtier"]["text"] == r["plain"]["text"] for r in turns)
    return f
