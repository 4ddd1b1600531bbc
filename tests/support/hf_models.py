"""Tiny transformers models built from configs with random weights (no download), and inputs
for them: the architectures the mmtier adapter is held to. Seconds each on a CPU."""

from __future__ import annotations

import torch

IMG = 127          # image token id of the decoder-only VLMs


def tiny_llava():
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=16, patch_size=4, projection_dim=32)
    text = LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=16,       # GQA 3
                       max_position_embeddings=256)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMG,
                      vision_feature_layer=-1, pad_token_id=0)
    return LlavaForConditionalGeneration(cfg).eval()


def llava_inputs(batch: int, seed: int = 0, image_seed: int | None = None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(1, 120, (batch, 5), generator=g), torch.full((batch, 16), IMG),
                     torch.randint(1, 120, (batch, 4), generator=g)], 1)
    gi = torch.Generator().manual_seed(seed if image_seed is None else image_seed)
    return _left_pad(dict(input_ids=ids, pixel_values=torch.randn(batch, 3, 16, 16, generator=gi)))


def _qwen_text(**over):
    text = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    text.update(over)
    return text


QWEN_IDS = dict(image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)


def tiny_qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    cfg = Qwen2VLConfig(text_config=_qwen_text(), vision_config=vision, **QWEN_IDS)
    return Qwen2VLForConditionalGeneration(cfg).eval()


def tiny_qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                  window_size=16, fullatt_block_indexes=[1])
    cfg = Qwen2_5_VLConfig(text_config=_qwen_text(num_attention_heads=4, num_key_value_heads=4),
                           vision_config=vision, **QWEN_IDS)
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def qwen_inputs(batch: int, seed: int = 0, image_seed: int | None = None):
    """One 8x8-patch image per row (16 image tokens after the 2x2 merge)."""
    g = torch.Generator().manual_seed(seed)
    t, h, w = 1, 8, 8
    n_img = t * h * w // 4
    ids = torch.cat([torch.randint(3, 140, (batch, 4), generator=g), torch.full((batch, 1), 152),
                     torch.full((batch, n_img), 150), torch.full((batch, 1), 153),
                     torch.randint(3, 140, (batch, 3), generator=g)], 1)
    gi = torch.Generator().manual_seed(seed if image_seed is None else image_seed)
    pixels = torch.randn(batch * t * h * w, 3 * 2 * 4 * 4, generator=gi)
    grid = torch.tensor([[t, h, w]] * batch)
    out = _left_pad(dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid))
    out["mm_token_type_ids"] = (out["input_ids"] == 150).int()      # M-RoPE for the image tokens
    return out


def tiny_mllama():
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    vision = dict(hidden_size=32, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  intermediate_size=64, image_size=16, patch_size=8, max_num_tiles=2,
                  intermediate_layers_indices=[0], vision_output_dim=64,
                  supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                cross_attention_layers=[1], num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = MllamaConfig(vision_config=vision, text_config=text, image_token_index=126)
    return MllamaForConditionalGeneration(cfg).eval()


def mllama_inputs(batch: int, seed: int = 0, image_seed: int | None = None):
    """One image per row after 3 text tokens; row 1 uses one tile of two (a padded tile)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(3, 120, (batch, 3), generator=g), torch.full((batch, 1), 126),
                     torch.randint(3, 120, (batch, 5), generator=g)], 1)
    gi = torch.Generator().manual_seed(seed if image_seed is None else image_seed)
    pixels = torch.randn(batch, 1, 2, 3, 16, 16, generator=gi)
    tiles = torch.tensor([[2] if b % 2 == 0 else [1] for b in range(batch)])
    ratio_ids = torch.where(tiles == 2, 2, 1)
    ratio_mask = torch.stack([torch.arange(2) < int(tiles[b, 0]) for b in range(batch)]).long().unsqueeze(1)
    cross = torch.zeros(batch, ids.shape[1], 1, 2, dtype=torch.long)
    for b in range(batch):
        cross[b, 3:, 0, : int(tiles[b, 0])] = 1
    out = _left_pad(dict(input_ids=ids, pixel_values=pixels, aspect_ratio_ids=ratio_ids,
                         aspect_ratio_mask=ratio_mask, cross_attention_mask=cross))
    return out


def tiny_whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=128, num_mel_bins=8, encoder_layers=2, decoder_layers=2, d_model=48,
                        encoder_attention_heads=3, decoder_attention_heads=3, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=64,
                        decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        begin_suppress_tokens=None, suppress_tokens=None)
    return WhisperForConditionalGeneration(cfg).eval()


def whisper_inputs(batch: int, seed: int = 0, image_seed: int | None = None):
    gi = torch.Generator().manual_seed(seed if image_seed is None else image_seed)
    return dict(input_features=torch.randn(batch, 8, 32, generator=gi))


def _text_config(**over):
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(over)
    return cfg


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_text_config(head_dim=16))).eval()


def tiny_qwen2(**over):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_text_config(num_key_value_heads=1, **over))).eval()   # GQA 4


def tiny_mistral(sliding_window: int | None = 64):
    """Mistral with a sliding window (64: wider than the prompts here, so it masks nothing)."""
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_text_config(sliding_window=sliding_window))).eval()


def text_inputs(batch: int, seed: int = 0, image_seed: int | None = None, n: int = 12):
    g = torch.Generator().manual_seed(seed)
    return _left_pad(dict(input_ids=torch.randint(3, 120, (batch, n), generator=g)))


def _left_pad(inputs: dict) -> dict:
    """Row 1 (when there is one) gets two left pad tokens in place of its first two tokens."""
    ids = inputs["input_ids"]
    mask = torch.ones_like(ids)
    if ids.shape[0] > 1:
        ids[1, :2] = 0
        mask[1, :2] = 0
        if "cross_attention_mask" in inputs:
            inputs["cross_attention_mask"][1, :2] = 0
    inputs["attention_mask"] = mask
    return inputs


MODELS = {
    "llava": (tiny_llava, llava_inputs),
    "qwen2_vl": (tiny_qwen2_vl, qwen_inputs),
    "qwen2_5_vl": (tiny_qwen2_5_vl, qwen_inputs),
    "mllama": (tiny_mllama, mllama_inputs),
    "whisper": (tiny_whisper, whisper_inputs),
    "llama": (tiny_llama, text_inputs),
    "qwen2": (tiny_qwen2, text_inputs),
    "mistral": (tiny_mistral, text_inputs),
}
