"""Tiny random-weight models for the real-engine tests, built and saved with ``save_pretrained``
(nothing is downloaded), and the mmtier cache fields that match their KV layout.

Imports transformers only: the test driver builds the models; vLLM loads them in its own
processes (``tests/vllm_scenarios.py``)."""

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
