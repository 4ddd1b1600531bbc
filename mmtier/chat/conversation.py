"""One conversation of a ``ChatModel`` over an mmtier cache: turns that prefill only their new
tokens.

The conversation holds no pages between turns. Its history is cut into spans (runs of text
tokens, and each image's run of image tokens), each sealed after it is written as a group under
a key chained to the span before (``content_key(..., parent=...)``: prefix-dependent, with the
tenant's salt). Spans break at turn boundaries, and a turn's last span is sealed together with
the answer generated from it (all but the answer's last token, whose K/V the next turn writes).
So a turn attaches every span of the history the cache still holds (wherever its tier), runs the
model over the spans it lacks (the vision tower only for those that are images or video segments
whose vision tower output is not cached) and over the turn's new tokens, and decodes through
mmtier attention. A video is a span per segment (``spans``): a video the conversation holds
is attached segment by segment; one whose later segments were evicted re-encodes only those. Under pressure the history's groups are
evictable like any other; a turn that finds one gone recomputes from there on.

A clip's transcript ids are a content-only ``transcript_ids`` group of the tenant: a clip sent
before (in any of the tenant's conversations) runs no Whisper at all; else Whisper runs, its
encoder skipped when the clip's ``audio`` group (cross K/V) is held.

Qwen2-VL's M-RoPE positions are computed over the whole conversation each turn (its image and
video grids are known from the media's headers) and ``generate`` steps on from them, so cached
and prefilled spans, and the answer, sit where the dense model puts them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..content import ContentKey
from ..engines.transformers import cache_for
from ..engines.transformers.cache import RunPlan
from ..engines.transformers.session import Media, Session
from ..errors import CapacityError, MMTierError, ShapeError
from .history import History, chain, prompt_without_audio, replay, root_key, tail
from .media import (
    AUDIO_END,
    AUDIO_START,
    SPECIAL,
    AudioFeatures,
    ImageItem,
    VideoItem,
    ids_text,
    kind_of,
    text_ids,
)
from .spans import Span as _Span
from .spans import image_features_key as _image_features_key
from .spans import positions as _positions
from .spans import (
    transcript_key,
    video_features_key,
    video_features_keys,
    visual_tokens,
)


@dataclass(frozen=True)
class TurnCounters:
    cached_tokens: int                  # decoder prompt tokens attached from the cache
    prefilled_tokens: int               # decoder prompt tokens run through the model this turn
    span_hits: int                      # history and new spans attached
    span_misses: int                    # spans prefilled (the turn's last span included)
    media_hits: dict[str, int]          # "vision": image spans attached; "video": video segment
                                        # spans attached; "audio": clips attached
    embedding_hits: int                 # images prefilled from the vision tower's cached output
    encoder_runs: dict[str, int]        # "vision" / "video": vision tower runs over images / video
                                        # segments; "audio": Whisper encoder runs
    transcript_tokens: int              # Whisper decoder tokens generated for the turn's clips
    transcript_hits: int = 0            # clips whose transcript came from the cache (no Whisper run)
    video_embedding_hits: int = 0       # video segments prefilled from the tower's cached output


@dataclass(frozen=True)
class TurnResult:
    tokens: list[int]                   # the answer (greedy)
    text: str                           # its text (byte-level vocabulary)
    counters: TurnCounters
    keys: list[ContentKey] = field(default_factory=list)   # the groups the turn used or made


class Conversation:
    """Turns of one tenant's conversation (``ChatModel.conversation`` builds it).

    ``history``: earlier turns as ``(items, answer token ids)``, as a stateless request carries
    them; the first ``send`` rebuilds their spans and keys (``history``: no model run but
    Whisper for a clip whose transcript the tenant does not hold) and attaches every one the
    cache holds, so a conversation needs no state between requests."""

    def __init__(self, chat, cache, tenant: str | None, history: Sequence[tuple[Sequence, Sequence[int]]] = ()):
        self.chat, self.cache, self.tenant = chat, cache, tenant
        self.ids: list[int] = []          # the conversation so far: prompts and answers
        self.spans: list[_Span] = []      # sealed spans of the history, in order
        self.images: list[ImageItem] = []
        self.videos: list[VideoItem] = []
        self.closed = False
        self._embedding_hits = self._embeddings_not_stored = self._video_embedding_hits = 0
        self._whisper = Session(chat.whisper, cache, tenant=tenant, text_modality="transcript")
        self._root = root_key(cache, tenant)      # the parent of the first span: the empty prefix
        self._history = [([self._read(x) for x in _listed(items)], list(answer)) for items, answer in history]

    def turn_keys(self, items) -> list[ContentKey]:
        """The groups a turn of ``items`` would read, as far as they are known before it runs:
        the history's spans, the turn's spans up to its first clip (a clip's transcript is not
        known yet), its images' ``vision_embed`` groups, its video segments' ``video_embed`` groups
        and its clips' ``transcript_ids`` groups. What an
        engine looks up for the turn at admission (``HostedCache.begin_turn``)."""
        return self.turn_lookup(items)[0]

    def turn_lookup(self, items) -> tuple[list[ContentKey], dict[ContentKey, list[ContentKey]]]:
        """``(turn_keys, fallbacks)``: ``fallbacks[k]`` the groups needed only when ``k`` is found
        nowhere (a clip's ``audio`` group, Whisper's encoder K/V, when its transcript is not
        cached): ``HostedCache.begin_turn(keys, fallbacks=...)``. A history not rebuilt yet
        gives its spans up to its first clip, and its clips' ``transcript_ids`` groups."""
        read = [self._read(x) for x in _listed(items)]
        fallbacks: dict[ContentKey, list[ContentKey]] = {}
        if self._history:
            h = replay(self.cache, self.tenant, self._root, self._history, prompt_without_audio)
            whole = h.turns == len(self._history)
            # the history's clips: their transcripts (no fallback: a transcript found nowhere is
            # rare, and its Whisper run is then local; asking for it would cost a lookup always)
            clips = [self._transcript_key(x[0]) for turn, _answer in self._history for kind, x in turn
                     if kind == "audio"]
        else:
            h, whole, clips = History(self.ids, self.spans, self.images, self.videos), True, []
        keys = [s.key for s in h.spans] + clips
        if whole:
            new: list[int] = []
            images: list[ImageItem] = []
            videos: list[VideoItem] = []
            for kind, x in read:
                if kind == "audio":
                    break
                if kind == "text":
                    new += text_ids(x)
                else:
                    (images if kind == "image" else videos).append(x)
                    new += visual_tokens(x)
            keyed, _last, _parent = chain(self.cache, self.tenant, h.ids + new, h.start(), images, videos,
                                          h.parent(self._root))
            keys += [s.key for s in keyed]
        for kind, x in read:
            if kind == "image":
                keys.append(_image_features_key(self.cache, self.tenant, x))
            elif kind == "video":
                keys += video_features_keys(self.cache, self.tenant, x)
            elif kind == "audio":
                keys.append(self._transcript_key(x[0]))
                fallbacks[keys[-1]] = [self._audio_key(x[0])]
        return keys, fallbacks

    # ------------------------------------------------------------------ a turn
    def send(self, items, max_new_tokens: int = 8) -> TurnResult:
        """One user turn (text, image, video and audio items, in order) and its greedy answer. A turn
        that raises (``CapacityError``: no room for it; a lost holder) leaves the conversation
        as it was: its history is replaced only once the answer is complete, and the turn's
        sequences are released on the way out, so a later turn that fits runs as if this one
        had never been sent."""
        if self.closed:
            raise ShapeError("the conversation is closed")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ShapeError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        items = list(items) if not isinstance(items, str | bytes) else [items]
        if not items:
            raise ShapeError("a turn needs at least one item")
        read = [self._read(x) for x in items]             # bad input fails before anything runs
        runs_before = Counter(self.chat.encoder_runs)
        self._embedding_hits = self._video_embedding_hits = 0
        audio = _Clips()
        if self._history:                                  # a stateless request's earlier turns
            h = replay(self.cache, self.tenant, self._root, self._history, lambda r: self._prompt(r, audio))
            self.ids, self.spans, self.images, self.videos = h.ids, h.spans, h.images, h.videos
            self._history = []
        new, images, videos = self._prompt(read, audio)
        answer, keys, hits, cached, media_hits = self._decode(new, images, videos, max_new_tokens)
        runs = Counter(self.chat.encoder_runs)
        runs.subtract(runs_before)
        counters = TurnCounters(
            cached_tokens=cached, prefilled_tokens=len(self.ids) - len(answer) - cached, span_hits=hits,
            span_misses=len(self.spans) - hits, media_hits={**media_hits, "audio": audio.hits},
            embedding_hits=self._embedding_hits,
            encoder_runs={m: runs[m] for m in ("vision", "video", "audio")}, transcript_tokens=audio.generated,
            transcript_hits=audio.cached, video_embedding_hits=self._video_embedding_hits)
        embeds = [_image_features_key(self.cache, self.tenant, im) for im in images]
        embeds += [k for v in videos for k in video_features_keys(self.cache, self.tenant, v)]
        return TurnResult(answer, ids_text(answer), counters, keys + embeds + audio.keys)

    def close(self) -> None:
        """Forget the history (its groups stay cached for whoever asks)."""
        self.closed = True
        self.ids, self.spans, self.images, self.videos = [], [], [], []

    # ------------------------------------------------------------------ steps
    def _prompt(self, read, audio: _Clips) -> tuple[list[int], list[ImageItem], list[VideoItem]]:
        """A turn's prompt tokens, its images and videos; its clips transcribed (``audio``
        counts them)."""
        new: list[int] = []
        images: list[ImageItem] = []
        videos: list[VideoItem] = []
        for kind, x in read:
            if kind == "text":
                new += text_ids(x)
            elif kind in ("image", "video"):
                (images if kind == "image" else videos).append(x)
                new += visual_tokens(x)
            else:
                said, keys, hit, generated = self._transcribe(*x)
                audio.keys += keys
                audio.hits += hit
                audio.generated += generated
                audio.cached += hit and not generated
                new += [AUDIO_START, *said, AUDIO_END]
        return new, images, videos

    def _audio_key(self, data: bytes) -> ContentKey:
        return self.cache.content_key("audio", data, tenant=self.tenant)

    def _read(self, item):
        kind = kind_of(item)
        if kind == "image":
            return kind, ImageItem.read(bytes(item), self.chat.image_processor)
        if kind == "video":
            return kind, VideoItem.read(bytes(item), self.chat.video_processor, self.chat.video_segment)
        if kind == "audio":
            data = bytes(item)
            return kind, (data, AudioFeatures(data, self.chat.feature_extractor))
        return kind, item

    def _transcribe(self, data: bytes, features: AudioFeatures) -> tuple[list[int], list[ContentKey], bool, int]:
        """The clip's transcript ids, the groups read or made, whether the clip was a hit, and
        how many tokens Whisper generated. A ``transcript_ids`` group the tenant holds answers
        with no Whisper run at all; else Whisper runs (its encoder's cross K/V is the tenant's
        ``audio`` group: a hit there skips the encoder) and its transcript is stored."""
        ids_key = self._transcript_key(data)
        said = self._cached_transcript(ids_key)
        if said is not None:
            return said, [ids_key], True, 0
        start = self.chat.whisper.config.decoder_start_token_id
        r = self._whisper.generate(torch.tensor([[start]], device=self.chat.whisper.device), [Media(data, features)],
                                   max_new_tokens=self.chat.transcript_tokens, suppress_tokens=list(SPECIAL))
        said = r.sequences[0, 1:].tolist()
        if said:
            try:
                self.cache.put_embedding(ids_key, torch.tensor(said, dtype=torch.float32)[:, None])
            except CapacityError:      # no room now: Whisper runs again next time
                pass
        audio_key = self.cache.content_key("audio", data, tenant=self.tenant)
        return said, [ids_key, audio_key], bool(r.media_hits), len(said)

    def _transcript_key(self, data: bytes) -> ContentKey:
        return transcript_key(self.cache, self.tenant, data, self.chat.transcript_tokens)

    def _cached_transcript(self, key: ContentKey) -> list[int] | None:
        """The ids in ``key``'s group, or ``None`` when it is not held (or holds no valid ids:
        whole numbers within Whisper's vocabulary; then Whisper runs as on a miss)."""
        if not self.cache.contains(key):
            return None
        try:
            x = self.cache.get_embedding(key).view(-1)
        except MMTierError:            # dropped or unreadable meanwhile: a miss
            return None
        vocab = self.chat.whisper.config.vocab_size
        if x.numel() == 0 or not bool(((x == x.round()) & (x >= 0) & (x < vocab)).all()):
            return None
        return x.long().tolist()

    def _decode(self, new: list[int], images: list[ImageItem], videos: list[VideoItem], max_new_tokens: int):
        """Attach the history, prefill what is missing, generate; seal the new spans."""
        cache, vlm = self.cache, self.chat.vlm
        ids = self.ids + new
        all_images, all_videos = self.images + images, self.videos + videos
        positions, deltas = _positions(vlm, ids, all_images, all_videos)
        positions, deltas = positions.to(vlm.device), deltas.to(vlm.device)
        prompt = torch.tensor([ids], device=vlm.device)
        with cache_for(vlm, cache, tenant=self.tenant) as past:
            rows = past.rows
            rows.ensure(1)
            seq = rows.seqs[0]
            keyed, last, parent = chain(cache, self.tenant, ids, self.spans[-1].end if self.spans else 0,
                                        images, videos, self.spans[-1].key if self.spans else self._root)
            spans = list(self.spans) + keyed
            hits = 0
            while hits < len(spans) and cache.contains(spans[hits].key):
                cache.attach(seq, spans[hits].key)
                hits += 1
            cached = spans[hits].start if hits < len(spans) else last.start
            for layer in past.layers:
                layer.seen = cached
            todo = spans[hits:]
            if todo:                      # one forward over every span the cache lacks
                self._prefill(past, prompt, todo, positions)
                for s, run in zip(todo, rows.self_res[0]):
                    cache.seal(seq, s.key, run)
            rows.next_tokens, rows.next_new_run = [ids[last.start:]], True
            vlm.model.rope_deltas = deltas
            # the prompt's own positions, then +1 a step (as dense generate does: after a video
            # the text may sit below its temporal positions, where the deltas alone would not)
            out = vlm.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), past_key_values=past,
                               position_ids=positions, max_new_tokens=max_new_tokens, do_sample=False,
                               suppress_tokens=list(SPECIAL))
            answer = out[0, len(ids):].tolist()
            end = tail(cache, self.tenant, ids, answer, last, parent)
            cache.seal(seq, end.key)
        attached = spans[len(self.spans):hits]
        media_hits = {m: sum(1 for s in attached if s.modality == m) for m in ("vision", "video")}
        self.ids = ids + answer
        self.spans = spans + [end]
        self.images, self.videos = all_images, all_videos
        return answer, [s.key for s in self.spans], hits, cached, media_hits

    def _image(self, image: ImageItem) -> torch.Tensor:
        """The vision tower's output for ``image`` (``[tokens, hidden]``): a content-only
        ``vision_embed`` group of the tenant, computed only when the cache does not hold it."""
        key = _image_features_key(self.cache, self.tenant, image)
        if self.cache.contains(key):
            self._embedding_hits += 1
            return self.cache.get_embedding(key)
        inputs = image.inputs
        with torch.no_grad():
            device = self.chat.vlm.device
            x = self.chat.vlm.model.get_image_features(inputs["pixel_values"].to(device),
                                                       inputs["image_grid_thw"].to(device)).pooler_output[0]
        try:
            self.cache.put_embedding(key, x)
        except CapacityError:           # no room for it now: used this once, computed again later
            self._embeddings_not_stored += 1
        return x

    def _videos(self, spans: list[_Span]) -> list[torch.Tensor]:
        """The vision tower's output (``[tokens, hidden]``) for each video segment of ``spans``:
        a content-only ``video_embed`` group of the tenant, or computed, the missing segments of
        a turn in ONE vision tower run (it attends within a temporal patch: a segment's output
        is the same alone or with its video)."""
        keys = [video_features_key(self.cache, self.tenant, s.video, *s.part) for s in spans]
        out: list[torch.Tensor | None] = []
        for key in keys:
            held = self.cache.contains(key)
            self._video_embedding_hits += held
            out.append(self.cache.get_embedding(key) if held else None)
        todo = [i for i, x in enumerate(out) if x is None]
        if todo:
            parts = [spans[i].video.segment_inputs(*spans[i].part) for i in todo]
            with torch.no_grad():
                made = self.chat.vlm.model.get_video_features(
                    torch.cat([p["pixel_values_videos"] for p in parts]).to(self.chat.vlm.device),
                    torch.cat([p["video_grid_thw"] for p in parts]).to(self.chat.vlm.device)).pooler_output
            for i, x in zip(todo, made):
                out[i] = x
                try:
                    self.cache.put_embedding(keys[i], x)
                except CapacityError:       # no room for it now: computed again later
                    self._embeddings_not_stored += 1
        return out

    def _prefill(self, past, prompt: torch.Tensor, spans: list[_Span], positions: torch.Tensor) -> None:
        """Run the VLM once over consecutive spans, each a run of its own (``vision`` pool for an
        image, ``video`` for a video segment, whose vision tower output is taken from the cache
        when held, else computed and stored), so each can be sealed as its group: one forward
        however many spans a turn lacks."""
        start, end = spans[0].start, spans[-1].end
        past.rows.next_runs = [RunPlan(s.modality, s.end - s.start,
                                       prompt[0, s.start:s.end].tolist() if s.modality == "text" else None)
                               for s in spans]
        outputs = {}
        images = tuple(self._image(s.image) for s in spans if s.image is not None)
        if images:
            outputs["image"] = BaseModelOutputWithPooling(pooler_output=images)
        videos = [s for s in spans if s.video is not None]
        if videos:
            outputs["video"] = BaseModelOutputWithPooling(pooler_output=tuple(self._videos(videos)))
        extra = {"mm_encoder_outputs": outputs} if outputs else {}
        with torch.no_grad():
            self.chat.vlm(input_ids=prompt[:, start:end], attention_mask=torch.ones(1, end, dtype=torch.long, device=prompt.device),
                          position_ids=positions[..., start:end], past_key_values=past,
                          use_cache=True, logits_to_keep=1, **extra)


@dataclass
class _Clips:
    """What a request's clips did: the groups read or made, clips attached (``hits``), Whisper
    tokens generated, clips whose transcript came from the cache."""

    keys: list[ContentKey] = field(default_factory=list)
    hits: int = 0
    generated: int = 0
    cached: int = 0


def _listed(items) -> list:
    return list(items) if not isinstance(items, str | bytes) else [items]


__all__ = ["Conversation", "TurnCounters", "TurnResult", "transcript_key"]
