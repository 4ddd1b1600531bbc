"""``ReferenceModel``: a small deterministic multimodal LM (seeded random weights, nothing
downloaded). It exists to drive the demo, the Serve app, the benchmarks and the end-to-end
tests with real attention through the cache, and to check it: every answer the cached path
gives (``generate`` / ``chat``) must equal what the plain dense implementation gives
(``generate_dense`` / ``chat_dense``: no cache, torch attention over concatenated K/V).

The model: a patch-embedding vision encoder and a frame audio encoder (``encoders.py``), and a
decoder-only LM over byte tokens (vocab 256: ``Text("hi")`` is its UTF-8 bytes) with media
tokens interleaved LLaVA-style plus gated cross-attention layers (``decoder.py``). Its cache
layout (``reference_config``), one modality per kind of stored state:

=================  ==========  ======================================================  =====
modality           kind        what it holds                                           key
=================  ==========  ======================================================  =====
text               kv          decoder self-attention K/V of text (appended)           chain
vision, audio      kv          decoder self-attention K/V of media tokens              parent
vision_xattn, ...  kv          cross-attention K/V (``num_cross_layers`` layers)       content
vision_embed, ...  embedding   encoder outputs                                         content
=================  ==========  ======================================================  =====

"parent" keys chain ``cache.prefix_key(seq)``: reused only under the same prefix; "content"
keys depend on the media (and tenant) alone: reused at any position. The cached path lives in
``session.py``.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmtier.config import CacheConfig, ModalitySpec
from mmtier.errors import ConfigError

from .decoder import Decoder, DecoderDims
from .encoders import AudioEncoder, MediaError, ModelError, VisionEncoder
from .ops import attend

MEDIA = ("vision", "audio")
PAGE_SIZES = {"text": 16, "vision": 64, "audio": 25}
WIDTHS = {"vision": 64, "audio": 48}
DEFAULT_SHARES = {
    "text": 0.16, "vision": 0.30, "audio": 0.16, "vision_xattn": 0.15, "audio_xattn": 0.08,
    "vision_embed": 0.08, "audio_embed": 0.07,
}


def cross_modality(media: str) -> str:
    return f"{media}_xattn"


def embed_modality(media: str) -> str:
    return f"{media}_embed"


class PromptError(ModelError, ValueError):
    """A prompt the model cannot take: empty, unknown item, token id out of the vocabulary."""


# ---------------------------------------------------------------------------- prompts
@dataclass(frozen=True, init=False)
class Text:
    """Text token ids (a ``str`` becomes its UTF-8 bytes: the vocabulary is the 256 bytes)."""

    ids: tuple[int, ...]

    def __init__(self, ids: str | Sequence[int]):
        if isinstance(ids, str):
            ids = ids.encode()
        try:
            object.__setattr__(self, "ids", tuple(int(i) for i in ids))
        except (TypeError, ValueError) as exc:
            raise PromptError(f"text ids must be integers: {exc}") from None


@dataclass(frozen=True)
class Media:
    """A media item: ``modality`` is 'vision' or 'audio'; ``data`` the raw bytes."""

    modality: str
    data: bytes = field(repr=False)


def Image(data: bytes) -> Media:  # noqa: N802  (reads as a prompt item)
    return Media("vision", data)


def Audio(data: bytes) -> Media:  # noqa: N802
    return Media("audio", data)


Item = Text | Media


@dataclass
class ModelCounters:
    """What the cached path did (the dense path counts nothing). Thread-safe increments."""

    encoder_runs: Counter = field(default_factory=Counter)       # by media modality
    embedding_hits: Counter = field(default_factory=Counter)     # encoder skipped
    cross_hits: Counter = field(default_factory=Counter)         # cross-attn K/V reused
    cross_misses: Counter = field(default_factory=Counter)
    self_hits: Counter = field(default_factory=Counter)          # media self-attn K/V reused
    self_misses: Counter = field(default_factory=Counter)
    decoder_tokens: int = 0                                      # positions run through all layers
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, modality: str | None = None, n: int = 1) -> None:
        with self._lock:
            if modality is None:
                setattr(self, name, getattr(self, name) + n)
            else:
                getattr(self, name)[modality] += n

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {"encoder_runs": dict(self.encoder_runs), "embedding_hits": dict(self.embedding_hits),
                    "cross_hits": dict(self.cross_hits), "cross_misses": dict(self.cross_misses),
                    "self_hits": dict(self.self_hits), "self_misses": dict(self.self_misses),
                    "decoder_tokens": self.decoder_tokens}


# ---------------------------------------------------------------------------- cache layout
def model_id(seed: int, dims: DecoderDims) -> str:
    """The model identity that enters every content key: weights differ per seed and dims."""
    digest = hashlib.sha256(repr((dims, WIDTHS)).encode()).hexdigest()
    return f"mmtier-reference-v1:seed={seed}:dims={digest}"


def reference_config(device_bytes: int = 16 << 20, host_bytes: int = 0,
                     disk_dir: str | Path | None = None, disk_bytes: int = 1 << 30, *,
                     seed: int = 0, dims: DecoderDims | None = None,
                     shares: dict[str, float] | None = None, **overrides) -> CacheConfig:
    """The ``CacheConfig`` of ``ReferenceModel(seed, dims)``: seven modalities (see the module
    docstring). ``shares`` (fractions of the device arena per modality) default to
    ``DEFAULT_SHARES``; ``overrides`` go to ``CacheConfig`` (eviction_policy, device, ...)."""
    d = dims or DecoderDims()
    shares = DEFAULT_SHARES if shares is None else shares
    mods: dict[str, ModalitySpec] = {"text": ModalitySpec(page_size=PAGE_SIZES["text"],
                                                          share=shares.get("text"))}
    cost = {"vision": 4.0, "audio": 2.0}
    for m in MEDIA:
        page = PAGE_SIZES[m]
        mods[m] = ModalitySpec(page_size=page, share=shares.get(m), recompute_cost=cost[m] / 2)
        mods[cross_modality(m)] = ModalitySpec(
            page_size=page, num_layers=d.num_cross_layers, share=shares.get(cross_modality(m)),
            recompute_cost=cost[m])
        mods[embed_modality(m)] = ModalitySpec(
            kind="embedding", width=WIDTHS[m], page_size=page, share=shares.get(embed_modality(m)),
            recompute_cost=cost[m] * 2)
    return CacheConfig(
        model=model_id(seed, d), num_layers=d.num_layers, num_kv_heads=d.num_kv_heads,
        head_dim=d.head_dim, dtype="float32", modalities=mods, device_bytes=device_bytes,
        host_bytes=host_bytes, disk_dir=disk_dir, disk_bytes=disk_bytes, **overrides)


# ---------------------------------------------------------------------------- the model
class ReferenceModel:
    """Weights, prompt validation, the dense path, and the entry points of the cached path."""

    def __init__(self, seed: int = 0, dims: DecoderDims | None = None):
        self.seed = seed
        self.dims = dims or DecoderDims()
        self.model_id = model_id(seed, self.dims)
        base = int.from_bytes(hashlib.sha256(f"mmtier-reference:{seed}".encode()).digest()[:6], "little")
        self.encoders: dict[str, VisionEncoder | AudioEncoder] = {
            "vision": VisionEncoder(base + 1, width=WIDTHS["vision"]),
            "audio": AudioEncoder(base + 2, width=WIDTHS["audio"]),
        }
        self.decoder = Decoder(self.dims, WIDTHS, base + 3)
        self.counters = ModelCounters()

    # ---- cache
    def cache_config(self, device_bytes: int = 16 << 20, host_bytes: int = 0,
                     disk_dir: str | Path | None = None, **kw) -> CacheConfig:
        return reference_config(device_bytes, host_bytes, disk_dir, seed=self.seed, dims=self.dims, **kw)

    def check_cache(self, cache) -> None:
        """``ConfigError`` unless ``cache`` has this model's identity and payload layouts."""
        cfg = cache.cfg
        if cfg.model != self.model_id:
            raise ConfigError(f"cache is configured for model {cfg.model!r}, not {self.model_id!r}",
                              ("model",))
        want = reference_config(seed=self.seed, dims=self.dims)
        for name, spec in want.modalities.items():
            have = cfg.modalities.get(name)
            fields = ("kind", "num_layers", "num_kv_heads", "head_dim", "dtype", "width")
            bad = [f for f in fields if have is None or getattr(have, f) != getattr(spec, f)]
            if bad:
                raise ConfigError(f"modality {name!r} does not fit the reference model "
                                  f"({'missing' if have is None else ', '.join(bad)})",
                                  tuple(f"modalities.{name}.{f}" for f in bad))

    def session(self, cache, tenant: str):
        """A conversation through ``cache`` (``send`` a turn, ``close`` to release)."""
        from .session import CachedSession

        return CachedSession(self, cache, tenant)

    def generate(self, cache, tenant: str, prompt: Sequence[Item], max_new_tokens: int = 8) -> list[int]:
        """Greedy tokens for one prompt, attention through ``cache``; the sequence is released."""
        return self.chat(cache, tenant, [prompt], max_new_tokens)[0]

    def chat(self, cache, tenant: str, turns: Sequence[Sequence[Item]],
             max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy tokens per turn of one conversation (each answer stays in the context)."""
        checked = [self.validate(t, max_new_tokens) for t in turns]
        with self.session(cache, tenant) as s:
            return [s.send(t, max_new_tokens) for t in checked]

    # ---- dense reference
    def generate_dense(self, prompt: Sequence[Item], max_new_tokens: int = 8) -> list[int]:
        return self.chat_dense([prompt], max_new_tokens)[0]

    def chat_dense(self, turns: Sequence[Sequence[Item]], max_new_tokens: int = 8) -> list[list[int]]:
        """The same model with no cache: every encoder runs, attention over concatenated K/V."""
        checked = [self.validate(t, max_new_tokens) for t in turns]
        state = _DenseState(self.dims)
        answers: list[list[int]] = []
        for items in checked:
            if answers and answers[-1]:
                items = [Text(answers[-1][-1:]), *items]
            last = None
            for item in items:
                if isinstance(item, Text):
                    last = state.run(self.decoder, self.decoder.embed_tokens(list(item.ids)))
                else:
                    enc = self.encoders[item.modality](item.data)
                    state.media.append(self.decoder.cross_kv(item.modality, enc))
                    last = state.run(self.decoder, self.decoder.project(item.modality, enc))
            answers.append(self.greedy(last, max_new_tokens,
                                       lambda ids: state.run(self.decoder, self.decoder.embed_tokens(ids))))
        return answers

    # ---- shared
    def greedy(self, last: torch.Tensor | None, max_new_tokens: int,
               step: Callable[[list[int]], torch.Tensor]) -> list[int]:
        """Greedy decoding from the last hidden state; ``step(ids)`` feeds a token back."""
        tokens: list[int] = []
        for i in range(max_new_tokens):
            token = int(torch.argmax(self.decoder.logits(last)[-1]))
            tokens.append(token)
            if i + 1 < max_new_tokens:
                last = step([token])
        return tokens

    def validate(self, prompt: Sequence[Item], max_new_tokens: int) -> list[Item]:
        """The prompt as a checked list of items; ``PromptError`` / ``MediaError`` otherwise."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise PromptError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        if isinstance(prompt, (Text, Media, str, bytes)) or not isinstance(prompt, Sequence) or not prompt:
            raise PromptError("a prompt is a non-empty sequence of Text and Media items")
        items: list[Item] = []
        for item in prompt:
            if isinstance(item, Text):
                if not item.ids:
                    raise PromptError("empty Text item")
                bad = [i for i in item.ids if not 0 <= i < self.dims.vocab]
                if bad:
                    raise PromptError(f"token ids {bad[:4]} outside the vocabulary [0, {self.dims.vocab})")
                items.append(item)
            elif isinstance(item, Media):
                encoder = self.encoders.get(item.modality)
                if encoder is None:
                    raise MediaError(f"unknown media modality {item.modality!r}; use one of {MEDIA}")
                items.append(Media(item.modality, encoder.check(item.data)))
            else:
                raise PromptError(f"prompt items are Text or Media, got {type(item).__name__}")
        return items


class _DenseState:
    """The dense path's whole context: self-attention K/V per layer, cross K/V per placement."""

    def __init__(self, dims: DecoderDims):
        empty = torch.zeros(0, dims.num_kv_heads, dims.head_dim)
        self.k = [empty] * dims.num_layers
        self.v = [empty] * dims.num_layers
        self.media: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.length = 0

    def run(self, dec: Decoder, x: torch.Tensor) -> torch.Tensor:
        n, start = x.shape[0], self.length
        mask = dec.causal_mask(n, start)

        def self_attn(layer, q, k, v):
            keys = torch.cat([self.k[layer], k])
            values = torch.cat([self.v[layer], v])
            return attend(q, keys, values, mask)[0]

        def cross_attn(c, q):
            if not self.media:
                return None
            keys = torch.cat([k[c] for k, _ in self.media])
            values = torch.cat([v[c] for _, v in self.media])
            return attend(q, keys, values)[0]

        h, k, v = dec.forward(x, torch.arange(start, start + n), self_attn, cross_attn)
        for layer in range(len(self.k)):
            self.k[layer] = torch.cat([self.k[layer], k[layer]])
            self.v[layer] = torch.cat([self.v[layer], v[layer]])
        self.length += n
        return h[-1:]
