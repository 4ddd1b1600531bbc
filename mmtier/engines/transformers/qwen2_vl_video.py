"""Qwen2-VL's video processor without torchvision, for vLLM's CPU build (bound in by
``vllm.plugin``).

transformers' ``Qwen2VLVideoProcessor`` imports torchvision, whose PyPI build does not run beside
CPU torch. ``Qwen2VLVideoProcessorPil`` makes the same inputs from parts that do run: each
frame resized, rescaled and normalised by the model's PIL image processor and the frames'
patches laid out as the video processor lays them out (``video_frames.VideoProcessor``:
``pixel_values_videos [t * h * w, C * tps * p * p]``, ``video_grid_thw [[t, h, w]]``). Frames
come already sampled (vLLM samples them when it loads a video); a count that is not a multiple
of ``temporal_patch_size`` is padded with the last frame, as transformers pads it. The one
difference from the torchvision path: Pillow resizes the frames.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.video_processing_utils import VideoProcessorMixin

from .video_frames import VideoProcessor

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


class Qwen2VLVideoProcessorPil(VideoProcessorMixin):
    """``Qwen2VLVideoProcessor``'s interface over Pillow and numpy (module docstring)."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, *, patch_size: int = 14, merge_size: int = 2, temporal_patch_size: int = 2,
                 size: dict[str, int] | None = None, image_mean: list[float] | None = None,
                 image_std: list[float] | None = None, **kwargs: Any):
        kwargs.pop("video_processor_type", None)
        super().__init__(**kwargs)
        self.patch_size, self.merge_size, self.temporal_patch_size = patch_size, merge_size, temporal_patch_size
        self.size = dict(size or {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28})
        self.image_mean = list(image_mean or OPENAI_CLIP_MEAN)
        self.image_std = list(image_std or OPENAI_CLIP_STD)
        self._frames = VideoProcessor(self)

    def to_dict(self) -> dict[str, Any]:
        return {"patch_size": self.patch_size, "merge_size": self.merge_size,
                "temporal_patch_size": self.temporal_patch_size, "size": dict(self.size),
                "image_mean": self.image_mean, "image_std": self.image_std,
                "video_processor_type": type(self).__name__}

    def get_num_of_video_patches(self, num_frames: int, height: int, width: int, videos_kwargs=None) -> int:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor, self.size["shortest_edge"], self.size["longest_edge"])
        t = (num_frames + (-num_frames % self.temporal_patch_size)) // self.temporal_patch_size
        return t * (h // self.patch_size) * (w // self.patch_size)

    def __call__(self, videos: Any = None, **kwargs: Any) -> BatchFeature:
        return self.preprocess(videos, **kwargs)

    def preprocess(self, videos: Any, **kwargs: Any) -> BatchFeature:
        """Each video (frames as a ``[T, H, W, 3]`` array or a list of ``[H, W, 3]`` ones, uint8
        RGB) to its patches; the batch's rows concatenated, one grid row per video."""
        pixels, grids = [], []
        for video in _videos(videos):
            frames = [np.asarray(f) for f in video]
            frames += [frames[-1]] * (-len(frames) % self.temporal_patch_size)
            out = self._frames.from_frames(frames)
            pixels.append(out["pixel_values_videos"])
            grids.append(out["video_grid_thw"])
        return BatchFeature({"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.cat(grids)},
                            tensor_type=None)


def _videos(videos: Any) -> list:
    """A batch of videos as a list: one ``[T, H, W, C]`` array (or a list of frames) or a list
    of them; a ``(frames, metadata)`` pair counts as its frames."""
    if isinstance(videos, tuple) and len(videos) == 2 and isinstance(videos[1], dict):
        videos = videos[0]
    if isinstance(videos, np.ndarray) and videos.ndim == 4:
        return [videos]
    if isinstance(videos, (list, tuple)) and videos and isinstance(videos[0], np.ndarray) and videos[0].ndim == 3:
        return [videos]
    return [v[0] if isinstance(v, tuple) else v for v in videos]
