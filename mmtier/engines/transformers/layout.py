"""What a transformers model's KV looks like, read from its config: the pools it needs.

``ModelLayout`` names, for every decoder layer index transformers uses, whether the layer is
self-attention (its K/V in the ``text`` pool) or cross-attention (K/V of the media: ``vision``
for Mllama, ``audio`` for Whisper), and that layer's index inside its pool, so pools hold only
the layers that write them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ...errors import UnsupportedError

# model_type -> how its decoder attends media: "prefix" (decoder-only: media tokens are decoder
# tokens), "cross" (cross-attention layers), "encoder" (encoder-decoder, cross-attention to the
# encoder's output in every decoder layer).
SUPPORTED = {
    "llava": "prefix", "qwen2_vl": "prefix", "qwen2_5_vl": "prefix",
    "llama": "prefix", "qwen2": "prefix", "mistral": "prefix",
    "mllama": "cross", "whisper": "encoder",
}
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class ModelLayout:
    model_type: str
    kind: str                          # "prefix" | "cross" | "encoder"
    num_layers: int                    # decoder layers as transformers indexes them
    self_layers: tuple[int, ...]       # decoder layer indices with self-attention K/V
    cross_layers: tuple[int, ...]      # decoder layer indices with cross-attention K/V
    num_kv_heads: int
    cross_kv_heads: int
    head_dim: int
    dtype: str
    media: str | None                  # the modality of cross K/V ("vision", "audio") or None
    sliding_window: int | None = None  # the attention window of some self-attention layers
                                       # (Mistral, Qwen2 with use_sliding_window), or None

    def pool_layer(self, layer_idx: int, cross: bool) -> int:
        """The index of decoder layer ``layer_idx`` inside its pool."""
        layers = self.cross_layers if cross else self.self_layers
        try:
            return layers.index(layer_idx)
        except ValueError:
            kind = "cross" if cross else "self"
            raise UnsupportedError(f"decoder layer {layer_idx} has no {kind}-attention K/V in "
                                   f"{self.model_type}") from None


def layout_of(model) -> ModelLayout:
    """The layout of ``model`` (a transformers ``PreTrainedModel``); ``UnsupportedError`` for
    architectures this adapter has not been checked against."""
    cfg = model.config
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED:
        raise UnsupportedError(f"model type {model_type!r} is not supported by the mmtier adapter; "
                               f"supported: {sorted(SUPPORTED)}")
    dtype = _DTYPES.get(model.dtype)
    if dtype is None:
        raise UnsupportedError(f"model dtype {model.dtype} has no mmtier page dtype")
    kind = SUPPORTED[model_type]
    if kind == "encoder":
        heads = cfg.decoder_attention_heads
        n = cfg.decoder_layers
        every = tuple(range(n))
        return ModelLayout(model_type, kind, n, every, every, heads, heads, cfg.d_model // heads, dtype, "audio")
    text = cfg.get_text_config(decoder=True)
    n = text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    cross = tuple(sorted(getattr(text, "cross_attention_layers", None) or ())) if kind == "cross" else ()
    own = tuple(i for i in range(n) if i not in cross)
    return ModelLayout(model_type, kind, n, own, cross, kv_heads, kv_heads, head_dim, dtype,
                       "vision" if cross else None, _sliding_window(text))


def _sliding_window(text) -> int | None:
    """The window of the decoder's sliding-window layers (a key more than ``window - 1``
    positions before a query is masked), or ``None`` when every layer attends in full."""
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if window is None or (types is not None and "sliding_attention" not in types):
        return None
    return int(window)


def model_identity(model) -> str:
    """The model's identity for content keys: its type, name and a digest of its config and of
    its first and last weights (random-weight models of one config never share keys)."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    params = list(model.parameters())
    for p in (params[0], params[-1]) if params else ():
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    name = getattr(model.config, "_name_or_path", "") or ""
    return f"hf:{model.config.model_type}:{name}:{h.hexdigest()}"
