"""A multimodal chat model on mmtier: a Qwen2-VL decoder with its vision tower, and Whisper for
audio, both through the transformers adapter over ONE cache (one process holds one pool).

Interface (names kept stable; the Serve app builds on them)::

    from mmtier import TieredKVCache
    from mmtier.chat.model import ChatModel, dense_chat

    chat = ChatModel.tiny(seed=0)                # random weights from configs/demo-*.json
    chat = ChatModel.from_pretrained("qwen2-vl-dir", "whisper-dir")   # local_files_only=True
    cache = TieredKVCache(chat.cache_config(device_bytes=64 << 20))   # or a PoolHost's
                                                 # HostedCache (mmtier.chat.actor.ChatEngine)
    conv = chat.conversation(cache, tenant="acme")        # the tenant comes from the server
    r = conv.send(["Describe this. ", png_bytes, "and this: ", wav_bytes], max_new_tokens=8)
    r.tokens          # the answer's token ids (greedy); r.text: their text
    r.counters        # TurnCounters: cached_tokens / prefilled_tokens (decoder prompt tokens
                      # attached vs run), span_hits, media_hits and encoder_runs per modality
                      # ("vision": images, "video": video segments, "audio": clips),
                      # embedding_hits / video_embedding_hits (vision tower outputs reused),
                      # transcript_tokens
    conv.close()      # nothing is held between turns; close forgets the history
    conv = chat.conversation(cache, "acme", history=[(items, r.tokens)])   # the same
                      # conversation from its history (a stateless request): its spans are
                      # keyed as the first turns sealed them, and attached where held
    dense_chat(chat, [turn0_items, turn1_items], max_new_tokens=8)   # the reference: each
                      # turn recomputed from scratch with DynamicCache + sdpa -> [tokens, ...]

A turn's items are text (``str``), images (PNG / JPEG ``bytes``), videos (MP4 ``bytes``) and
audio clips (WAV PCM16 ``bytes``); ``media`` says how each is read. A video is sampled at
``video_processor.fps`` and cut into segments of ``video_segment`` temporal patches: each
segment is a prefix-chained group of the ``video`` pool (its own page size) and its vision
tower output a content-only ``video_embed`` group, so a repeated video runs no vision tower and
eviction takes whole segments. An audio clip is transcribed by Whisper (its
encoder's cross-attention K/V is a content-only ``audio`` group: a clip the tenant sent before
runs no encoder) and the transcript's token ids join the conversation as text between
``AUDIO_START`` and ``AUDIO_END``. The text vocabulary is byte-level, built locally (no
tokenizer download). Pools: ``text`` and ``vision`` (the VLM's self-attention K/V, prefix
chained), ``vision_embed`` (the vision tower's output per image, content-only: an image seen
before at another place of any of the tenant's conversations runs no vision tower),
``video`` (the VLM's K/V of video segments, prefix chained), ``video_embed`` (the vision tower's
output per video segment, content-only), ``transcript`` (Whisper's decoder self-attention),
``audio`` (Whisper's cross K/V) and
``transcript_ids`` (a clip's transcript token ids, content-only: a clip the tenant sent before runs
no Whisper at all).
"""

from __future__ import annotations

import copy
import functools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ..config import CacheConfig, ModalitySpec
from ..engines import transformers as mt
from ..engines.transformers.layout import model_identity
from ..errors import ConfigError
from .conversation import Conversation, TurnCounters, TurnResult
from .dense import dense_chat, dense_turn

