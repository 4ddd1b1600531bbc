"""The chat engines a Serve worker runs: one small interface, one adapter per model kind.

A worker (``worker.TurnWorker``) holds its node's pool and answers requests with a
``TurnEngine``; a request is stateless: the earlier turns it carries (``history``: each turn's
items and the answer's text) are found in the cache by key, not kept between requests. The
ingress (``app.ChatIngress``) needs only the engine's ``Frontend`` (no weights): how many tokens
a media item costs (the request's token limit), the content-only keys of a media item
(cross-attention K/V, encoder outputs: what another conversation anywhere may hold) and the
prefix keys of the history (its spans, chained as the engine sealed them), computed exactly as
the engine computes them, for its one batched registry lookup per request.

- ``hf`` (the default, ``hf_engine.py``): the transformers chat model of
  ``mmtier.integrations.chat``;
- ``reference``: mmtier's seeded reference model (``mmtier.models``), no transformers needed.

Items reach an engine as ``("text", str)`` or ``(request media type, bytes)`` pairs, the media
already decoded once and checked by the protocol (``media.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config import CacheConfig
from ..content import ContentKey
from ..errors import BadMediaError, ShapeError
from .config import ModelArgs
from .protocol import MEDIA_TYPES, TYPE_OF

Item = tuple[str, Any]        # ("text", str) | ("image" | "video" | "audio", bytes)
Turn = tuple[Sequence[Item], str]   # an earlier turn: its items and the answer's text


@dataclass(frozen=True)
class TurnOutput:
    """What one request produced: greedy ``tokens``, their ``text``; ``prompt_tokens`` (the
    whole conversation's, as the model counts them), ``cached_tokens`` (of those, attached from
    the cache rather than run; None where the model does not count them) and ``counts``: this
    request's cache counters (encoder runs, hits and misses per request media type, prefilled
    tokens)."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int | None
    counts: dict[str, Any] = field(default_factory=dict)


class Frontend(Protocol):
    def media_tokens(self, kind: str, data: bytes) -> int: ...

    def routing_keys(self, cache, tenant: str, kind: str, data: bytes) -> list[ContentKey]: ...

    def prefix_keys(self, cache, tenant: str, history: Sequence[Turn], items: Sequence[Item]) -> list[ContentKey]:
        """The keys of the conversation's prefix groups as the engine seals them (its history's
        spans, as far as they are known without running a model)."""


class TurnEngine(Frontend, Protocol):
    serial: bool     # True: requests must not overlap (the worker runs them one at a time: the
                     # model keeps per-turn state)

    def check(self, history: Sequence[Turn], items: Sequence[Item], max_new_tokens: int) -> None:
        """Raises an ``MMTierError`` (``BadMediaError`` for media) when the request is bad input:
        the worker answers 400 and runs nothing."""

    def check_cache(self, cache) -> None:
        """``ConfigError`` unless ``cache`` is configured for this model (identity, layouts): a
        cluster started for another model would key this model's K/V as that one's."""

    def answer(self, cache, tenant: str, history: Sequence[Turn], items: Sequence[Item],
               max_new_tokens: int) -> TurnOutput: ...


def load_engine(model: ModelArgs, device: str = "cpu") -> TurnEngine:
    """The engine of ``model.kind`` with its weights on ``device`` (a worker)."""
    if model.kind == "reference":
        if device != "cpu":
            raise ShapeError("the reference model runs on the CPU only")
        return ReferenceEngine(model.seed)
    from .hf_engine import HFEngine

    return HFEngine.load(model, device)


def load_frontend(model: ModelArgs) -> Frontend:
    """What the ingress needs of the engine: no weights, no pool."""
    if model.kind == "reference":
        return ReferenceEngine(model.seed)
    from .hf_engine import HFFrontend

    return HFFrontend.load(model)


def engine_cache_config(model: ModelArgs, **overrides: Any) -> CacheConfig:
    """The cluster's ``CacheConfig`` for ``model`` (every pool and store of the app uses it)."""
    if model.kind == "reference":
        from ..models import reference_config

        return reference_config(seed=model.seed, **overrides)
    from .hf_engine import hf_cache_config

    return hf_cache_config(model, **overrides)


# ---------------------------------------------------------------------- the reference model
class ReferenceEngine:
    """``ReferenceModel`` conversations (``CachedSession``s) behind the engine interface."""

    COUNTERS = ("encoder_runs", "embedding_hits", "cross_hits", "cross_misses", "self_hits", "self_misses")
    serial = False            # a conversation's counters are its own; the model is read-only

    def __init__(self, seed: int):
        from ..models import ReferenceModel, cross_modality, embed_modality

        self.model = ReferenceModel(seed=seed)
        self._groups = {m: (cross_modality(m), embed_modality(m)) for m in self.model.encoders}

    def media_tokens(self, kind: str, data: bytes) -> int:
        return self._encoder(kind).tokens_for(data)

    def _encoder(self, kind: str):
        """The reference model's encoder of a request media type; it has none for video."""
        encoder = self.model.encoders.get(MEDIA_TYPES[kind])
        if encoder is None:
            raise BadMediaError(f"the reference model takes no {kind} items; it takes "
                                f"{sorted(TYPE_OF.get(m, m) for m in self.model.encoders)}", unsupported=True)
        return encoder

    def routing_keys(self, cache, tenant: str, kind: str, data: bytes) -> list[ContentKey]:
        modality = MEDIA_TYPES[kind]
        params = self.model.encoders[modality].params
        return [cache.content_key(g, data, tenant=tenant, params=params) for g in self._groups[modality]]

    def prefix_keys(self, cache, tenant: str, history: Sequence[Turn], items: Sequence[Item]) -> list[ContentKey]:
        return []                 # a reference conversation's text K/V is keyed by no content

    def check(self, history: Sequence[Turn], items: Sequence[Item], max_new_tokens: int) -> None:
        prompt = _prompt(history, items)
        for item in prompt:
            if not hasattr(item, "ids"):
                self._encoder(TYPE_OF[item.modality])
        self.model.validate(prompt, max_new_tokens)

    def check_cache(self, cache) -> None:
        self.model.check_cache(cache)

    def answer(self, cache, tenant: str, history: Sequence[Turn], items: Sequence[Item],
               max_new_tokens: int) -> TurnOutput:
        """The whole conversation as one prompt of a fresh session (its media K/V found by
        content; the session is closed after)."""
        from ..integrations.chat_media import bytes_text
        from ..models import ModelCounters

        model = copy.copy(self.model)              # shares weights; counters of its own
        model.counters = ModelCounters()
        prompt = _prompt(history, items)
        with model.session(cache, tenant) as session:
            tokens = session.send(prompt, max_new_tokens)
        after = model.counters.snapshot()
        counts: dict[str, Any] = {}
        for name in ReferenceEngine.COUNTERS:
            counts[name] = {TYPE_OF.get(m, m): n for m, n in after[name].items() if n}
        counts["decoder_tokens"] = after["decoder_tokens"]
        size = sum(len(i.ids) if hasattr(i, "ids") else self.media_tokens(TYPE_OF[i.modality], i.data)
                   for i in prompt)
        return TurnOutput(tokens, bytes_text(bytes(tokens)), size, None, counts)


def _prompt(history: Sequence[Turn], items: Sequence[Item]) -> list:
    from ..integrations.chat_media import text_bytes
    from ..models import Media, Text

    out: list = []
    for turn, answer in [*history, (items, None)]:
        out += [Text(text_bytes(p)) if t == "text" else Media(MEDIA_TYPES[t], p) for t, p in turn]
        if answer is not None:
            out.append(Text(text_bytes(answer)))
    return out
