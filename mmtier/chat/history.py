"""A chat conversation's history as spans and keys, built the same way whether the turns ran in
this process or arrive in a stateless request (an OpenAI ``messages`` list).

A turn adds its prompt's tokens, then its answer's. Its prompt is cut into spans (``spans.cut``,
from where the history's last span ends: the previous answer's last token opens the turn's first
span); every span but the last is keyed chained to the one before (``span_key``), and the last is
sealed together with the answer, all but the answer's last token (whose K/V the next turn writes).
``Conversation`` keys its spans through ``chain`` and ``tail`` as it runs; ``History.extend``
applies the same two steps to a turn whose answer is already known, so a request that carries
the whole history finds, by key, every span any earlier turn of that history sealed, wherever
the cache holds it, with no conversation kept anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ..content import ContentKey
from ..errors import ShapeError
from .media import ImageItem, VideoItem, text_ids
from .spans import Span, cut, span_key, visual_tokens


def root_key(cache, tenant: str | None) -> ContentKey:
    """The parent of a conversation's first span: the key of the tenant's empty prefix."""
    seq = cache.create_sequence(tenant)
    try:
        return cache.prefix_key(seq)
    finally:
        cache.release(seq)


def chain(cache, tenant, ids: list[int], start: int, images: list[ImageItem], videos: list[VideoItem],
          parent: ContentKey) -> tuple[list[Span], Span | None, ContentKey]:
    """``ids[start:]`` (a turn's prompt after the history) as ``(keyed spans, last span,
    parent of the last)``: every span but the last keyed, chained from ``parent`` (no span at
    all, ``last`` None, when ``ids[start:]`` is empty: a lookup before a turn's first clip)."""
    new = cut(ids, start, images, videos)
    if not new:
        return [], None, parent
    keyed = []
    for s in new[:-1]:
        parent = span_key(cache, tenant, ids, s, parent)
        keyed.append(replace(s, key=parent))
    return keyed, new[-1], parent


def tail(cache, tenant, ids: list[int], answer: list[int], last: Span, parent: ContentKey) -> Span:
    """The turn's last span sealed with its answer (all but the answer's last token)."""
    if not answer:
        raise ShapeError("an answer of no tokens cannot close a turn of the history")
    span = Span("text", last.start, len(ids) + len(answer) - 1)
    return replace(span, key=span_key(cache, tenant, ids + answer, span, parent))


@dataclass
class History:
    """The ids of a conversation so far (prompts and answers), its keyed spans and its media."""

    ids: list[int] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    images: list[ImageItem] = field(default_factory=list)
    videos: list[VideoItem] = field(default_factory=list)
    turns: int = 0                       # turns extended by ``extend``

    def start(self) -> int:
        return self.spans[-1].end if self.spans else 0

    def parent(self, root: ContentKey) -> ContentKey:
        return self.spans[-1].key if self.spans else root

    def extend(self, cache, tenant, root: ContentKey, prompt: list[int], images: list[ImageItem],
               videos: list[VideoItem], answer: list[int]) -> None:
        """One earlier turn, its prompt's tokens and its answer known: spans keyed as the turn
        sealed them when it ran."""
        ids = self.ids + prompt
        keyed, last, parent = chain(cache, tenant, ids, self.start(), images, videos, self.parent(root))
        self.spans += [*keyed, tail(cache, tenant, ids, answer, last, parent)]
        self.ids = ids + answer
        self.images += images
        self.videos += videos
        self.turns += 1


class NeedsTranscript(Exception):
    """A clip's transcript is needed to go on and none can be had here (no Whisper)."""


def replay(cache, tenant, root: ContentKey, turns: Sequence[tuple[Sequence, Sequence[int]]],
           tokens: Callable[[Sequence], tuple[list[int], list[ImageItem], list[VideoItem]]]) -> History:
    """The history of ``turns`` (each ``(items, answer ids)``); ``tokens(items)``: a turn's prompt
    tokens, images and videos (it may raise ``NeedsTranscript``: the history up to that turn is
    returned)."""
    h = History()
    for items, answer in turns:
        try:
            prompt, images, videos = tokens(items)
        except NeedsTranscript:
            break
        h.extend(cache, tenant, root, prompt, images, videos, list(answer))
    return h


def prompt_without_audio(read) -> tuple[list[int], list[ImageItem], list[VideoItem]]:
    """A turn's prompt tokens, images and videos from its read items (``("text", str)``,
    ``("image", ImageItem)``, ``("video", VideoItem)``), where no clip needs a transcript: a
    clip raises ``NeedsTranscript``."""
    new: list[int] = []
    images: list[ImageItem] = []
    videos: list[VideoItem] = []
    for kind, x in read:
        if kind == "audio":
            raise NeedsTranscript
        if kind == "text":
            new += text_ids(x)
        else:
            (images if kind == "image" else videos).append(x)
            new += visual_tokens(x)
    return new, images, videos
