"""Hugging Face transformers on mmtier (``pip install mmtier[hf]``): ``adapter`` (``enable``,
``config_for``, ``cache_for``; importing this package registers the attention function
``"mmtier"`` with transformers), ``attention`` (that function), ``cache`` (``MMTierCache``, the
``transformers.Cache``), ``layout`` (a model's pools, read from its config), ``session``
(``Session``: reuse across requests), ``video_frames`` (video bytes as Qwen2-VL inputs, no
torchvision) and ``qwen2_vl_video`` (Qwen2-VL's video processor for vLLM's CPU build).

    from mmtier.engines import transformers as mt
"""

from .adapter import (
    NAME,
    VIDEO_PAGE,
    VIDEO_TYPES,
    MMTierCache,
    cache_for,
    check_fits,
    config_for,
    enable,
    layout_of,
)

__all__ = ["NAME", "MMTierCache", "VIDEO_PAGE", "VIDEO_TYPES", "cache_for", "check_fits", "config_for",
           "enable", "layout_of"]
