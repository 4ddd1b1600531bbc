"""The demo's model: a random-weight LLaVA whose language model has the shape of
``benchmarks/engines/vllm_engine.py`` (8 Llama layers, width 512, 8 query / 4 KV heads of 64), so that a
prefill costs what it costs against a load (a hit is ~0.05x the recompute there), and a CLIP
tower on 224 x 224 images (256 image tokens a picture). Built and saved with ``save_pretrained``
(nothing downloaded), its tokenizer and processor beside it: the tiny LLaVA's word-level
tokenizer and chat template (``mmtier.serve.tiny_models``), float32 weights drawn wide so
greedy answers are far from ties."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..serve.tiny_models import (
    CHAT_TEMPLATE,
    IMAGE_ID,
    PATCH,
    VOCAB,
    build_tokenizer,
    llava_hub_layout,
)

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 8, 512, 8, 4, 64, 1408
IMAGE_SIDE = 224
IMAGE_TOKENS = (IMAGE_SIDE // PATCH) ** 2      # 256
DTYPE = "float32"
TOKEN_KV_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4      # 16 KiB a token in float32
DEMO_LLAVA_VERSION = 1


def build_demo_llava(path: str | Path, *, seed: int = 0) -> Path:
    """The model at ``path`` (returns at once where one is saved there)."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava.processing_llava import LlavaProcessor

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                       max_position_embeddings=8192, initializer_range=0.2, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2, pad_token_id=3)
    vision = CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                              image_size=IMAGE_SIDE, patch_size=PATCH, projection_dim=256, initializer_range=0.2)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_ID,
                      projector_hidden_act="gelu", vision_feature_select_strategy="default",
                      vision_feature_layer=-1, image_seq_length=IMAGE_TOKENS, tie_word_embeddings=False)
    model = LlavaForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():                      # CLIP's init is narrow: widen it like the rest
        for name, p in model.named_parameters():
            if "vision_tower" in name and p.dim() > 1:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    llava_hub_layout(path / "model.safetensors")
    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIDE},
                                   crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    LlavaProcessor(image_processor=images, tokenizer=build_tokenizer(), patch_size=PATCH,
                   vision_feature_select_strategy="default", image_token="<image>",
                   num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path


def ensure_demo_llava(root: str | Path | None = None, *, seed: int = 0) -> Path:
    """The model under ``root`` (default ``$MMTIER_MODELS`` or ``~/.cache/mmtier/models``),
    built into a temporary folder beside it first and renamed, so an interrupted build leaves
    nothing half-written."""
    root = Path(root or os.environ.get("MMTIER_MODELS") or Path.home() / ".cache" / "mmtier" / "models")
    path = root / f"demo-llava-v{DEMO_LLAVA_VERSION}-seed{seed}"
    if (path / "config.json").exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=root))
    try:
        build_demo_llava(tmp / "model", seed=seed)
        try:
            (tmp / "model").rename(path)
        except OSError:                        # another process built it meanwhile
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
