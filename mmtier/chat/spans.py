"""A chat conversation's token ids as spans, their content keys and their M-RoPE positions.

Spans: runs of text tokens; an image's run of ``IMAGE_PAD`` tokens; a video's run of
``VIDEO_PAD`` tokens cut into its **segments** (``VideoItem.segments``: a fixed span of temporal
patches each, the last maybe shorter), each a span of its own. Each span is sealed as a group
keyed by its content chained to the span before (prefix-dependent); a video segment's key names
the video's bytes, the sampling settings and which temporal patches it holds.

Content-only groups a span reads: an image's vision tower output (``vision_embed``), a video
segment's (``video_embed``), a clip's transcript ids (``transcript_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..content import ContentKey
from ..errors import ShapeError
from .media import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, ImageItem, VideoItem


@dataclass(frozen=True)
class Span:
    modality: str                       # "text" | "vision" | "video" (one segment of a video)
    start: int
    end: int
    image: ImageItem | None = None
    key: ContentKey | None = None
    video: VideoItem | None = None
    part: tuple[int, int] | None = None   # a video segment's temporal patches [a, b)


def visual_tokens(item: ImageItem | VideoItem) -> list[int]:
    """The prompt tokens of an image or a video: its pad tokens between the vision markers."""
    pad = IMAGE_PAD if isinstance(item, ImageItem) else VIDEO_PAD
    return [VISION_START, *[pad] * item.tokens, VISION_END]


def cut(ids: list[int], start: int, images: list[ImageItem], videos: list[VideoItem]) -> list[Span]:
    """``ids[start:]`` as spans: text runs, one run per image, a run per video segment."""
    out: list[Span] = []
    image_it, video_it = iter(images), iter(videos)
    i = start
    while i < len(ids):
        kind = ids[i] if ids[i] in (IMAGE_PAD, VIDEO_PAD) else None
        j = i
        while j < len(ids) and (ids[j] if ids[j] in (IMAGE_PAD, VIDEO_PAD) else None) == kind:
            j += 1
        if kind == IMAGE_PAD:
            image = next(image_it)
            if j - i != image.tokens:
                raise ShapeError(f"an image run of {j - i} tokens for an image of {image.tokens}")
            out.append(Span("vision", i, j, image))
        elif kind == VIDEO_PAD:
            video = next(video_it)
            if j - i != video.tokens:
                raise ShapeError(f"a video run of {j - i} tokens for a video of {video.tokens}")
            at = i
            for a, b in video.segments:
                n = video.segment_tokens(a, b)
                out.append(Span("video", at, at + n, video=video, part=(a, b)))
                at += n
        else:
            out.append(Span("text", i, j))
        i = j
    return out


def span_key(cache, tenant, ids: list[int], span: Span, parent: ContentKey) -> ContentKey:
    """The prefix-dependent key of ``span`` after ``parent``."""
    if span.image is not None:
        return cache.content_key("vision", span.image.data, tenant=tenant, parent=parent)
    if span.video is not None:
        return cache.content_key("video", span.video.data, tenant=tenant, parent=parent,
                                 params=video_params(span.video, *span.part))
    data = torch.tensor(ids[span.start:span.end], dtype=torch.int64).numpy().tobytes()
    return cache.content_key("text", data, tenant=tenant, parent=parent, params={"span": "token-ids"})


def video_params(video: VideoItem, a: int, b: int) -> dict[str, str]:
    return {**video.processor.params, "segment": f"{a}-{b}/{video.grid[0]}"}


def image_features_key(cache, tenant, image: ImageItem) -> ContentKey:
    return cache.content_key("vision_embed", image.data, tenant=tenant,
                             params={"grid": "x".join(map(str, image.grid))})


def video_features_key(cache, tenant, video: VideoItem, a: int, b: int) -> ContentKey:
    """The vision tower's output for temporal patches ``[a, b)`` of ``video``: content-only."""
    return cache.content_key("video_embed", video.data, tenant=tenant,
                             params={**video_params(video, a, b), "grid": "x".join(map(str, video.grid))})


def video_features_keys(cache, tenant, video: VideoItem) -> list[ContentKey]:
    return [video_features_key(cache, tenant, video, a, b) for a, b in video.segments]


def transcript_key(cache, tenant, data: bytes, tokens: int) -> ContentKey:
    """A clip's ``transcript_ids`` group: the tenant's, for ``tokens`` greedy tokens."""
    return cache.content_key("transcript_ids", data, tenant=tenant, params={"tokens": str(tokens)})


def positions(vlm, ids: list[int], images: list[ImageItem], videos: list[VideoItem]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[4, 1, n]`` positions (text + M-RoPE) of the whole conversation, and its deltas."""
    n = len(ids)
    text = torch.arange(n).view(1, 1, n)
    if not images and not videos:
        return text.expand(4, 1, n), torch.zeros(1, 1, dtype=torch.long)
    prompt = torch.tensor([ids])
    extra: dict[str, torch.Tensor] = {}
    if images:
        extra["image_grid_thw"] = torch.tensor([im.grid for im in images])
    if videos:
        extra["video_grid_thw"] = torch.tensor([v.grid for v in videos])
        if vlm.config.model_type == "qwen2_5_vl":
            extra["second_per_grid_ts"] = torch.tensor([v.second_per_grid for v in videos])
    types = (prompt == IMAGE_PAD).int() + 2 * (prompt == VIDEO_PAD).int()
    vision, deltas = vlm.model.get_rope_index(prompt, mm_token_type_ids=types,
                                              attention_mask=torch.ones_like(prompt), **extra)
    return torch.cat([text, vision.to(text.dtype)], 0), deltas
