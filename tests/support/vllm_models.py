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


QWEN3_NEXT_TYPES = ["linear_attention"] * 3 + ["full_attention"]     # full_attention_interval 4


def build_qwen3_next(path: str | Path, *, seed: int = 0) -> Path:
    """An 8-layer Qwen3-Next at the released family's pattern (Qwen3-Next-80B-A3B, Qwen3.5: three
    Gated DeltaNet layers, then full attention; twice), head_dim 64, a 2-expert MoE, in bfloat16
    (the dtype vLLM's CPU build runs its GDN kernels in). vLLM's hybrid allocator gives it three
    recurrent KV cache groups and one attention group."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                          num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=64,
                          linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64,
                          linear_value_head_dim=64, num_experts=2, num_experts_per_tok=1,
                          moe_intermediate_size=128, shared_expert_intermediate_size=128,
                          full_attention_interval=4, layer_types=QWEN3_NEXT_TYPES * 2,
                          max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                          eos_token_id=2, pad_token_id=0)
    _randomized(Qwen3NextForCausalLM(cfg).to(torch.bfloat16), 0.1).save_pretrained(path)
    return path


# Gemma 3's own pattern (every size: five sliding-window layers, then one full; window 1024 of
# a 128k context at 4B and up), scaled: window 64 (2 blocks), hidden 160 with 4 query / 2 KV
# heads of 32 (GQA 2:1 and heads x head_dim = 0.8 x hidden, as Gemma 3 4B's 8 x 256 / 2560)
GEMMA3_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def build_gemma3_family(path: str | Path, *, layers: int = 6, seed: int = 0) -> Path:
    """A Gemma 3 at the family's 5:1 sliding / full pattern (``layers`` a multiple of 6),
    float32: vLLM's hybrid allocator gives it five sliding-window groups and one full one."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=160, intermediate_size=320, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                           query_pre_attn_scalar=HEAD_DIM, max_position_embeddings=4096,
                           sliding_window=GEMMA_WINDOW, layer_types=GEMMA3_TYPES * (layers // 6),
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    _randomized(Gemma3ForCausalLM(cfg).to(torch.float32), 0.1).save_pretrained(path)
    return path


def gemma3_fields(disk_dir: str | Path | None, *, device_pages: int = 256, layers: int = 4) -> dict:
    """mmtier's cache for a Gemma 3's KV (all ``layers`` layers, sliding ones included)."""
    return {**cache_fields(disk_dir, device_pages=device_pages), "model": "tiny-gemma3-vllm", "num_layers": layers,
            "device_bytes": device_pages * BLOCK * 2 * layers * KV_HEADS * HEAD_DIM * 4}


# gpt-oss's own pattern (gpt-oss-20b / 120b: sliding-window layers of 128 tokens and full ones,
# alternating), scaled: window 64 (2 blocks), hidden 128, 8 query heads to 1 KV head of 32 (its
# GQA 8:1; heads x head_dim = 2 x hidden, as 64 x 64 over 2880 is 1.4x), 4 experts, 2 per token
GPT_OSS_TYPES = ["sliding_attention", "full_attention"]


def build_gpt_oss(path: str | Path, *, layers: int = 4, seed: int = 0) -> Path:
    """A gpt-oss at the family's 1:1 sliding / full pattern, unquantized bfloat16 (vLLM's CPU
    build runs attention sinks in bf16): two KV cache groups."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=1, head_dim=HEAD_DIM, sliding_window=GEMMA_WINDOW,
                       layer_types=GPT_OSS_TYPES * (layers // 2), num_local_experts=4, num_experts_per_tok=2,
                       max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)
    # N(0, 0.5): at 0.1 or 0.2 this tiny gpt-oss repeats one token at near-uniform logprobs
    _randomized(GptOssForCausalLM(cfg).to(torch.bfloat16), 0.5).save_pretrained(path)
    return path


# Granite-4.0-H's own pattern (Mamba-2 layers with one attention layer in ten: H-Tiny / H-Small
# have attention at layers 5, 15, 25, 35 of 40), scaled: 10 layers, attention at layer 5
GRANITE_H_TYPES = ["mamba"] * 5 + ["attention"] + ["mamba"] * 4


def build_granite_h(path: str | Path, *, seed: int = 0) -> Path:
    """A Granite-4.0-H (Mamba-2 and attention, 9:1) in bfloat16, a 2-expert MoE."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = GraniteMoeHybridConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=10,
                                 num_attention_heads=4, num_key_value_heads=KV_HEADS, layer_types=GRANITE_H_TYPES,
                                 num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=128,
                                 mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
                                 mamba_expand=2, mamba_chunk_size=256, position_embedding_type="nope",
                                 max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                                 eos_token_id=2, pad_token_id=0)
    _randomized(GraniteMoeHybridForCausalLM(cfg).to(torch.bfloat16), 0.1).save_pretrained(path)
    return path
