"""``SequenceBook``: the sequences of a ``ClusterCache``. It owns each sequence's state
(``SequenceState``: its home pool, the runs held there, the groups attended where they live,
its prefix chain) and how many sequences each pool homes; it creates sequences and places their
home, appends to the home pool and releases every part, wherever it lives."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from ..cache.keys import DEFAULT_TENANT
from ..config import CacheConfig
from ..content import ContentKey
from ..core.segments import SequenceHandle
from ..errors import HolderLostError, ShapeError, UnknownKeyError, UnknownModalityError
from ..pages.payload import token_identity
from . import client_placement as placement
from .client_holders import Holders
from .client_keys import ClusterKeys
from .client_sequence_state import ClusterSequence, HomeRun, SequenceState, next_chain
from .registry import Location


class SequenceBook:
    def __init__(self, cfg: CacheConfig, keys: ClusterKeys, holders: Holders, node: str):
        self.cfg = cfg
        self.keys = keys
        self.holders = holders
        self.node = node                     # the client's own node: where new homes go first
        self.seqs: dict[int, SequenceState] = {}
        self.homed: Counter[str] = Counter()
        self._ids = itertools.count((secrets.randbits(30) << 32) + 1)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.seqs)

    def get(self, seq: SequenceHandle) -> SequenceState:
        """The state of a live sequence (``UnknownKeyError`` for any other handle)."""
        if not isinstance(seq, SequenceHandle):
            raise UnknownKeyError(f"expected a SequenceHandle, got {type(seq).__name__}")
        st = self.seqs.get(seq.id)
        if st is None or st.handle != seq:
            raise UnknownKeyError(f"unknown sequence {seq.id} (released or never created)")
        if st.lock is None:
            st.lock = asyncio.Lock()
        return st

    def forget(self, st: SequenceState) -> None:
        with self._lock:
            self.seqs.pop(st.handle.id, None)

    def live(self) -> list[SequenceState]:
        return list(self.seqs.values())

    # ------------------------------------------------------------------ keys and views
    def prefix_key(self, seq: SequenceHandle) -> ContentKey:
        st = self.get(seq)
        return self.keys.chain_key(st.tail_modality, st.chain, seq.tenant)

    def view(self, seq: SequenceHandle) -> ClusterSequence:
        st = self.get(seq)
        return ClusterSequence(st.handle, st.length, st.home, tuple(st.attached))

    # ------------------------------------------------------------------ homes
    def set_home(self, st: SequenceState, home: str) -> None:
        st.home = home
        self.homed[home] += 1

    def least_used(self, names: list[str]) -> str:
        return placement.least_used(names, self.homed)

    def default_home(self) -> str:
        return placement.default_home(self.holders.pools(self.node), self.holders.pools(), self.homed)

    def best_home(self, locs: Iterable[Location | None]) -> str | None:
        """The pool holding most bytes of these groups (a store's bytes count for its node's pools)."""
        return placement.best_home(locs, self.holders.info, self.homed)

    # ------------------------------------------------------------------ life cycle
    async def create(self, tenant: str | None = None, *, hint_keys: Iterable[ContentKey] | None = None,
                     node: str | None = None) -> SequenceHandle:
        """A new sequence: on ``node``'s pool, else near ``hint_keys``, else placed lazily."""
        self.keys.salt(tenant)
        handle = SequenceHandle(next(self._ids), DEFAULT_TENANT if tenant is None else tenant)
        st = SequenceState(handle)
        home = None
        if node is not None:
            if not self.holders.pools(node):
                self.holders.refresh()
            if not self.holders.pools(node):
                raise UnknownKeyError(f"no mmtier pool on node {node}")
            home = self.least_used(self.holders.pools(node))
        elif hint_keys:
            hints = list(hint_keys)
            for k in hints:
                self.keys.check(k)
            home = self.best_home(await self.holders.lookup(hints))
        if home is not None:
            self.set_home(st, home)
        with self._lock:
            self.seqs[handle.id] = st
        return handle

    async def append(self, seq: SequenceHandle, modality: str, k: torch.Tensor, v: torch.Tensor,
                     *, tokens: Sequence[int] | None = None) -> None:
        st = self.get(seq)
        spec = self.cfg.spec(modality)
        if spec.kind != "kv":
            raise UnknownModalityError(f"modality {modality!r} holds embeddings; use put_embedding")
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
            raise ShapeError("k and v must be [num_layers, n_tokens, num_kv_heads, head_dim] tensors")
        k, v = k.detach().cpu(), v.detach().cpu()
        async with st.lock:
            if st.home is None:
                self.set_home(st, self.default_home())
            sub = None if st.sealed else st.subs[-1]
            handle, evicted = await self.holders.call(self.holders.actor(st.home).append.remote(
                sub.handle if sub else None, seq.tenant, modality, k, v,
                list(tokens) if tokens is not None else None), st.home)
            if sub is None:
                st.subs.append(HomeRun(handle, st.length))
                st.sealed = False
            self.holders.forget_evicted(st.home, evicted)
            st.length += k.shape[1]
            st.chain = next_chain(st.chain, token_identity(modality, k, v, tokens))
            st.tail_modality = modality

    async def release(self, seq: SequenceHandle) -> None:
        st = self.get(seq)
        async with st.lock:
            self.forget(st)
            actors = self.holders.actors
            calls = []
            if st.home is not None and st.subs and st.home in actors:
                calls.append((st.home, actors[st.home].release.remote([s.handle for s in st.subs])))
            for holder, proxy in st.proxies.items():
                if holder in actors:
                    calls.append((holder, actors[holder].release.remote([proxy])))
            results = await asyncio.gather(*(self.holders.call(r, h) for h, r in calls), return_exceptions=True)
            if st.home is not None:
                self.homed[st.home] -= 1
            self.unref_attached(st)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, HolderLostError):
                    raise r          # a lost holder released everything anyway

    def unref_attached(self, st: SequenceState) -> None:
        """Give back the registry references the sequence's attached groups hold."""
        if st.attached:
            self.holders.registry.ref([k.address for k in st.attached], -1)
            st.attached.clear()
