"""The dense reference of a ``ChatModel`` conversation: what a server with no KV reuse does.

Each turn recomputes the conversation so far from its raw items: every image through the image
processor and the vision tower, every video (all its frames) through the video processor and
the vision tower at once, every clip through the feature extractor and Whisper (encoder
and decoder, ``DynamicCache`` + sdpa), then the VLM over the whole prompt (earlier prompts and
answers included) and its greedy answer, with transformers' own ``DynamicCache`` and sdpa
attention (the models as loaded, not enabled for mmtier). The tokens must equal the cached
conversation's, turn by turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationMixin

from .media import (
    AUDIO_END,
    AUDIO_START,
    IMAGE_PAD,
    SPECIAL,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    AudioFeatures,
    ImageItem,
    VideoItem,
    kind_of,
    text_ids,
)


def dense_turn(chat, history: Sequence[tuple[Sequence, list[int]]], items: Sequence,
               max_new_tokens: int = 8) -> list[int]:
    """The answer to ``items`` after ``history`` (earlier turns' items and answers), all of it
    recomputed densely."""
    ids: list[int] = []
    pixels, grids = [], []
    video_pixels, video_grids, seconds = [], [], []
    for turn, answer in [*history, (items, None)]:
        for x in ([turn] if isinstance(turn, str | bytes) else turn):
            kind = kind_of(x)
            if kind == "text":
                ids += text_ids(x)
            elif kind == "image":
                image = ImageItem.read(bytes(x), chat.image_processor)
                inputs = image.inputs
                pixels.append(inputs["pixel_values"])
                grids.append(inputs["image_grid_thw"])
                ids += [VISION_START, *[IMAGE_PAD] * image.tokens, VISION_END]
            elif kind == "video":
                video = VideoItem.read(bytes(x), chat.video_processor, chat.video_segment)
                inputs = video.inputs
                video_pixels.append(inputs["pixel_values_videos"])
                video_grids.append(inputs["video_grid_thw"])
                seconds.append(video.second_per_grid)
                ids += [VISION_START, *[VIDEO_PAD] * video.tokens, VISION_END]
            else:
                ids += [AUDIO_START, *_transcribe(chat, bytes(x)), AUDIO_END]
        if answer is not None:
            ids += answer
    device = chat.dense_vlm.device
    prompt = torch.tensor([ids], device=device)
    extra = {}
    if pixels:
        extra.update(pixel_values=torch.cat(pixels), image_grid_thw=torch.cat(grids))
    if video_pixels:
        extra.update(pixel_values_videos=torch.cat(video_pixels), video_grid_thw=torch.cat(video_grids))
        if chat.dense_vlm.config.model_type == "qwen2_5_vl":
            extra["second_per_grid_ts"] = torch.tensor(seconds)
    extra = {k: v.to(device) for k, v in extra.items()}
    if extra:
        extra["mm_token_type_ids"] = (prompt == IMAGE_PAD).int() + 2 * (prompt == VIDEO_PAD).int()
    out = chat.dense_vlm.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **extra,
                                  max_new_tokens=max_new_tokens, do_sample=False, suppress_tokens=list(SPECIAL))
    return out[0, len(ids):].tolist()


def dense_chat(chat, turns: Sequence[Sequence], max_new_tokens: int = 8) -> list[list[int]]:
    """Every turn's answer, each turn recomputed from the start (``dense_turn``)."""
    history: list[tuple[Sequence, list[int]]] = []
    for items in turns:
        history.append((items, dense_turn(chat, history, items, max_new_tokens)))
    return [answer for _, answer in history]


def _transcribe(chat, data: bytes) -> list[int]:
    device = chat.dense_whisper.device
    features = AudioFeatures(data, chat.feature_extractor)["input_features"].to(device)
    start = chat.dense_whisper.config.decoder_start_token_id
    out = GenerationMixin.generate(chat.dense_whisper, decoder_input_ids=torch.tensor([[start]], device=device),
                                   input_features=features, max_new_tokens=chat.transcript_tokens,
                                   do_sample=False, suppress_tokens=list(SPECIAL))
    return out[0, 1:].tolist()
