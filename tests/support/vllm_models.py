"""Tiny random-weight models for the real-engine tests, built and saved with ``save_pretrained``
(nothing is downloaded), and the mmtier cache fields that match their KV layout.

Imports transformers only: the test driver builds the models; vLLM loads them in its own
processes (``tests/support/vllm_scenarios.py``)."""

from __future__ import annotations

import json
from pathlib import Path

BLOCK = 32                        # vLLM's CPU backend wants block sizes that are multiples of 32
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32
VOCAB = 512


def build_llama(path: str | Path, *, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 128, 4 query / 2 KV heads of 32) saved in float32. Weights are
    drawn with a wide spread so that greedy tokens are far from ties (a test of equality
    between two engines should not hinge on the last bit)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                      head_dim=HEAD_DIM, max_position_embeddings=4096, initializer_range=0.2,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path)
    return path


def build_lora(base: str | Path, path: str | Path, *, seed: int) -> Path:
    """A rank-8 LoRA adapter over the Llama's q/v projections, in PEFT's file layout
    (``adapter_config.json`` + ``adapter_model.safetensors``), random non-zero weights."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    if (path / "adapter_config.json").exists():
        return path
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    rank, hidden = 8, 128
    tensors = {}
    for layer in range(LAYERS):
        for proj, out in (("q_proj", 128), ("v_proj", KV_HEADS * HEAD_DIM)):
            pre = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.3
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.3
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
        "bias": "none", "base_model_name_or_path": str(base), "task_type": "CAUSAL_LM",
        "lora_dropout": 0.0, "fan_in_fan_out": False}))
    return path


def cache_fields(disk_dir: str | Path | None, *, dtype: str = "float32", device_pages: int = 256,
                 host_bytes: int = 0) -> dict:
    """mmtier's cache for the Llama's KV: one text pool of vLLM-block-sized pages."""
    token = 2 * LAYERS * KV_HEADS * HEAD_DIM * (2 if dtype == "bfloat16" else 4)
    return dict(model="tiny-llama-vllm", num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                dtype=dtype, modalities={"text": {"page_size": BLOCK}},
                device="cpu", device_bytes=device_pages * BLOCK * token, host_bytes=host_bytes,
                disk_dir=None if disk_dir is None else str(disk_dir), disk_bytes=256 << 20,
                disk_free_floor_bytes=0)


def _randomized(model, std: float):
    """Every parameter drawn from N(0, std), norms included: random Gemma / Qwen3-Next weights
    at their initializers repeat one token; these give distinct greedy tokens."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model


GEMMA_WINDOW = 64                 # two vLLM blocks: a 300-token prompt's sliding layers let most go


def build_gemma3(path: str | Path, *, seed: int = 0) -> Path:
    """A 4-layer Gemma 3 (sliding-window layers of 64 tokens, then full attention, twice; hidden
    128, 4 query / 2 KV heads of 32) saved in float32: vLLM's hybrid allocator gives it two KV
    cache groups."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                           max_position_embeddings=4096, sliding_window=GEMMA_WINDOW,
                           layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    _randomized(Gemma3ForCausalLM(cfg).to(torch.float32), 0.1).save_pretrained(path)
    return path


def build_qwen3_next(path: str | Path, *, seed: int = 0) -> Path:
    """A 4-layer Qwen3-Next (Gated DeltaNet layers, then full attention, twice; head_dim 64, a
    2-expert MoE) in bfloat16, the dtype vLLM's CPU build runs its GDN kernels in."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=64,
                          linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64,
                          linear_value_head_dim=64, num_experts=2, num_experts_per_tok=1,
                          moe_intermediate_size=128, shared_expert_intermediate_size=128,
                          layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=4096,
                          tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    _randomized(Qwen3NextForCausalLM(cfg).to(torch.bfloat16), 0.1).save_pretrained(path)
    return path


def gemma3_fields(disk_dir: str | Path | None, *, device_pages: int = 256) -> dict:
    """mmtier's cache for the Gemma 3's KV (all four layers, sliding ones included)."""
    return {**cache_fields(disk_dir, device_pages=device_pages), "model": "tiny-gemma3-vllm", "num_layers": 4,
            "device_bytes": device_pages * BLOCK * 2 * 4 * KV_HEADS * HEAD_DIM * 4}
