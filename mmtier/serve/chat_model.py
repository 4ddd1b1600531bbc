"""The transformers chat model (``mmtier.chat.model``) as the Serve app's engine.

``model: {kind: hf}`` (the default): a Qwen2-VL-architecture VLM and a Whisper for audio, small
random-weight models built from ``configs/demo-qwen2-vl.json`` / ``configs/demo-whisper.json``
with ``seed``, or real weights from local directories (``path``, ``audio_path``;
``from_pretrained(..., local_files_only=True)``). The text vocabulary is the chat layer's
byte-level one (no tokenizer is downloaded).

- ``HFFrontend`` (the ingress; processors only, no weights): an image costs its image tokens
  as the model's image processor resizes it (read from the header) plus its two vision markers;
  a video its video tokens (frames sampled at the video processor's fps, from the MP4 header)
  plus two markers; an audio clip its transcript tokens plus two markers. A media item's
  content-only groups, keyed as the chat layer keys them: an image's vision-tower output
  (``vision_embed``), a video's per segment (``video_embed``), a clip's transcript ids
  (``transcript_ids``) and Whisper cross-attention K/V (``audio``). (An image's or video
  segment's decoder K/V is chained to the conversation's prefix: it is found through the
  conversation, not routed by.)
  The history's prefix keys (``prefix_keys``): its spans keyed as the chat layer seals them
  (``chat_history``), up to its first clip (a clip's transcript needs Whisper).
- ``HFEngine`` (a worker): a request is a chat conversation rebuilt from its history over the
  worker's ``HostedCache`` (``ChatModel.conversation(history=...)``: every span held anywhere is
  attached, not recomputed) and its last turn answered. One request at a time per worker
  (``serial``: the models keep per-turn state, Qwen2-VL's rope deltas and the encoder-run
  counters), so each request's counts are exactly its own; the pool's own actor methods
  (exports to other nodes) still run alongside. ``Conversation.turn_lookup`` (history spans,
  the turn's spans, its images' and clips' groups) goes to ``begin_turn``: one batched lookup,
  groups held elsewhere fetched whole; ``end_turn`` publishes what the request made.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from ..config import CacheConfig
from ..content import ContentKey
from ..errors import BadMediaError, ConfigError, ShapeError
from .config import ModelArgs
from .model_api import Item, Turn, TurnOutput
from .protocol import TYPE_OF

MARKERS = 2               # vision start / end, audio start / end around a media item's tokens


def load_chat(model: ModelArgs, device: str = "cpu"):
    """The ``ChatModel`` of ``model`` on ``device`` (cached per process: the driver, a worker)."""
    return _load_chat(model, device)


@lru_cache(maxsize=2)
def _load_chat(model: ModelArgs, device: str):
    from ..chat.model import ChatModel

    if model.path is None:
        return ChatModel.tiny(model.seed, device=device)
    try:
        return ChatModel.from_pretrained(model.path, model.audio_path, device=device)
    except (OSError, ValueError) as exc:        # transformers' "not found locally" and bad configs
        raise ConfigError(f"model.path: cannot load {model.path} / {model.audio_path} without a "
                          f"download: {exc}", ("model.path",)) from None


def hf_cache_config(model: ModelArgs, **overrides: Any) -> CacheConfig:
    """ONE ``CacheConfig`` for both models (``text`` / ``vision`` / ``transcript`` / ``audio``)."""
    return load_chat(model).cache_config(**overrides)


class HFFrontend:
    """What the ingress needs: a media item's tokens (the image processor's resize rule) and
    its content-only groups' keys (``vision_embed`` for an image; ``transcript_ids`` and
    ``audio`` for a clip)."""

    def __init__(self, image_processor, transcript_tokens: int, video_processor, video_segment: int):
        self.image_processor = image_processor
        self.transcript_tokens = transcript_tokens
        self.video_processor, self.video_segment = video_processor, video_segment

    @classmethod
    def load(cls, model: ModelArgs) -> HFFrontend:
        import inspect
        from pathlib import Path

        from ..chat import model as chat

        params = inspect.signature(chat.ChatModel).parameters
        transcript, segment = params["transcript_tokens"].default, params["video_segment"].default
        if model.path is not None:
            from transformers import Qwen2VLImageProcessorPil

            images = Qwen2VLImageProcessorPil.from_pretrained(model.path, local_files_only=True)
            return cls(images, transcript, chat.video_processor_from(Path(model.path), images), segment)
        from transformers import Qwen2VLConfig

        raw = chat.read_model_config(chat.CONFIG_DIR / chat.VLM_CONFIG)
        video = raw.pop("video", {})
        images = chat.image_processor(Qwen2VLConfig(**raw))
        return cls(images, transcript, chat.video_processor_from(None, images, video), video.get("segment", segment))

    def media_tokens(self, kind: str, data: bytes) -> int:
        if kind == "audio":
            return self.transcript_tokens + MARKERS
        return self._read(kind, data).tokens + MARKERS

    def routing_keys(self, cache, tenant: str, kind: str, data: bytes) -> list[ContentKey]:
        from ..chat.spans import (
            image_features_key,
            transcript_key,
            video_features_keys,
        )

        if kind == "audio":
            return [transcript_key(cache, tenant, data, self.transcript_tokens),
                    cache.content_key("audio", data, tenant=tenant)]
        item = self._read(kind, data)
        if kind == "video":
            return video_features_keys(cache, tenant, item)
        return [image_features_key(cache, tenant, item)]

    def prefix_keys(self, cache, tenant: str, history: Sequence[Turn], items: Sequence[Item]) -> list[ContentKey]:
        from ..chat.history import (
            NeedsTranscript,
            chain,
            prompt_without_audio,
            replay,
            root_key,
        )
        from ..chat.media import text_ids

        def tokens(turn):
            return prompt_without_audio([(k, d if k in ("text", "audio") else self._read(k, d)) for k, d in turn])

        root = root_key(cache, tenant)
        turns = [(turn, text_ids(answer)) for turn, answer in history]
        h = replay(cache, tenant, root, turns, tokens)
        keys = [s.key for s in h.spans]
        if h.turns == len(turns):
            try:
                new, images, videos = tokens(items)
            except NeedsTranscript:          # the turn's spans up to its first clip
                new, images, videos = tokens(items[:next(i for i, (k, _d) in enumerate(items) if k == "audio")])
            keys += [s.key for s in chain(cache, tenant, h.ids + new, h.start(), images, videos,
                                          h.parent(root))[0]]
        return keys

    def _read(self, kind: str, data: bytes):
        """The chat layer's ``ImageItem`` / ``VideoItem`` of the bytes (headers only)."""
        from ..chat.media import ImageItem, VideoItem

        if kind == "video":
            return _media(lambda: VideoItem.read(data, self.video_processor, self.video_segment))
        return _media(lambda: ImageItem.read(data, self.image_processor))