__all__ = ["ChatModel", "Conversation", "TurnCounters", "TurnResult", "dense_chat", "dense_turn",
           "CONFIG_DIR"]

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
VLM_CONFIG = "demo-qwen2-vl.json"
WHISPER_CONFIG = "demo-whisper.json"
TRANSCRIPT = "transcript"                   # the pool of Whisper's decoder self-attention K/V
TRANSCRIPT_IDS = "transcript_ids"           # a clip's transcript token ids (content-only, float32)
TRANSCRIPT_IDS_SHARE = 0.005                # of the arena: 4 bytes a token
VISION_EMBED = "vision_embed"               # the vision tower's output per image (content-only)
IMAGE_PIXELS = (56 * 56, 336 * 336)        # the image processor's min / max pixels: 4-144 tokens
VIDEO_EMBED = "video_embed"                 # the vision tower's output per video segment (content-only)
VIDEO_PIXELS = (56 * 56, 112 * 112)        # a video frame's min / max pixels: 4-16 tokens a temporal patch
VIDEO_FPS = 2.0                             # frames sampled a second (as Qwen2-VL's processors do)
VIDEO_FRAMES = (4, 32)                      # frames sampled, at least / at most
VIDEO_SEGMENT = 2                           # temporal patches (of 2 frames) a video segment


