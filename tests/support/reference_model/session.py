"""``CachedSession``: one conversation of the reference model, with attention through the cache.

A session holds two sequences of one tenant in the cache:

- ``seq``: decoder self-attention K/V in order: text appended with ``append(..., tokens=ids)``,
  media tokens' K/V attached as prefix-dependent groups keyed with
  ``parent=cache.prefix_key(seq)``;
- ``xseq``: the cross-attention K/V of every media item placed so far, attached as
  content-only groups; cross layers read them with ``groups=[...]``, ``causal=False``.

Per media item, in this order: cross K/V (hit: attach; miss: compute from the encoder outputs,
put, attach), then self K/V (hit: attach, nothing recomputed; miss: run the decoder over the
projected encoder outputs, put, attach). Encoder outputs are needed only on a miss, and come
from the cache's embedding group when it holds them; the encoder runs only when it does not.

Attention per layer and step: a chunk's queries attend to everything before it through
``cache.attention_state`` (positions given explicitly, causal) and to the chunk itself with
local causal attention; the two partial states merge exactly by log-sum-exp. (The cache
stores a chunk's K/V for all layers at once, after the chunk's last layer, so a chunk cannot
read its own K/V from the cache while it is being computed.) A prompt ending on a media item
whose K/V hit runs its last position alone through ``cache.attention`` to get the first token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mmtier.content import ContentKey
from mmtier.errors import UnknownKeyError

from .encoders import ModelError
from .ops import attend
from .reference import Item, Media, ReferenceModel, Text, cross_modality, embed_modality


class CachedSession:
    """Turns of one conversation; ``send`` returns greedy tokens. A context manager."""

    def __init__(self, model: ReferenceModel, cache, tenant: str):
        model.check_cache(cache)
        self.model, self.cache, self.tenant = model, cache, tenant
        self.dec = model.decoder
        self.seq = cache.create_sequence(tenant=tenant)
        try:
            self.xseq = cache.create_sequence(tenant=tenant)
        except BaseException:
            cache.release(self.seq)
            raise
        self.xkeys: list[ContentKey] = []
        self._pending: int | None = None     # the last answer token, not yet in the context
        self._state = "open"

    @property
    def is_open(self) -> bool:
        """Neither closed nor broken by a turn that failed half-way."""
        return self._state == "open"

    # ------------------------------------------------------------------ turns
    def send(self, prompt: Sequence[Item], max_new_tokens: int = 8) -> list[int]:
        """Feed one turn and decode greedily; the answer stays in the context for the next."""
        if self._state != "open":
            raise ModelError(f"session is {self._state}")
        items = self.model.validate(prompt, max_new_tokens)     # nothing touched on bad input
        if self._pending is not None:
            items.insert(0, Text([self._pending]))
        begin = getattr(self.cache, "begin_turn", None)     # an embedded pool: turn boundaries
        if begin is not None:
            begin(self._shared_keys(items), calls_left=self._calls(items, max_new_tokens))
        try:
            last = None
            for i, item in enumerate(items):
                if isinstance(item, Text):
                    last = self._text(list(item.ids))
                else:
                    last = self._media(item, need_hidden=i == len(items) - 1 and max_new_tokens > 0)
            tokens = self.model.greedy(last, max_new_tokens, self._text)
        except BaseException:
            self._state = "broken (a turn failed half-way; close it)"
            raise
        finally:
            if begin is not None:
                self.cache.end_turn()
        self._pending = tokens[-1] if tokens else None
        return tokens

    def _shared_keys(self, items: Sequence[Item]) -> list[ContentKey]:
        """The content-only keys of the turn's media (cross-attention K/V, encoder outputs): what
        another conversation anywhere may already hold."""
        keys = []
        for item in items:
            if isinstance(item, Media):
                m, params = item.modality, self.model.encoders[item.modality].params
                keys += [self.cache.content_key(cross_modality(m), item.data, tenant=self.tenant, params=params),
                         self.cache.content_key(embed_modality(m), item.data, tenant=self.tenant, params=params)]
        return keys

    def _calls(self, items: Sequence[Item], max_new_tokens: int) -> int:
        """Attention calls the turn will make (one per layer per chunk or step): the cost
        model's weight of attending a group where it lives instead of fetching it."""
        return (len(items) + max_new_tokens) * self.dec.dims.num_layers

    def close(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        for seq in (self.seq, self.xseq):
            try:
                self.cache.release(seq)
            except UnknownKeyError:
                pass                          # the cache was closed or rebuilt under us

    def __enter__(self) -> CachedSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ chunks
    def _length(self) -> int:
        return self.cache.sequence(self.seq).length

    def _text(self, ids: list[int]) -> torch.Tensor:
        start = self._length()
        h, k, v = self._run(self.dec.embed_tokens(ids), start)
        self.cache.append(self.seq, "text", k, v, tokens=ids)
        return h[-1:]

    def _media(self, item: Media, need_hidden: bool) -> torch.Tensor | None:
        m, data, cache = item.modality, item.data, self.cache
        params = self.model.encoders[m].params
        enc: list[torch.Tensor] = []

        def encoder_out() -> torch.Tensor:
            if not enc:
                enc.append(self._encoder_out(m, data, params))
            return enc[0]

        xkey = cache.content_key(cross_modality(m), data, tenant=self.tenant, params=params)
        hit = self._attach_or_put(self.xseq, xkey, lambda: self.dec.cross_kv(m, encoder_out()))
        self.model.counters.add("cross_hits" if hit else "cross_misses", m)
        self.xkeys.append(xkey)

        start = self._length()
        n = self.model.encoders[m].tokens_for(data)
        skey = cache.content_key(m, data, tenant=self.tenant, parent=cache.prefix_key(self.seq),
                                 params=params)
        computed: list[torch.Tensor] = []

        def self_kv() -> tuple[torch.Tensor, torch.Tensor]:
            h, k, v = self._run(self.dec.project(m, encoder_out()), start)
            computed.append(h[-1:])
            return k, v

        hit = self._attach_or_put(self.seq, skey, self_kv)
        self.model.counters.add("self_hits" if hit else "self_misses", m)
        if computed:
            return computed[0]
        if need_hidden:
            return self._last_position(self.dec.project(m, encoder_out()[-1:]), start + n - 1)
        return None

    def _encoder_out(self, m: str, data: bytes, params: dict[str, object]) -> torch.Tensor:
        """Encoder outputs: from the cache's content-only embedding group, else the encoder."""
        ekey = self.cache.content_key(embed_modality(m), data, tenant=self.tenant, params=params)
        if self.cache.contains(ekey):
            try:
                out = self.cache.get_embedding(ekey).cpu()   # the model computes on the CPU
            except UnknownKeyError:          # dropped since contains() (another request)
                pass
            else:
                self.model.counters.add("embedding_hits", m)
                return out
        out = self.model.encoders[m](data)
        self.model.counters.add("encoder_runs", m)
        self.cache.put_embedding(ekey, out)
        return out

    def _attach_or_put(self, seq, key: ContentKey,
                       compute: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Attach the stored group (``True``: a hit) or compute, put and attach it."""
        if self.cache.contains(key):
            try:
                self.cache.attach(seq, key)
                return True
            except UnknownKeyError:          # dropped since contains() (another request)
                pass
        k, v = compute()
        self.cache.put(key, k, v)
        self.cache.attach(seq, key)
        return False

    # ------------------------------------------------------------------ attention
    def _run(self, x: torch.Tensor, start: int):
        """The decoder over a chunk at ``start..``: prefix through the cache, the chunk locally."""
        n = x.shape[0]
        positions = torch.arange(start, start + n)
        local_mask = self.dec.causal_mask(n, 0)

        def self_attn(layer, q, k, v):
            out, lse = _attend_one(q, k, v) if n == 1 else attend(q, k, v, local_mask)
            if start == 0:
                return out
            p_out, p_lse = self.cache.attention_state(self.seq, layer, q, q_positions=positions)
            return _merge_two(p_out.float(), p_lse.float(), out, lse)

        h, k, v = self.dec.forward(x, positions, self_attn, self._cross_attn)
        self.model.counters.add("decoder_tokens", n=n)
        return h, k, v

    def _last_position(self, x: torch.Tensor, position: int) -> torch.Tensor:
        """Hidden state of the sequence's last position, whose K/V the cache already holds."""
        def self_attn(layer, q, k, v):
            return self.cache.attention(self.seq, layer, q)      # causal; query = last position

        h, _, _ = self.dec.forward(x, torch.tensor([position]), self_attn, self._cross_attn)
        self.model.counters.add("decoder_tokens", n=1)
        return h

    def _cross_attn(self, c: int, q: torch.Tensor) -> torch.Tensor | None:
        if not self.xkeys:
            return None
        # xseq holds exactly the cross-attention groups placed so far: all of it, no filter
        return self.cache.attention(self.xseq, c, q, causal=False)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-token chunk attending to itself (a decode step's local part): the softmax over
    one key is 1, so ``out`` is its value and ``lse`` its score (GQA: KV heads repeated)."""
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)
    lse = (q.float() * kk).sum(-1) * q.shape[-1] ** -0.5
    return v.float().repeat_interleave(group, dim=1), lse


def _merge_two(o1: torch.Tensor, s1: torch.Tensor, o2: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """The exact log-sum-exp merge of two partial states whose second one sees at least one key
    (a chunk always sees itself), so the merged lse is finite: four operations per layer and
    step instead of the general N-way merge."""
    lse = torch.logaddexp(s1, s2)
    return o1 * torch.exp(s1 - lse)[..., None] + o2 * torch.exp(s2 - lse)[..., None]
