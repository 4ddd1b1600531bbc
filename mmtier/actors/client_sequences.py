"""Keys and sequences of a ``ClusterCache``: the tenant salt, ``content_key`` / ``prefix_key``
(the same on every node), sequence creation and placement of its home, ``append`` (to the home
pool) and ``release`` (every part, wherever it lives). A part of ``ClusterCache`` (this class is
one of its bases), kept in its own file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import torch

from ..cache_keys import DEFAULT_TENANT
from ..content import ContentKey, media_digest, tenant_salt
from ..errors import (
    DTypeError,
    ForeignKeyError,
    HolderLostError,
    ShapeError,
    UnknownKeyError,
    UnknownModalityError,
)
from ..payload import token_identity
from ..table import SequenceHandle
from . import placement
from .client_state import ClusterSequence, _chain, _Seq, _Sub
from .registry import Location


class SequenceOps:
    """Keys and sequences over ``ClusterCache``'s own state (its config, key maker, per-sequence
    state and the pools it homes sequences on)."""

    def _salt(self, tenant: str | None) -> bytes:
        tenant = DEFAULT_TENANT if tenant is None else tenant
        if not isinstance(tenant, str) or not tenant:
            raise ForeignKeyError(f"tenant must be a non-empty string, got {tenant!r}")
        return tenant_salt(self.cfg.key_secret, tenant)

    def content_key(self, modality: str, media: bytes | bytearray | memoryview, *,
                    tenant: str | None = None, parent: ContentKey | None = None,
                    params: dict[str, object] | None = None) -> ContentKey:
        """The key of a media item: the same bytes give the same key on every node."""
        spec = self.cfg.spec(modality)
        if not isinstance(media, (bytes, bytearray, memoryview)):
            raise DTypeError(f"media must be bytes-like, got {type(media).__name__}")
        return self.keys.derive(modality=modality, layout=spec.layout_fields(),
                                media=media_digest(media, params), tenant_salt=self._salt(tenant),
                                parent=parent)

    def prefix_key(self, seq: SequenceHandle) -> ContentKey:
        st = self._seq(seq)
        modality = st.tail_modality or next(iter(self.cfg.modalities))
        return self.keys.chain(modality=modality, chain_digest=st.chain, tenant_salt=self._salt(seq.tenant))

    def _check_key(self, key: ContentKey, kind: str | None = None) -> None:
        self.keys.verify(key)
        spec = self.cfg.spec(key.modality)
        if kind is not None and spec.kind != kind:
            raise UnknownModalityError(f"modality {key.modality!r} holds {spec.kind!r} payloads, not {kind!r}")

    # ------------------------------------------------------------------ sequences
    def _seq(self, seq: SequenceHandle) -> _Seq:
        if not isinstance(seq, SequenceHandle):
            raise UnknownKeyError(f"expected a SequenceHandle, got {type(seq).__name__}")
        st = self._seqs.get(seq.id)
        if st is None or st.handle != seq:
            raise UnknownKeyError(f"unknown sequence {seq.id} (released or never created)")
        if st.lock is None:
            st.lock = asyncio.Lock()
        return st

    async def create_sequence_async(self, tenant: str | None = None, *,
                                    hint_keys: Iterable[ContentKey] | None = None,
                                    node: str | None = None) -> SequenceHandle:
        """A new sequence: on ``node``'s pool, else near ``hint_keys``, else placed lazily."""
        self._salt(tenant)
        handle = SequenceHandle(next(self._seq_ids), DEFAULT_TENANT if tenant is None else tenant)
        st = _Seq(handle)
        if node is not None:
            if not self.pools(node):
                self.refresh()
            if not self.pools(node):
                raise UnknownKeyError(f"no mmtier pool on node {node}")
            st.home = self._least_used(self.pools(node))
        elif hint_keys:
            hints = list(hint_keys)
            for k in hints:
                self._check_key(k)
            st.home = self._best_home(await self._lookup(hints))
        if st.home is not None:
            self._homed[st.home] += 1
        with self._state_lock:
            self._seqs[handle.id] = st
        return handle

    def _least_used(self, names: list[str]) -> str:
        return placement.least_used(names, self._homed)

    def _default_home(self) -> str:
        return placement.default_home(self.pools(self._node), self.pools(), self._homed)

    def _best_home(self, locs: Iterable[Location | None]) -> str | None:
        """The pool holding most bytes of these groups (a store's bytes count for its node's pools)."""
        return placement.best_home(locs, self._info, self._homed)

    def sequence(self, seq: SequenceHandle) -> ClusterSequence:
        """What the client knows of a sequence: its length, home pool and attached keys."""
        st = self._seq(seq)
        return ClusterSequence(st.handle, st.length, st.home, tuple(st.attached))

    def where(self, seq: SequenceHandle) -> str | None:
        """The home pool of a sequence (``None`` until it is placed)."""
        return self._seq(seq).home

    async def append_async(self, seq: SequenceHandle, modality: str, k: torch.Tensor, v: torch.Tensor,
                           *, tokens: Sequence[int] | None = None) -> None:
        st = self._seq(seq)
        spec = self.cfg.spec(modality)
        if spec.kind != "kv":
            raise UnknownModalityError(f"modality {modality!r} holds embeddings; use put_embedding")
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
            raise ShapeError("k and v must be [num_layers, n_tokens, num_kv_heads, head_dim] tensors")
        k, v = k.detach().cpu(), v.detach().cpu()
        async with st.lock:
            if st.home is None:
                st.home = self._default_home()
                self._homed[st.home] += 1
            sub = None if st.sealed else st.subs[-1]
            handle, evicted = await self._call(self._actor(st.home).append.remote(
                sub.handle if sub else None, seq.tenant, modality, k, v,
                list(tokens) if tokens is not None else None), st.home)
            if sub is None:
                st.subs.append(_Sub(handle, st.length))
                st.sealed = False
            self._forget_evicted(st.home, evicted)
            st.length += k.shape[1]
            st.chain = _chain(st.chain, token_identity(modality, k, v, tokens))
            st.tail_modality = modality


    async def release_async(self, seq: SequenceHandle) -> None:
        st = self._seq(seq)
        async with st.lock:
            with self._state_lock:
                self._seqs.pop(seq.id, None)
            calls = []
            if st.home is not None and st.subs and st.home in self._actors:
                calls.append((st.home, self._actors[st.home].release.remote([s.handle for s in st.subs])))
            for holder, proxy in st.proxies.items():
                if holder in self._actors:
                    calls.append((holder, self._actors[holder].release.remote([proxy])))
            results = await asyncio.gather(*(self._call(r, h) for h, r in calls), return_exceptions=True)
            if st.home is not None:
                self._homed[st.home] -= 1
            if st.attached:
                self._registry.ref.remote([k.hex for k in st.attached], -1)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, HolderLostError):
                    raise r          # a lost holder released everything anyway
