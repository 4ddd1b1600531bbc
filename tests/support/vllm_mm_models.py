"""The tiny random-weight LLaVA of the real-engine multimodal tests: it lives in the package
(``mmtier.serve.tiny_models``: ``mmtier serve``'s CPU configuration runs it too), and the
torchvision shim vLLM's LLaVA module needs here is mmtier's vLLM plugin
(``mmtier.engines.vllm.plugin``). Re-exported for the tests."""

from mmtier.engines.vllm.plugin import torchvision_free_vllm
from mmtier.serve.tiny_models import (
    BLOCK,
    EMBED_WIDTH,
    IMAGE_SIDE,
    IMAGE_TOKENS,
    SPECIALS,
    VOCAB,
    WORDS,
    build_llava,
    build_tokenizer,
    cache_fields,
    image,
    image_prompt,
    text,
    word,
)

__all__ = ["BLOCK", "EMBED_WIDTH", "IMAGE_SIDE", "IMAGE_TOKENS", "SPECIALS", "VOCAB", "WORDS", "build_llava",
           "build_tokenizer", "cache_fields", "image", "image_prompt", "text", "torchvision_free_vllm", "word"]
