"""A tiny random-weight Qwen2-VL (its vision tower, merger and a Qwen2 with M-RoPE) that vLLM's
CPU build runs for video, built and saved with ``save_pretrained`` with its processor beside it
(nothing is downloaded): the video model of the real-engine tests, as ``tiny_models``' LLaVA is
the image model and ``tiny_audio``'s Qwen2-Audio the audio one.

- the tokenizer is ``tiny_models``' word-level one with Qwen2-VL's vision tokens added;
- the processor is transformers' ``Qwen2VLProcessor`` over the PIL image processor and mmtier's
  torchvision-free video processor (``mmtier.engines.transformers.qwen2_vl_video``), which mmtier's vLLM
  plugin binds in where torchvision does not import (``vllm.plugin``); building it needs the
  same binding, done here first;
- frames are 56 x 56 (2 x 2 merged patches of 14 after the merge: 4 tokens a temporal patch of 2
  frames), so a video of 8 frames is 16 placeholder tokens;
- the language model has the LLaVA's KV shape (2 layers, 2 KV heads of 32, float32).

Imports transformers only (inside the builders)."""

from __future__ import annotations

import functools
from pathlib import Path

from .tiny_models import (
    CHAT_TEMPLATE,
    HEAD_DIM,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    SPECIALS,
    WORDS,
    build_tokenizer,
    ensure_built,
)

VIDEO_SPECIALS = [*SPECIALS, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VIDEO_ID = VIDEO_SPECIALS.index("<|video_pad|>")
VIDEO_VOCAB = len(VIDEO_SPECIALS) + WORDS
PATCH, MERGE, TEMPORAL = 14, 2, 2
SIDE = PATCH * MERGE * 2                       # 56: 4 x 4 patches, 2 x 2 tokens a temporal patch
TOKENS_PER_FRAME_PAIR = (SIDE // PATCH // MERGE) ** 2
MROPE_SECTION = [4, 6, 6]                      # t, h, w rotary pairs: HEAD_DIM // 2 in all
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
TINY_VIDEO_VERSION = 1                         # bump when build_qwen2_vl's output changes


def build_qwen2_vl(path: str | Path, *, seed: int = 0, layers: int = LAYERS, hidden: int = HIDDEN) -> Path:
    """The tiny Qwen2-VL under ``path`` with its processor; returns at once where ``path`` holds
    a model already. Weights drawn wide (0.2) so that greedy tokens are far from ties."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from ..engines.vllm.plugin import torchvision_free_vllm

    torchvision_free_vllm()
    from transformers.models.qwen2_vl import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..engines.transformers.qwen2_vl_video import Qwen2VLVideoProcessorPil

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    heads = hidden // HEAD_DIM
    text = dict(vocab_size=VIDEO_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=KV_HEADS, max_position_embeddings=4096,
                rope_scaling={"type": "mrope", "rope_type": "default", "mrope_section": MROPE_SECTION},
                initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                pad_token_id=3)
    vision = dict(depth=2, embed_dim=64, hidden_size=hidden, num_heads=4, mlp_ratio=2, in_channels=3,
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, initializer_range=0.2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=VIDEO_SPECIALS.index("<|image_pad|>"),
                        video_token_id=VIDEO_ID, vision_start_token_id=VIDEO_SPECIALS.index("<|vision_start|>"),
                        vision_end_token_id=VIDEO_SPECIALS.index("<|vision_end|>"), tie_word_embeddings=False)
    model = Qwen2VLForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name and p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    size = {"shortest_edge": SIDE * SIDE, "longest_edge": SIDE * SIDE}
    images = Qwen2VLImageProcessorPil(size=size, patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL)
    videos = Qwen2VLVideoProcessorPil(size=size, patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL)
    Qwen2VLProcessor(image_processor=images, tokenizer=build_tokenizer(VIDEO_SPECIALS), video_processor=videos,
                     chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path


def ensure_tiny_qwen2_vl(root: str | Path | None = None, *, seed: int = 0, layers: int = LAYERS,
                         hidden: int = HIDDEN) -> Path:
    """The tiny Qwen2-VL under ``root`` (``tiny_models.ensure_built``); ``layers`` / ``hidden``:
    a larger language model of the same kind (benchmarks)."""
    size = "" if (layers, hidden) == (LAYERS, HIDDEN) else f"-{layers}x{hidden}"
    return ensure_built(f"tiny-qwen2-vl-v{TINY_VIDEO_VERSION}-seed{seed}{size}",
                        functools.partial(build_qwen2_vl, layers=layers, hidden=hidden), root, seed=seed)


def frames(seed: int, n: int = 8):
    """``n`` RGB frames of ``SIDE`` x ``SIDE`` (uint8 ``[n, H, W, 3]``), different for every
    seed: each patch of 14 x 14 one random colour, so that two videos' patches (and the tokens
    the model answers them with) differ, as two noises' would not."""
    import numpy as np

    rng = np.random.default_rng(seed)
    cells = rng.integers(0, 256, (n, SIDE // PATCH, SIDE // PATCH, 3), dtype=np.uint8)
    return cells.repeat(PATCH, axis=1).repeat(PATCH, axis=2)


def video_prompt(before: str, after: str) -> str:
    """Text, one video, text: vLLM's prompt update expands ``<|video_pad|>`` to its tokens."""
    return f"{before} {VIDEO_PLACEHOLDER} {after}"
