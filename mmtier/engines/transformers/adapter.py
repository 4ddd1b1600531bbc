"""Hugging Face transformers on mmtier: real model code reading and writing the paged cache.

    from mmtier.engines import transformers as mt
    model = mt.enable(LlavaForConditionalGeneration(cfg))        # decoder attention -> "mmtier"
    cache = TieredKVCache(mt.config_for(model, device_bytes=64 << 20))
    with mt.cache_for(model, cache, tenant="acme") as past:
        out = model.generate(**inputs, past_key_values=past, do_sample=False)

Importing this module registers the attention function ``"mmtier"`` (and its mask function,
transformers' 2D padding mask) with transformers. Needs the ``hf`` extra.
"""

from __future__ import annotations

from typing import Any

from transformers import AttentionInterface
from transformers.cache_utils import EncoderDecoderCache
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from ...cache import TieredKVCache
from ...config import CacheConfig, ModalitySpec
from ...errors import ConfigError, UnsupportedError
from .attention import mmtier_attention
from .cache import MMTierCache, Rows
from .layout import ModelLayout, layout_of, model_identity

NAME = "mmtier"
AttentionInterface.register(NAME, mmtier_attention)
AttentionMaskInterface.register(NAME, flash_attention_mask)

__all__ = ["NAME", "MMTierCache", "VIDEO_TYPES", "cache_for", "config_for", "enable", "layout_of"]

VIDEO_TYPES = ("qwen2_vl", "qwen2_5_vl")     # decoder-only VLMs that take videos (a ``video`` pool)
VIDEO_PAGE = 32                              # tokens a page of the ``video`` pool


def enable(model):
    """Route ``model``'s decoder attention (self and cross) through mmtier; vision and audio
    encoders keep their own implementation. Returns the model."""
    layout = layout_of(model)
    if layout.kind == "encoder":
        model.set_attn_implementation(NAME)   # encoder modules fall back to sdpa (no mmtier cache)
    elif model.config.sub_configs and "text_config" in model.config.sub_configs:
        model.set_attn_implementation({"text_config": NAME})
    else:
        model.set_attn_implementation(NAME)
    model.generation_config.cache_implementation = None
    return model


def config_for(model, *, text_modality: str = "text", **overrides: Any) -> CacheConfig:
    """The ``CacheConfig`` that fits ``model``: layers, KV heads, head dim and dtype of its
    decoder, a ``text`` pool for self-attention and a pool for its media (``vision`` K/V of
    decoder-only VLMs and of Mllama's cross-attention layers, ``audio`` for Whisper's
    encoder states; ``video`` for Qwen2-VL / Qwen2.5-VL video segments, a page size of its own). ``text_modality`` names the self-attention pool (two models sharing one
    cache need two). ``overrides`` set any other field (budgets, ``attention_backend``, ...)."""
    layout = layout_of(model)
    modalities = {text_modality: ModalitySpec(page_size=16, num_layers=len(layout.self_layers))}
    if layout.kind == "prefix":
        modalities["vision"] = ModalitySpec(page_size=64, num_layers=len(layout.self_layers),
                                            recompute_cost=4.0)
        if layout.model_type in VIDEO_TYPES:
            modalities["video"] = ModalitySpec(page_size=VIDEO_PAGE, num_layers=len(layout.self_layers),
                                               recompute_cost=4.0)
    elif layout.media is not None:
        modalities[layout.media] = ModalitySpec(
            page_size=64, num_layers=len(layout.cross_layers), num_kv_heads=layout.cross_kv_heads,
            recompute_cost=4.0)
    fields: dict[str, Any] = dict(
        model=model_identity(model), num_layers=len(layout.self_layers), num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim, dtype=layout.dtype, modalities=modalities,
        device=_device_name(model))
    if fields["device"] == "cpu":
        fields["device_bytes"] = 64 << 20
    fields.update(overrides)
    return CacheConfig(**fields)


def cache_for(model, cache: TieredKVCache, *, tenant: str | None = None, text_modality: str = "text"):
    """The ``past_key_values`` that runs ``model`` over ``cache``: an ``MMTierCache`` (one mmtier
    sequence per batch row), or for an encoder-decoder model the ``EncoderDecoderCache`` of two
    (self-attention, cross-attention). ``release()`` (or ``with``) drops its sequences.
    ``text_modality``: the pool of the decoder's self-attention K/V (as given to ``config_for``)."""
    layout = layout_of(model)
    check_fits(layout, cache.cfg, text_modality)
    if model.config.get_text_config(decoder=True)._attn_implementation != NAME:
        raise UnsupportedError("call enable(model) first: its decoder attention is not 'mmtier'")
    rows = Rows(cache, layout, tenant, text_modality)
    if layout.kind == "encoder":
        return _PairedCache(MMTierCache(rows), MMTierCache(rows, cross=True))
    return MMTierCache(rows)


class _PairedCache(EncoderDecoderCache):
    """``EncoderDecoderCache`` over two mmtier caches of the same rows, releasable as one."""

    def release(self) -> None:
        self.self_attention_cache.release()

    @property
    def sequences(self):
        return self.self_attention_cache.sequences

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_fits(layout: ModelLayout, cfg: CacheConfig, text_modality: str) -> None:
    """``ConfigError`` unless the cache's ``text_modality`` pool has the model's layers, KV
    heads, head dim and dtype."""
    text = cfg.modalities.get(text_modality)
    want = (len(layout.self_layers), layout.num_kv_heads, layout.head_dim, layout.dtype)
    if text is None or (text.num_layers, text.num_kv_heads, text.head_dim, text.dtype) != want:
        raise ConfigError(f"the cache's {text_modality} pool does not fit the model (layers, KV heads, head "
                          f"dim, dtype) = {want}; build its config with config_for(model)",
                          (f"modalities.{text_modality}",))
    if layout.media is not None:
        media = cfg.modalities.get(layout.media)
        want = (len(layout.cross_layers), layout.cross_kv_heads, layout.head_dim, layout.dtype)
        if media is None or (media.num_layers, media.num_kv_heads, media.head_dim, media.dtype) != want:
            raise ConfigError(f"the cache's {layout.media} pool does not fit the model's cross-attention "
                              f"{want}; build its config with config_for(model)", (f"modalities.{layout.media}",))


def _device_name(model) -> str:
    dev = model.device
    return "cpu" if dev.type == "cpu" else f"cuda:{dev.index or 0}"
