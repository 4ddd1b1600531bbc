"""The chat engines a Serve worker runs: one small interface, one adapter per model kind.

A worker (``worker.TurnWorker``) holds its node's pool and runs conversations of a
``TurnEngine``; the ingress (``app.TurnIngress``) needs only the engine's ``Frontend`` (no
weights): how many tokens a media item costs (the turn's token limit) and the content-only keys
of a media item (cross-attention K/V, encoder outputs: what another conversation anywhere may
hold), computed exactly as the engine's conversations compute them, for its one batched
registry lookup per request.

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
from ..errors import BadMediaError
from .config import ModelArgs
from .protocol import MEDIA_TYPES, TYPE_OF

Item = tuple[str, Any]        # ("text", str) | ("image" | "video" | "audio", bytes)


@dataclass(frozen=True)
class TurnOutput:
    """What one turn produced: greedy ``tokens``, their ``text``, and ``counts``: this turn's
    cache counters (encoder runs, hits and misses per request media type, prefilled tokens)."""

    tokens: list[int]
    text: str
    counts: dict[str, Any] = field(default_factory=dict)


class Conversation(Protocol):
    broken: bool     # True once a failed turn left the conversation's state part-way (it is
                     # no longer a prefix the model can extend); False: a failed ``send`` left
                     # the history as it was, so the next turn runs as if it had not been sent

    def send(self, items: Sequence[Item], max_new_tokens: int) -> TurnOutput: ...

    def close(self) -> None: ...


class Frontend(Protocol):
    def media_tokens(self, kind: str, data: bytes) -> int: ...

    def routing_keys(self, cache, tenant: str, kind: str, data: bytes) -> list[ContentKey]: ...


class TurnEngine(Frontend, Protocol):
    serial: bool     # True: turns of different conversations must not overlap (the worker
                     # runs them one at a time: the model keeps per-turn state)

    def check(self, items: Sequence[Item], max_new_tokens: int) -> None:
        """Raises an ``MMTierError`` (``BadMediaError`` for media) when the turn is bad input:
        the worker answers 400 and opens nothing."""

    def check_cache(self, cache) -> None:
        """``ConfigError`` unless ``cache`` is configured for this model (identity, layouts): a
        cluster started for another model would key this model's K/V as that one's."""

    def open(self, cache, tenant: str) -> Conversation: ...


def load_engine(model: ModelArgs) -> TurnEngine:
    """The engine of ``model.kind`` with its weights (a worker)."""
    if model.kind == "reference":
        return ReferenceEngine(model.seed)
    from .hf_engine import HFEngine

    return HFEngine.load(model)


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

    def check(self, items: Sequence[Item], max_new_tokens: int) -> None:
        for kind, _data in items:
            if kind != "text":
                self._encoder(kind)
        self.model.validate(_prompt(items), max_new_tokens)

    def check_cache(self, cache) -> None:
        self.model.check_cache(cache)

    def open(self, cache, tenant: str) -> _ReferenceConversation:
        from ..models import ModelCounters

        model = copy.copy(self.model)              # shares weights; counters of its own
        model.counters = ModelCounters()
        return _ReferenceConversation(model, model.session(cache, tenant))


class _ReferenceConversation:
    def __init__(self, model, session):
        self.model, self.session = model, session

    @property
    def broken(self) -> bool:
        """A ``CachedSession`` appends each chunk as it runs: a turn that fails half-way breaks it."""
        return not self.session.is_open

    def send(self, items: Sequence[Item], max_new_tokens: int) -> TurnOutput:
        before = self.model.counters.snapshot()
        tokens = self.session.send(_prompt(items), max_new_tokens)
        after = self.model.counters.snapshot()
        counts: dict[str, Any] = {}
        for name in ReferenceEngine.COUNTERS:
            d = {TYPE_OF.get(m, m): n - before[name].get(m, 0) for m, n in after[name].items()}
            counts[name] = {m: n for m, n in d.items() if n}
        counts["decoder_tokens"] = after["decoder_tokens"] - before["decoder_tokens"]
        return TurnOutput(tokens, bytes(tokens).decode("utf-8", errors="replace"), counts)

    def close(self) -> None:
        self.session.close()


def _prompt(items: Sequence[Item]) -> list:
    from ..models import Media, Text

    return [Text(p) if t == "text" else Media(MEDIA_TYPES[t], p) for t, p in items]
