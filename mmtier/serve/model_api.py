"""The chat engine a Serve worker runs, behind one small interface.

A worker (``worker.TurnWorker``) holds its node's pool and answers requests with a
``TurnEngine``; a request is stateless: the earlier turns it carries (``history``: each turn's
items and the answer's text) are found in the cache by key, not kept between requests. The
ingress (``app.ChatIngress``) needs only the engine's ``Frontend`` (no weights): how many tokens
a media item costs (the request's token limit), the content-only keys of a media item
(cross-attention K/V, encoder outputs: what another conversation anywhere may hold) and the
prefix keys of the history (its spans, chained as the engine sealed them), computed exactly as
the engine computes them, for its one batched registry lookup per request.

- ``hf`` (``chat_model.py``): the transformers chat model of ``mmtier.chat.model``, the
  one model stack of the demo, the benchmarks and Serve.

``engine_loader.py`` picks and loads the engine by ``model.kind`` (this module only names the
interface, so the engines import it and it imports none of them).

Items reach an engine as ``("text", str)`` or ``(request media type, bytes)`` pairs, the media
already decoded once and checked by the protocol (``media.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..content import ContentKey

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