class ChatModel:
    """The two models (each twice: enabled for mmtier, and as loaded for the dense reference),
    their processors, and counters of encoder runs (forward hooks)."""

    def __init__(self, vlm, whisper, image_processor, feature_extractor, *, transcript_tokens: int = 8,
                 video_processor=None, video_segment: int = VIDEO_SEGMENT):
        if vlm.config.model_type not in ("qwen2_vl", "qwen2_5_vl") or whisper.config.model_type != "whisper":
            raise ConfigError("ChatModel takes a Qwen2-VL (or Qwen2.5-VL) and a Whisper model", ("model",))
        if video_segment < 1:
            raise ConfigError(f"video_segment must be >= 1 temporal patches, got {video_segment}", ("video_segment",))
        self.dense_vlm, self.dense_whisper = vlm.eval(), whisper.eval()
        self.vlm = mt.enable(copy.deepcopy(vlm))
        self.whisper = mt.enable(copy.deepcopy(whisper))
        self.image_processor, self.feature_extractor = image_processor, feature_extractor
        self.video_processor = video_processor or video_processor_from(None, image_processor)
        self.video_segment = video_segment
        self.transcript_tokens = transcript_tokens
        self.encoder_runs: Counter[str] = Counter()          # with the cache
        self.dense_encoder_runs: Counter[str] = Counter()    # the dense reference
        for model, runs in ((self.vlm, self.encoder_runs), (self.dense_vlm, self.dense_encoder_runs)):
            _count_tower_runs(model, runs)
        for model, runs in ((self.whisper, self.encoder_runs), (self.dense_whisper, self.dense_encoder_runs)):
            model.model.encoder.register_forward_hook(lambda *_a, runs=runs: runs.update(("audio",)))

    @classmethod
    def tiny(cls, seed: int = 0, config_dir: Path | str = CONFIG_DIR, device: str = "cpu") -> ChatModel:
        """The demo's models: random weights (seeded, made on the CPU, then moved to ``device``)
        from ``configs/demo-qwen2-vl.json`` and ``configs/demo-whisper.json``; no download."""
        from transformers import (
            Qwen2VLConfig,
            Qwen2VLForConditionalGeneration,
            WhisperConfig,
            WhisperForConditionalGeneration,
        )

        vcfg = read_model_config(Path(config_dir) / VLM_CONFIG)
        video = vcfg.pop("video", {})
        wcfg = read_model_config(Path(config_dir) / WHISPER_CONFIG)
        chunk = wcfg.pop("chunk_length_s")
        torch.manual_seed(seed)
        vlm = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**vcfg)).to(device)
        whisper = WhisperForConditionalGeneration(WhisperConfig(**wcfg)).to(device)
        images = image_processor(vlm.config)
        return cls(vlm, whisper, images, _feature_extractor(whisper.config, chunk),
                   video_processor=video_processor_from(None, images, video),
                   video_segment=video.get("segment", VIDEO_SEGMENT))

    @classmethod
    def from_pretrained(cls, vlm_path: str | Path, whisper_path: str | Path, *, dtype=torch.float32,
                        device: str = "cpu", **kw: Any) -> ChatModel:
        """Real weights from local directories (``local_files_only=True``: nothing is
        downloaded); processors from the same directories."""
        from transformers import (
            AutoModelForImageTextToText,
            Qwen2VLImageProcessorPil,
            WhisperFeatureExtractor,
            WhisperForConditionalGeneration,
        )

        vlm = AutoModelForImageTextToText.from_pretrained(vlm_path, local_files_only=True, dtype=dtype).to(device)
        whisper = WhisperForConditionalGeneration.from_pretrained(whisper_path, local_files_only=True,
                                                                  dtype=dtype).to(device)
        images = Qwen2VLImageProcessorPil.from_pretrained(vlm_path, local_files_only=True)
        kw.setdefault("video_processor", video_processor_from(Path(vlm_path), images))
        return cls(vlm, whisper, images, WhisperFeatureExtractor.from_pretrained(whisper_path, local_files_only=True),
                   **kw)

    def cache_config(self, *, shares: dict[str, float] | None = None, **overrides: Any) -> CacheConfig:
        """ONE ``CacheConfig`` for both models: ``text``, ``vision``, ``vision_embed``, ``video``
        and ``video_embed`` (the VLM), ``transcript``, ``audio`` and ``transcript_ids`` (Whisper). ``shares``: a
        modality's share of the page arena;
        ``overrides``: budgets, ``disk_dir``, ``attention_backend``..."""
        vlm = mt.config_for(self.vlm)
        whisper = mt.config_for(self.whisper, text_modality=TRANSCRIPT)
        width = self.vlm.config.get_text_config().hidden_size
        # a clip's transcript ids: one float32 a token (exact below 2**24), so a clip the tenant
        # sent before runs no Whisper at all (its encoder nor its decoder)
        specs = {**vlm.modalities, **whisper.modalities,
                 VISION_EMBED: ModalitySpec(kind="embedding", width=width, page_size=64, recompute_cost=4.0),
                 VIDEO_EMBED: ModalitySpec(kind="embedding", width=width, page_size=mt.VIDEO_PAGE, recompute_cost=4.0),
                 TRANSCRIPT_IDS: ModalitySpec(kind="embedding", width=1, page_size=16, dtype="float32",
                                              share=TRANSCRIPT_IDS_SHARE, recompute_cost=50.0)}
        for name, share in (shares or {}).items():
            if name not in specs:
                raise ConfigError(f"a share for unknown modality {name!r}; this model has {sorted(specs)}",
                                  ("shares",))
            specs[name] = specs[name].model_copy(update={"share": share})
        fields: dict[str, Any] = dict(
            model=f"chat:{model_identity(self.vlm)}+{model_identity(self.whisper)}",
            num_layers=vlm.num_layers, num_kv_heads=vlm.num_kv_heads, head_dim=vlm.head_dim,
            dtype=vlm.dtype, modalities=specs, device=vlm.device, device_bytes=vlm.device_bytes)
        fields.update(overrides)
        return CacheConfig(**fields)

    def warm_up(self) -> None:
        """One turn with a small image, video and clip through both paths, on a private cache, as
        a server does at start (first calls initialise kernels and buffers); counters reset."""
        import io
        import wave

        import numpy as np
        from PIL import Image

        from ..cache import TieredKVCache

        png, wav = io.BytesIO(), io.BytesIO()
        Image.new("RGB", (56, 56), (90, 120, 30)).save(png, "PNG")
        with wave.open(wav, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes((np.sin(np.arange(8000) * 0.05) * 8000).astype("<i2").tobytes())
        items = ["Hi. ", png.getvalue(), _still_video(), wav.getvalue()]
        with TieredKVCache(self.cache_config(device_bytes=64 << 20)) as cache:
            self.conversation(cache, "warm-up").send(items, 2)
        dense_turn(self, [], items, 2)
        self.encoder_runs.clear()
        self.dense_encoder_runs.clear()

    def conversation(self, cache, tenant: str | None = None, history=()) -> Conversation:
        """A new conversation of ``tenant`` over ``cache`` (a ``TieredKVCache`` built from
        ``cache_config``, or an engine's ``HostedCache``); ``history``: earlier turns as
        ``(items, answer token ids)`` (a stateless request's), found in the cache by key."""
        mt.check_fits(mt.layout_of(self.vlm), cache.cfg, "text")
        mt.check_fits(mt.layout_of(self.whisper), cache.cfg, TRANSCRIPT)
        return Conversation(self, cache, tenant, history)


def read_model_config(path: Path) -> dict:
    """A model's JSON config as a mapping; ``ConfigError`` naming the file where it cannot be read."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"model config {path}: {exc}", ("path",)) from None
    cfg.pop("_comment", None)
    cfg.pop("model_type", None)
    return cfg


def _count_tower_runs(model, runs: Counter) -> None:
    """Count ``model``'s vision tower runs in ``runs``: ``"video"`` for those its
    ``get_video_features`` makes, ``"vision"`` for the others (images)."""
    state = {"input": "vision"}
    model.model.visual.register_forward_hook(lambda *_a: runs.update((state["input"],)))
    video_features = model.model.get_video_features

    @functools.wraps(video_features)                  # its signature: generate reads it
    def counted(*args, **kwargs):
        state["input"] = "video"
        try:
            return video_features(*args, **kwargs)
        finally:
            state["input"] = "vision"

    model.model.get_video_features = counted        # the model's forward calls it by attribute


def _still_video() -> bytes:
    """Four frames of one colour, 56x56 pixels, 2 s: an MP4 made by PyAV (the warm-up's video)."""
    import io

    import av
    import numpy as np

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=2)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.full((56, 56, 3), 90, np.uint8), format="rgb24")
        for _ in range(4):
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def video_processor_from(path: Path | None, images, cfg: dict | None = None):
    """The video settings of a model directory (``video_preprocessor_config.json``: fps, frames,
    frame pixels), else ``cfg`` (the demo config's ``video`` section), else the defaults here."""
    from ..engines.transformers.video_frames import VideoProcessor

    cfg = dict(cfg or {})
    if path is not None and (path / "video_preprocessor_config.json").is_file():
        cfg = read_model_config(path / "video_preprocessor_config.json")
    size = cfg.get("size") or {}
    return VideoProcessor(images, fps=cfg.get("fps") or VIDEO_FPS, min_frames=cfg.get("min_frames", VIDEO_FRAMES[0]),
                          max_frames=cfg.get("max_frames", VIDEO_FRAMES[1]),
                          min_pixels=size.get("shortest_edge", cfg.get("min_pixels", VIDEO_PIXELS[0])),
                          max_pixels=size.get("longest_edge", cfg.get("max_pixels", VIDEO_PIXELS[1])))


def image_processor(cfg):
    """Qwen2-VL's PIL image processor for a model config ``cfg``, sized as the chat model's
    (``IMAGE_PIXELS``) and patched as its vision config says."""
    from transformers import Qwen2VLImageProcessorPil

    v = cfg.vision_config
    return Qwen2VLImageProcessorPil(size={"shortest_edge": IMAGE_PIXELS[0], "longest_edge": IMAGE_PIXELS[1]},
                                    patch_size=v.patch_size, merge_size=v.spatial_merge_size,
                                    temporal_patch_size=v.temporal_patch_size)


def _feature_extractor(cfg, chunk_length_s: int):
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=cfg.num_mel_bins, chunk_length=chunk_length_s)
    if fe.nb_max_frames != 2 * cfg.max_source_positions:
        raise ConfigError(f"Whisper's {cfg.max_source_positions} encoder positions need "
                          f"{2 * cfg.max_source_positions} frames; a {chunk_length_s} s window gives "
                          f"{fe.nb_max_frames}", ("chunk_length_s",))
    return fe
