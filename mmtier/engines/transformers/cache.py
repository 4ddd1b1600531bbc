"""An mmtier-backed ``transformers.Cache``: one mmtier sequence per batch row.

transformers calls ``update(k, v, layer_idx)`` per layer and then the attention function. Here
``update`` only notes the fresh K/V (a reference, no copy) and marks its layer as the one about
to attend; the attention function registered as ``"mmtier"`` (``attention``) then
writes the row's real tokens (the padding mask says which) into pages and attends over the pages
of every row in one ``attention_batch`` call. A layer's ``keys`` / ``values`` are placeholders
(the K/V live in the cache's pages, never in dense tensors here).

Self-attention tokens go to the ``text`` pool (or the one ``cache_for(text_modality=...)`` names); cross-attention K/V (Mllama's projected vision
states, Whisper's encoder states) to a second sequence per row in the media pool, attended
without causality.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...cache import TieredKVCache
from ...content import ContentKey
from ...core.segments import SequenceHandle
from ...errors import ShapeError, UnsupportedError
from ...pages.layer_writes import Reservation
from .layout import ModelLayout

_ACTIVE = threading.local()


@dataclass(frozen=True)
class RunPlan:
    """One run of a step's new tokens (``Rows.next_runs``): ``n`` tokens for pool ``modality``;
    ``tokens``: their ids for the prefix chain (``None``: a unique run, as for image tokens)."""

    modality: str
    n: int
    tokens: list[int] | None = None


def take_active(key: torch.Tensor | None = None) -> MMTierLayer | None:
    """The cache layer that the attention call now running belongs to (set by ``update`` or by
    reading the layer's ``keys``), cleared as it is taken. With ``key`` (the attention's key
    states), only if that is the very tensor the layer gave out: a layer marked by a read outside
    a forward (Whisper's generate copies every layer's ``keys`` per row after the run) never
    claims a later attention call (the next request's audio encoder)."""
    layer = getattr(_ACTIVE, "layer", None)
    _ACTIVE.layer = None
    if layer is not None and key is not None and key is not layer.given:
        return None
    return layer


@dataclass
class Rows:
    """The mmtier side of one ``cache_for``: a sequence per batch row (and a media sequence
    per row where the model cross-attends), and the reservations of the step in progress."""

    cache: TieredKVCache
    layout: ModelLayout
    tenant: str | None
    text: str = "text"                             # the pool of the decoder's self-attention K/V
    seqs: list[SequenceHandle] = field(default_factory=list)
    cross_seqs: list[SequenceHandle] = field(default_factory=list)
    cross_keys: list[list[ContentKey] | None] = field(default_factory=list)
    self_res: list[list[Reservation]] = field(default_factory=list)   # per row, in token order
    cross_res: list[Reservation | None] = field(default_factory=list)
    next_tokens: list[list[int]] | None = None     # token ids of the next step's real tokens
    next_modality: str | None = None               # the pool of the next step's tokens (None: text)
    next_new_run: bool = False                     # the next step's tokens start a run of their own
    next_cross_new_run: bool = False               # the next cross K/V starts a run of its own
    next_runs: list[RunPlan] | None = None         # batch of one: the next step's tokens as runs
                                                   # of their own, in order (one forward over a
                                                   # text span and an image, each sealed apart)

    def ensure(self, batch: int) -> None:
        if not self.seqs:
            self.seqs = [self.cache.create_sequence(self.tenant) for _ in range(batch)]
        elif len(self.seqs) != batch:
            raise UnsupportedError(f"batch of {batch} rows for a cache built for {len(self.seqs)} "
                                   "(beam search and batch changes are not supported)")

    def ensure_cross(self, batch: int) -> None:
        self.ensure(batch)
        if not self.cross_seqs:
            self.cross_seqs = [self.cache.create_sequence(self.tenant) for _ in range(batch)]
            self.cross_keys = [None] * batch

    def begin_self(self, counts: list[int]) -> None:
        """Reserve each row's real new tokens (called at the first self-attention layer)."""
        tokens, modality, new_run = self.next_tokens, self.next_modality or self.text, self.next_new_run
        runs = self.next_runs
        self.next_tokens, self.next_modality, self.next_new_run, self.next_runs = None, None, False, None
        if runs is not None:
            if len(counts) != 1 or sum(r.n for r in runs) != counts[0]:
                raise ShapeError(f"next_runs of {[r.n for r in runs]} tokens for a step of {counts} "
                                 "(runs are planned for a batch of one)")
            self.self_res = [[self.cache.reserve(self.seqs[0], r.modality, r.n, tokens=r.tokens, new_run=True)
                              for r in runs]]
            return
        if tokens is not None and [len(t) for t in tokens] != counts:
            tokens = None                           # not the step the ids were given for
        self.self_res = [
            [self.cache.reserve(seq, modality, n, tokens=None if tokens is None else tokens[b],
                                new_run=new_run)] if n else []
            for b, (seq, n) in enumerate(zip(self.seqs, counts))]

    def begin_cross(self, counts: list[int]) -> None:
        media, new_run = self.layout.media, self.next_cross_new_run
        self.next_cross_new_run = False
        self.cross_res = [self.cache.reserve(seq, media, n, new_run=new_run) if n else None
                          for seq, n in zip(self.cross_seqs, counts)]

    def release(self) -> None:
        for seq in (*self.seqs, *self.cross_seqs):
            self.cache.release(seq)
        self.seqs, self.cross_seqs = [], []


class MMTierLayer(CacheLayerMixin):
    """One decoder layer's view of the rows: self- or cross-attention K/V in mmtier pages."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, rows: Rows, layer_idx: int, cross: bool):
        self.rows = rows
        self.layer_idx = layer_idx
        self.cross = cross
        self.pool_layer = rows.layout.pool_layer(layer_idx, cross)
        self.first = self.pool_layer == 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.given: torch.Tensor | None = None   # the key states last handed to the model
        self.seen = 0                    # tokens transformers has passed (padding included)
        self.is_initialized = True
        self._kind: tuple[torch.dtype, torch.device] | None = None     # of the K/V seen

    # transformers reads these on cached cross-attention steps; the K/V are in pages.
    @property
    def keys(self) -> torch.Tensor:
        _ACTIVE.layer = self
        self.given = self._placeholder()
        return self.given

    @property
    def values(self) -> torch.Tensor:
        return self._placeholder()

    def _placeholder(self) -> torch.Tensor:
        """``[rows, kv_heads, tokens, head_dim]`` zeros standing for K/V that live in pages: no
        tokens (a copy of it, as Whisper's generate returns per row, is an empty cache: reused,
        it recomputes rather than read made-up K/V), except Mllama's cross layers once written,
        which transformers tests for ``numel() > 0`` (one token)."""
        layout = self.rows.layout
        heads = layout.cross_kv_heads if self.cross else layout.num_kv_heads
        one = self.cross and layout.kind == "cross" and self.seen > 0
        dtype, device = self._kind or (torch.float32, torch.device("cpu"))
        return torch.zeros(len(self.rows.seqs), heads, 1 if one else 0, layout.head_dim, dtype=dtype, device=device)

    def mark_attached(self, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        """Cross K/V of ``tokens`` tokens was attached from the cache (no ``update`` will come)."""
        self.seen = tokens
        self._kind = (dtype, device)

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise ShapeError(f"key/value states must be [batch, heads, n, head_dim] alike, got "
                             f"{tuple(key_states.shape)} and {tuple(value_states.shape)}")
        self.pending = (key_states, value_states)
        self.given = key_states
        self.seen += key_states.shape[2]
        self._kind = (key_states.dtype, key_states.device)
        _ACTIVE.layer = self
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise UnsupportedError("reset: release this cache and build a new one with cache_for")

    def reorder_cache(self, beam_idx) -> None:
        raise UnsupportedError("beam search is not supported by the mmtier cache")


class MMTierCache(Cache):
    """The ``past_key_values`` for one batch of rows (``cache_for`` builds it)."""

    def __init__(self, rows: Rows, cross: bool = False):
        layout = rows.layout
        wanted = layout.cross_layers if cross else layout.self_layers
        layers = []
        for i in range(layout.num_layers):
            if i in wanted:
                layers.append(MMTierLayer(rows, i, cross))
            else:      # Mllama: a cross layer in the self cache and vice versa
                layers.append(MMTierLayer(rows, i, not cross))
        super().__init__(layers=layers)
        self.rows = rows

    @property
    def sequences(self) -> list[SequenceHandle]:
        """The mmtier sequence of each batch row (empty before the first forward)."""
        return list(self.rows.seqs)

    def release(self) -> None:
        """Drop the rows' sequences (shared groups stay cached)."""
        self.rows.release()

    def __enter__(self) -> MMTierCache:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
