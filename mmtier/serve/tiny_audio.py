"""A tiny random-weight Qwen2-Audio (Whisper-style audio tower, linear projector, Qwen2) that
vLLM's CPU build runs, built and saved with ``save_pretrained`` with its processor beside it
(nothing is downloaded): the audio model of the real-engine tests and of ``mmtier serve``'s CPU
configuration, as ``tiny_models``' LLaVA is the image model.

- the tokenizer is ``tiny_models``' word-level one with Qwen2-Audio's three audio tokens added
  (``<|AUDIO|>``, ``<|audio_bos|>``, ``<|audio_eos|>``): the processor expands ``<|AUDIO|>`` to
  one token per encoder output frame;
- the feature extractor is transformers' ``WhisperFeatureExtractor`` (numpy only: 128 mel bins,
  16 kHz, 30 s windows, which vLLM's Qwen2-Audio checks), so a clip of ``s`` seconds is
  ``(100 s - 1) // 2 + 1`` frames after the first convolution and a quarter of its 100 frames a
  second after the pooling: 25 placeholder tokens a second;
- the audio tower is 2 layers of width 64 over Whisper's 1500 positions; the language model a
  2-layer Qwen2 of the LLaVA's KV shape (2 KV heads of 32, float32).

Why Qwen2-Audio (``tests/engines/test_vllm_engine_av.py`` says which candidates ran): its vLLM
module and processor import nothing of torchvision, and the model is decoder-only, so both of
mmtier's connectors see its audio as placeholder positions of the prompt, like an image's.

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

AUDIO_SPECIALS = [*SPECIALS, "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
AUDIO_ID = AUDIO_SPECIALS.index("<|AUDIO|>")
AUDIO_VOCAB = len(AUDIO_SPECIALS) + WORDS
SAMPLE_RATE = 16_000
TOKENS_PER_SECOND = 25
AUDIO_PLACEHOLDER = "<|audio_bos|><|AUDIO|><|audio_eos|>"
TINY_AUDIO_VERSION = 1                         # bump when build_qwen2_audio's output changes


def build_qwen2_audio(path: str | Path, *, seed: int = 0, layers: int = LAYERS, hidden: int = HIDDEN) -> Path:
    """The tiny Qwen2-Audio under ``path`` with its processor; returns at once where ``path``
    holds a model already. Weights drawn wide (0.2) so that greedy tokens are far from ties."""
    import torch
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioEncoderConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2Config,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen2_audio.processing_qwen2_audio import Qwen2AudioProcessor

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    text = Qwen2Config(vocab_size=AUDIO_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=hidden // HEAD_DIM, num_key_value_heads=KV_HEADS,
                       max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2, pad_token_id=3)
    audio = Qwen2AudioEncoderConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                                    num_mel_bins=128, max_source_positions=1500, init_std=0.2)
    cfg = Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=AUDIO_ID)
    Qwen2AudioForConditionalGeneration(cfg).to(torch.float32).save_pretrained(path)
    _vllm_layout(path / "model.safetensors")
    Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=SAMPLE_RATE),
                        tokenizer=build_tokenizer(AUDIO_SPECIALS), chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path


def ensure_tiny_qwen2_audio(root: str | Path | None = None, *, seed: int = 0, layers: int = LAYERS,
                            hidden: int = HIDDEN) -> Path:
    """The tiny Qwen2-Audio under ``root`` (``tiny_models.ensure_built``): what
    ``model_source: mmtier://tiny-qwen2-audio`` names in a Serve config. ``layers`` / ``hidden``:
    a larger language model of the same kind (benchmarks: where prefill costs what it costs)."""
    size = "" if (layers, hidden) == (LAYERS, HIDDEN) else f"-{layers}x{hidden}"
    return ensure_built(f"tiny-qwen2-audio-v{TINY_AUDIO_VERSION}-seed{seed}{size}",
                        functools.partial(build_qwen2_audio, layers=layers, hidden=hidden), root, seed=seed)


def _vllm_layout(file: Path) -> None:
    """This transformers saves the language model's layers one ``model.`` deeper than the
    checkpoints vLLM reads (``language_model.model.model.layers...``): renamed back."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    renamed = {k.replace("language_model.model.model.", "language_model.model.", 1): v for k, v in tensors.items()}
    save_file(renamed, file, metadata={"format": "pt"})


def clip(seed: int, seconds: float = 1.0):
    """A waveform (float32 at 16 kHz) different for every seed: three tones of random pitch
    (200 Hz to 6 kHz) and phase over a little noise, so that two clips' spectrograms (and the
    tokens the model answers them with) differ, as two noises' would not."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    tones = sum(0.3 * np.sin(2 * np.pi * f * t + p) for f, p in zip(rng.uniform(200, 6000, 3),
                                                                     rng.uniform(0, 2 * np.pi, 3)))
    return (tones + rng.standard_normal(t.size) * 0.05).astype(np.float32)


def audio_prompt(before: str, after: str) -> str:
    """Text, one clip, text: vLLM's prompt update expands ``<|AUDIO|>`` to the clip's tokens."""
    return f"{before} {AUDIO_PLACEHOLDER} {after}"
