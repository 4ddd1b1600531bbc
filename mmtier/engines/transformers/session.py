"""Reuse across requests, as an engine does it: ``Session(model, cache, tenant=...).generate``.

A prompt is cut into spans: runs of text tokens and, for each image, the run of its image
tokens. Each span has a prefix-dependent key chained to the one before (text: its token ids;
image: the bytes of the image, hashed by mmtier), so a span is reused only under the same prefix
(the decoder K/V of an image depends on everything before it). A request attaches the longest
run of spans the cache holds, prefills the missing spans in one forward, each as a run of its own
(image spans in the ``vision`` pool, the vision tower run only for them), seals each under its
key, then generates from the last text span: cached spans are neither re-encoded nor
prefilled. Keys carry the tenant, so another tenant never hits.

Decoder-only models (LLaVA, Qwen2-VL and Qwen2.5-VL with their M-RoPE positions computed over
the whole prompt, text-only Llama / Qwen2 / Mistral) reuse text and image spans. Qwen2-VL and
Qwen2.5-VL also take videos (``Media`` of ``pixel_values_videos`` / ``video_grid_thw``, and
Qwen2.5-VL's ``second_per_grid_ts``; ``video_frames.VideoProcessor`` makes them from MP4
bytes): a video's run of video tokens is cut into **segments** of ``video_segment`` temporal
patches, each a span (and a group in the ``video`` pool) of its own, chained like any span, so a
repeated video runs no vision tower, and a video whose later segments were evicted recomputes
only those (the vision tower over their frames alone: it attends within a temporal patch).
Models that cross-attend media (Mllama's vision K/V, Whisper's encoder K/V) keep that K/V as a
content-only group (``vision`` / ``audio``): any request of the tenant with the same media
attaches it and skips the vision tower or the audio encoder; their text is prefilled per request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import GenerationMixin

from ...cache import TieredKVCache
from ...content import ContentKey
from ...errors import ConfigError, ShapeError, UnsupportedError
from .adapter import VIDEO_TYPES, cache_for
from .cache import RunPlan
from .layout import layout_of
from .video_frames import segment_inputs, segments

SESSION_TYPES = ("llava", "qwen2_vl", "qwen2_5_vl", "llama", "qwen2", "mistral", "mllama", "whisper")
MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl")       # 3-D rotary positions for image tokens


@dataclass(frozen=True)
class Media:
    """One image or video of a request: its bytes (they name it) and what the model's processor
    made of them (``pixel_values``, ... ; a video: ``pixel_values_videos``, ``video_grid_thw``);
    ``params`` are preprocessing settings that change its tokens."""

    data: bytes
    inputs: Mapping[str, torch.Tensor]
    params: Mapping[str, object] = field(default_factory=dict)

    @property
    def is_video(self) -> bool:
        return "video_grid_thw" in self.inputs


@dataclass(frozen=True)
class Span:
    modality: str                 # "text", "vision" or "video" (one segment of a video)
    start: int
    end: int
    media: Media | None = None    # a video segment: the inputs of its frames alone


@dataclass
class SessionResult:
    sequences: torch.Tensor       # [1, prompt + generated]
    logits: tuple[torch.Tensor, ...]
    cached_tokens: int            # prompt tokens attached from the cache (not prefilled)
    prefilled_tokens: int         # prompt tokens run through the model
    media_hits: int               # images whose K/V came from the cache (no vision tower)
    video_segment_hits: int = 0   # video segments whose K/V came from the cache


class Session:
    """Requests of one tenant to one model over one cache."""

    def __init__(self, model, cache: TieredKVCache, *, tenant: str | None = None, text_modality: str = "text",
                 video_segment: int = 2):
        layout = layout_of(model)
        if layout.model_type not in SESSION_TYPES:
            raise UnsupportedError(f"Session supports {SESSION_TYPES}; {layout.model_type!r} is not "
                                   "supported yet (use cache_for for one request)")
        if video_segment < 1:
            raise ConfigError(f"video_segment must be >= 1 temporal patches, got {video_segment}", ("video_segment",))
        self.model, self.cache, self.tenant, self.layout = model, cache, tenant, layout
        self.text_modality = text_modality          # the pool of the decoder's self-attention K/V
        self.image_token = getattr(model.config, "image_token_id", None)
        self.video_token = getattr(model.config, "video_token_id", None) if layout.model_type in VIDEO_TYPES else None
        self.video_segment = video_segment          # temporal patches per video segment (group)

    def _kind(self, token: int) -> str:
        return "vision" if token == self.image_token else "video" if token == self.video_token else "text"

    def spans(self, input_ids: torch.Tensor, media: Sequence[Media]) -> list[Span]:
        ids = input_ids[0].tolist()
        out: list[Span] = []
        start, items = 0, iter(media)
        for i in range(1, len(ids) + 1):
            kind = self._kind(ids[start])
            if i < len(ids) and self._kind(ids[i]) == kind:
                continue
            if kind == "text":
                out.append(Span("text", start, i))
            else:
                item = next(items, None)
                if item is None:
                    raise ShapeError(f"more {kind} token runs in the prompt than media given")
                if item.is_video != (kind == "video"):
                    raise ShapeError(f"the media for the {kind} tokens at {start} is "
                                     f"{'a video' if item.is_video else 'an image'}")
                out += [Span(kind, start, i, item)] if kind == "vision" else self._video_spans(start, i, item)
            start = i
        if next(items, None) is not None:
            raise ShapeError("more media given than image / video token runs in the prompt")
        if not out or out[-1].modality != "text":
            raise ShapeError("the prompt must end with text tokens")
        return out

    def _video_spans(self, start: int, end: int, video: Media) -> list[Span]:
        """A video's run of tokens as its segments: ``video_segment`` temporal patches each."""
        if self.cache.cfg.modalities.get("video") is None:
            raise ConfigError("a video needs a 'video' pool in the cache (config_for makes one)", ("modalities.video",))
        grid = video.inputs["video_grid_thw"]
        if grid.dim() != 2 or grid.shape[0] != 1:
            raise ShapeError(f"a video's Media holds one video: video_grid_thw [1, 3], got {tuple(grid.shape)}")
        t, h, w = (int(x) for x in grid[0])
        merge = self.model.config.vision_config.spatial_merge_size
        per_t = h * w // merge ** 2
        if end - start != t * per_t:
            raise ShapeError(f"a video run of {end - start} tokens for a video of {t * per_t}")
        out = []
        for a, b in segments(t, self.video_segment):
            part = Media(video.data, segment_inputs(video.inputs, a, b), {**video.params, "segment": f"{a}-{b}/{t}"})
            out.append(Span("video", start + a * per_t, start + b * per_t, part))
        return out

    def keys(self, input_ids: torch.Tensor, spans: list[Span], empty: ContentKey) -> list[ContentKey]:
        keys, parent = [], empty
        for s in spans:
            if s.media is None:
                data = input_ids[0, s.start:s.end].to(torch.int64).numpy().tobytes()
                key = self.cache.content_key(self.text_modality, data, tenant=self.tenant, parent=parent,
                                             params={"span": "token-ids"})
            else:
                key = self.cache.content_key(s.modality, s.media.data, tenant=self.tenant, parent=parent,
                                             params=dict(s.media.params))
            keys.append(key)
            parent = key
        return keys

    def generate(self, input_ids: torch.Tensor, media: Sequence[Media] = (), *,
                 max_new_tokens: int = 16, **generate_kwargs) -> SessionResult:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ShapeError(f"Session.generate takes one request: input_ids [1, n], got {tuple(input_ids.shape)}")
        if self.layout.kind != "prefix":
            return self._generate_cross(input_ids, media, max_new_tokens, generate_kwargs)
        spans = self.spans(input_ids, media)
        cache = self.cache
        with cache_for(self.model, cache, tenant=self.tenant, text_modality=self.text_modality) as past:
            rows = past.rows
            rows.ensure(1)
            seq = rows.seqs[0]
            keys = self.keys(input_ids, spans, cache.prefix_key(seq))
            hits = 0
            while hits < len(spans) - 1 and cache.contains(keys[hits]):
                cache.attach(seq, keys[hits])
                hits += 1
            cached = spans[hits].start
            for layer in past.layers:
                layer.seen = cached
            positions = self._positions(input_ids, media)
            prefilled, at = 0, hits
            for chunk in _chunks(spans[hits:-1]):          # one forward per chunk (usually one)
                self._prefill(past, input_ids, chunk, positions)
                for span, run, key in zip(chunk, rows.self_res[0], keys[at:at + len(chunk)]):
                    cache.seal(seq, key, run)
                    prefilled += span.end - span.start
                at += len(chunk)
            last = spans[-1]
            rows.next_tokens = [input_ids[0, last.start:last.end].tolist()]
            if positions.dim() == 3:      # M-RoPE: the prompt's own positions, then +1 a step, as
                generate_kwargs = {**generate_kwargs, "position_ids": positions}   # dense generate does
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      past_key_values=past, max_new_tokens=max_new_tokens, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True, **generate_kwargs)
        return SessionResult(out.sequences, tuple(out.logits), cached, prefilled + last.end - last.start,
                             sum(1 for s in spans[:hits] if s.modality == "vision"),
                             sum(1 for s in spans[:hits] if s.modality == "video"))

    def _positions(self, input_ids: torch.Tensor, media: Sequence[Media]) -> torch.Tensor:
        """Position ids of the whole prompt: ``[1, n]``, or for Qwen2-VL / Qwen2.5-VL the
        ``[4, 1, n]`` text + M-RoPE positions (and the model's rope deltas, set from the whole
        prompt even when every image is cached). ``generate`` is given these positions and steps
        on from the last (as transformers' dense ``generate`` does): after a video whose temporal
        positions run past the text's, the deltas alone would place the last span elsewhere."""
        n = input_ids.shape[1]
        text = torch.arange(n).unsqueeze(0)
        if self.layout.model_type not in MROPE_TYPES or not media:
            return text
        vision, deltas = self.model.model.get_rope_index(input_ids, attention_mask=torch.ones_like(input_ids),
                                                         **mrope_inputs(input_ids, media, self.image_token,
                                                                        self.video_token, self.layout.model_type))
        self.model.model.rope_deltas = deltas
        return torch.cat([text.unsqueeze(0), vision.to(text.dtype)], 0)

    def _prefill(self, past, input_ids: torch.Tensor, spans: list[Span], positions: torch.Tensor) -> None:
        """Run the model once over consecutive spans, each a run of its own (``vision`` pool for
        an image), their images' inputs concatenated (``_chunks`` made sure they can be)."""
        start, end = spans[0].start, spans[-1].end
        past.rows.next_runs = [
            RunPlan(self.text_modality, s.end - s.start, input_ids[0, s.start:s.end].tolist()) if s.media is None
            else RunPlan(s.modality, s.end - s.start) for s in spans]
        extra: dict[str, torch.Tensor] = {}
        for kind in ("vision", "video"):          # images' inputs, then videos' (other names)
            inputs = [s.media.inputs for s in spans if s.modality == kind]
            extra.update({name: torch.cat([m[name] for m in inputs]) for name in inputs[0]} if inputs else {})
        with torch.no_grad():
            self.model(input_ids=input_ids[:, start:end],
                       attention_mask=torch.ones(1, end, dtype=torch.long),
                       position_ids=positions[..., start:end], past_key_values=past, use_cache=True,
                       logits_to_keep=1, **extra)

    def _generate_cross(self, input_ids, media: Sequence[Media], max_new_tokens: int, kwargs) -> SessionResult:
        """Mllama / Whisper: the media's cross-attention K/V is a content-only group; on a hit it
        is attached and the vision tower (audio encoder) does not run. ``input_ids`` are the
        decoder's prompt (Whisper: its decoder prompt)."""
        if len(media) != 1:
            raise UnsupportedError(f"{self.layout.model_type}: one media item per request, got {len(media)}")
        item = media[0]
        cache, layout = self.cache, self.layout
        key = cache.content_key(layout.media, item.data, tenant=self.tenant, params=dict(item.params))
        whisper = layout.kind == "encoder"
        with cache_for(self.model, cache, tenant=self.tenant, text_modality=self.text_modality) as past:
            cross_cache = past.cross_attention_cache if whisper else past
            rows = cross_cache.rows
            rows.ensure_cross(1)
            hit = cache.contains(key)
            extra = dict(kwargs)
            if hit:
                cache.attach(rows.cross_seqs[0], key)
                for i in layout.cross_layers:
                    cross_cache.layers[i].mark_attached(cache.sequence(rows.cross_seqs[0]).length,
                                                        self.model.dtype, self.model.device)
                if whisper:
                    for i in layout.cross_layers:
                        past.is_updated[i] = True
                    extra["encoder_outputs"] = _unread_encoder_states(self.model)
            else:
                rows.next_cross_new_run = True
                extra.update({k: v.to(self.model.device) if torch.is_tensor(v) else v for k, v in item.inputs.items()})
            ids = {"decoder_input_ids": input_ids} if whisper else \
                {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
            # the generic loop: Whisper's own generate copies the cache into dense tensors
            out = GenerationMixin.generate(self.model, **ids, past_key_values=past, max_new_tokens=max_new_tokens,
                                           do_sample=False, output_logits=True, return_dict_in_generate=True,
                                           **extra)
            if not hit:
                cache.seal(rows.cross_seqs[0], key)
        return SessionResult(out.sequences, tuple(out.logits), 0, input_ids.shape[1], int(hit))


def mrope_inputs(input_ids: torch.Tensor, media: Sequence[Media], image_token, video_token,
                 model_type: str) -> dict[str, torch.Tensor]:
    """``get_rope_index``'s media arguments for a prompt and its media in order: token types
    (1 image, 2 video), the grids and, for Qwen2.5-VL, each video's seconds per temporal patch."""
    types = (input_ids == image_token).int()
    if video_token is not None:
        types = types + 2 * (input_ids == video_token).int()
    out: dict[str, torch.Tensor] = {"mm_token_type_ids": types}
    images = [m.inputs["image_grid_thw"] for m in media if not m.is_video]
    videos = [m for m in media if m.is_video]
    if images:
        out["image_grid_thw"] = torch.cat(images)
    if videos:
        out["video_grid_thw"] = torch.cat([m.inputs["video_grid_thw"] for m in videos])
        if model_type == "qwen2_5_vl":
            out["second_per_grid_ts"] = torch.cat([torch.as_tensor(m.inputs["second_per_grid_ts"]).view(-1).float()
                                                   if "second_per_grid_ts" in m.inputs else torch.ones(1)
                                                   for m in videos])
    return out


def _chunks(spans: list[Span]) -> list[list[Span]]:
    """Consecutive spans cut where one forward cannot take them together: a medium whose
    processor outputs do not concatenate with the chunk's first medium of its kind (image or
    video: other names, or tensors of another shape past the first dimension) starts a new
    chunk."""
    out: list[list[Span]] = []
    first: dict[str, Mapping[str, torch.Tensor]] = {}
    for s in spans:
        inputs = s.media.inputs if s.media is not None else None
        if out and inputs is not None and s.modality in first and not _concatenable(first[s.modality], inputs):
            out.append([])
            first = {}
        if not out:
            out.append([])
        out[-1].append(s)
        if inputs is not None:
            first.setdefault(s.modality, inputs)
    return out


def _concatenable(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        isinstance(a[n], torch.Tensor) and isinstance(b[n], torch.Tensor) and a[n].dim() == b[n].dim() >= 1
        and a[n].shape[1:] == b[n].shape[1:] for n in a)


def _unread_encoder_states(model):
    """Whisper with its cross-attention K/V attached: ``generate`` wants encoder outputs, the
    decoder never reads them (every layer's cross K/V is marked updated). Zeros of the shape."""
    from transformers.modeling_outputs import BaseModelOutput

    cfg = model.config
    return BaseModelOutput(last_hidden_state=torch.zeros(1, cfg.max_source_positions, cfg.d_model,
                                                         dtype=model.dtype, device=model.device))
