"""A tiny random-weight LLaVA (CLIP vision tower, projector, Llama) that ``mmtier serve``'s CPU
configuration and the real-engine tests run in vLLM, built and saved with ``save_pretrained``
with its processor beside it (nothing is downloaded), and the mmtier cache fields that match its
KV layout and its projector's width.

- the tokenizer is built here with the ``tokenizers`` library: a word-level vocabulary
  (``w0 w1 ...``) plus the special tokens LLaVA's processor and vLLM's prompt update look up
  (``<image>``, ``<s>``, ``</s>``, ``<unk>``, ``<pad>``), saved as a ``PreTrainedTokenizerFast``
  with a chat template that joins the messages' text (vLLM puts an ``<image>`` placeholder
  before the text of a message that carries an image);
- the image processor is transformers' PIL/numpy CLIP one (``CLIPImageProcessorPil``, what
  ``CLIPImageProcessor`` is without torchvision), sized so that a 112 x 112 image is 8 x 8
  patches of 14: 64 placeholder tokens.

Why LLaVA and not Qwen2-VL: with transformers 5.19 and no torchvision, Qwen2-VL's processor can
be neither built nor loaded. ``Qwen2VLProcessor`` has a ``video_processor`` attribute;
``ProcessorMixin`` checks it against ``VideoProcessorMixin``, which transformers exports only when
torchvision imports, and ``from_pretrained`` loads it through ``AutoVideoProcessor``, a
placeholder that raises without torchvision. PyPI's torchvision is a CUDA build that fails
beside this CPU torch and no CPU build of it is at hand; LLaVA's processor has no video
attribute. vLLM's LLaVA module still needs one shim without torchvision:
``mmtier.engines.vllm.plugin`` (a vLLM general plugin, run in each of vLLM's processes).

Imports transformers only (inside the builders); vLLM loads the model in its own processes."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

BLOCK = 32                                     # vLLM's CPU backend wants blocks of multiples of 32
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
VOCAB = 512                                    # specials + words w0 .. w506
WORDS = VOCAB - len(SPECIALS)
LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 2, 4, 2, 32, 128
PATCH, IMAGE_SIDE = 14, 112
IMAGE_TOKENS = (IMAGE_SIDE // PATCH) ** 2      # 64: CLIP's patches, its CLS token dropped
EMBED_WIDTH = HIDDEN                           # the projector's output: one LM embedding a token
IMAGE_ID = SPECIALS.index("<image>")
# messages' text, one line each (a string template: vLLM inserts the image placeholders)
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
TINY_LLAVA_VERSION = 1                         # bump when build_llava's output changes


def word(i: int) -> str:
    return f"w{i}"


def build_tokenizer(specials: list[str] = SPECIALS):
    """The word-level tokenizer: ``specials`` (ids 0..), then the ``WORDS`` words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({word(i): len(specials) + i for i in range(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_llava(path: str | Path, *, seed: int = 0) -> Path:
    """A LLaVA-1.5-shaped model: a 2-layer CLIP tower (width 64, patches of 14 on 112 x 112),
    a 2-layer GELU projector to 128, a 2-layer Llama (hidden 128, 4 query / 2 KV heads of 32),
    float32, weights drawn wide so that greedy tokens are far from ties; its tokenizer and
    image processor saved beside it. Returns at once where ``path`` holds a model already."""
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
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                       max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2, pad_token_id=3)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              image_size=IMAGE_SIDE, patch_size=PATCH, projection_dim=64,
                              initializer_range=0.2)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_ID,
                      projector_hidden_act="gelu", vision_feature_select_strategy="default",
                      vision_feature_layer=-1, image_seq_length=IMAGE_TOKENS, tie_word_embeddings=False)
    model = LlavaForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():                      # CLIP's init is narrow: widen it like the rest
        for name, p in model.named_parameters():
            if "vision_tower" in name and p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    llava_hub_layout(path / "model.safetensors")
    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIDE},
                                   crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                   vision_feature_select_strategy="default", image_token="<image>",
                   num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path


def ensure_tiny_llava(root: str | Path | None = None, *, seed: int = 0) -> Path:
    """The tiny LLaVA under ``root`` (default ``$MMTIER_MODELS`` or ``~/.cache/mmtier/models``),
    built there first if missing (``ensure_built``)."""
    return ensure_built(f"tiny-llava-v{TINY_LLAVA_VERSION}-seed{seed}", build_llava, root, seed=seed)


def ensure_built(name: str, build, root: str | Path | None = None, *, seed: int = 0) -> Path:
    """``root/name`` (root: default ``$MMTIER_MODELS`` or ``~/.cache/mmtier/models``), made by
    ``build(path, seed=seed)`` first if missing: into a temporary folder beside it, then
    renamed, so an interrupted build never leaves a half-written model behind."""
    root = Path(root or os.environ.get("MMTIER_MODELS") or Path.home() / ".cache" / "mmtier" / "models")
    path = root / name
    if (path / "config.json").exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=root))
    try:
        build(tmp / "model", seed=seed)
        try:
            (tmp / "model").rename(path)
        except OSError:                        # another process built it meanwhile
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def llava_hub_layout(file: Path) -> None:
    """Rename the tower's weights to LLaVA-1.5's checkpoint layout, which vLLM reads: this
    transformers saves the CLIP tower flat (``vision_tower.embeddings...``), vLLM wants
    ``vision_tower.vision_model.embeddings...``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    renamed = {("vision_tower.vision_model." + k[len("vision_tower."):]
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
               for k, v in tensors.items()}
    save_file(renamed, file, metadata={"format": "pt"})


def image(seed: int, side: int = IMAGE_SIDE):
    """A random RGB picture (PIL), different for every seed."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), "RGB")


def text(seed: int, n: int) -> str:
    """``n`` random words of the tiny vocabulary."""
    rng = random.Random(seed)
    return " ".join(word(rng.randrange(WORDS)) for _ in range(n))


def image_prompt(before: str, after: str) -> str:
    """Text, one image, text: vLLM's prompt update expands ``<image>`` to its 64 tokens."""
    return f"{before} <image> {after}"


def cache_fields(disk_dir: str | Path | None, *, device_pages: int = 256) -> dict:
    """mmtier's cache for the LLaVA: text and ``vision`` KV pools of vLLM-block-sized pages
    (the image's decoder KV), and a ``vision_embed`` pool for the projector's outputs."""
    token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
    return dict(model="tiny-llava-vllm", num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                dtype="float32",
                modalities={"text": {"page_size": BLOCK, "share": 0.5},
                            "vision": {"page_size": BLOCK, "share": 0.25},
                            "vision_embed": {"kind": "embedding", "width": EMBED_WIDTH,
                                             "page_size": IMAGE_TOKENS, "share": 0.25}},
                device="cpu", device_bytes=device_pages * BLOCK * token, host_bytes=0,
                disk_dir=None if disk_dir is None else str(disk_dir), disk_bytes=256 << 20,
                disk_free_floor_bytes=0)