class HFEngine(HFFrontend):
    """Requests of the chat model; one at a time (``serial``)."""

    serial = True

    def __init__(self, chat):
        super().__init__(chat.image_processor, chat.transcript_tokens, chat.video_processor, chat.video_segment)
        self.chat = chat

    @classmethod
    def load(cls, model: ModelArgs, device: str = "cpu") -> HFEngine:
        """The engine of a worker, warmed up (a first turn through a private cache) so that
        the first client's request is not the process's first call of every kernel."""
        engine = cls(load_chat(model, device))
        engine.chat.warm_up()
        return engine

    def check(self, history: Sequence[Turn], items: Sequence[Item], max_new_tokens: int) -> None:
        from ..chat.media import read_wav

        if max_new_tokens < 1:
            raise ShapeError("the chat model answers at least one token: max_tokens >= 1")
        rate = self.chat.feature_extractor.sampling_rate
        for kind, data in [*(i for turn, _answer in history for i in turn), *items]:
            if kind in ("image", "video"):
                self._read(kind, data)
            elif kind == "audio":
                _media(lambda d=data: read_wav(d, rate))
        if any(not answer for _turn, answer in history):
            raise ShapeError("an earlier answer of no text")

    def check_cache(self, cache) -> None:
        want = self.chat.cache_config().model
        if cache.cfg.model != want:
            raise ConfigError(f"the cluster's cache is configured for {cache.cfg.model!r}, not this "
                              f"model {want!r} (start the cluster's cache with this app's config)", ("model",))

    def answer(self, cache, tenant: str, history: Sequence[Turn], items: Sequence[Item],
               max_new_tokens: int) -> TurnOutput:
        """The conversation rebuilt from ``history`` (its spans found by key), its last turn
        ``items`` answered. A request that raises (no room, a lost holder) changes nothing but
        what the cache may evict anyway: no conversation is kept."""
        from ..chat.media import text_ids

        conv = self.chat.conversation(cache, tenant, [([d for _k, d in turn], text_ids(answer))
                                                      for turn, answer in history])
        data = [d for _kind, d in items]
        layers = self.chat.vlm.config.get_text_config().num_hidden_layers
        begin = getattr(cache, "begin_turn", None)         # an embedded pool: turn boundaries
        if begin is not None:
            keys, fallbacks = conv.turn_lookup(data)
            begin(keys, calls_left=(max_new_tokens + len(items)) * layers, fallbacks=fallbacks)
        try:
            r = conv.send(data, max_new_tokens)
        finally:
            if begin is not None:
                cache.end_turn()
            conv.close()
        c = r.counters
        counts = {"encoder_runs": _named(c.encoder_runs), "media_hits": _named(c.media_hits),
                  "embedding_hits": _named({"vision": c.embedding_hits, "video": c.video_embedding_hits}),
                  "cached_tokens": c.cached_tokens, "prefilled_tokens": c.prefilled_tokens,
                  "span_hits": c.span_hits, "span_misses": c.span_misses,
                  "transcript_tokens": c.transcript_tokens, "transcript_hits": c.transcript_hits}
        return TurnOutput(list(r.tokens), r.text, c.cached_tokens + c.prefilled_tokens, c.cached_tokens, counts)


def _named(per_modality: dict[str, int]) -> dict[str, int]:
    """Counters by request media type ("image", "video", "audio"), zeros left out; a video's
    counts are of its segments."""
    return {TYPE_OF.get(m, m): n for m, n in per_modality.items() if n}


def _media(read):
    """Run a chat-layer reader; its ``ShapeError`` on bad bytes becomes ``BadMediaError``."""
    try:
        return read()
    except ShapeError as exc:
        raise BadMediaError(str(exc)) from None
