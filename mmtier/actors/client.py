"""``ClusterCache``: ``TieredKVCache``'s surface over the cluster (sync, and ``*_async`` twins).

Routing:

- **Keys** are derived here, exactly as in a ``TieredKVCache`` with the same config (the config,
  secret included, comes from the registry), so they are identical on every node. The prefix
  chain is kept here too, so ``prefix_key`` does not depend on where a sequence's parts live.
- **Placement**: a sequence lives on one *home* pool: the pool on ``node=`` when one is named;
  else the pool holding the most bytes of ``hint_keys``; else it is placed at its first attach
  (on the holder of that group) or first append (a pool on the client's node, the least used).
- **Attaching a group held elsewhere** follows one rule (``copy_after_remote_uses`` = N): the
  first N-1 attaches of that group from a home pool attend *remotely* (a proxy sequence on the
  holder references it; partial attention runs there over its pages, only ``q`` and
  ``(out, lse)`` travel); the N-th copies the group into the home pool through the object store
  (raw page buffers) and later attaches are local. ``attach(..., transfer="remote"|"copy")``
  overrides the rule for one call.
- **Attention** sends one ``attend`` per actor holding parts of the sequence, with each part's
  offset between its local positions and the sequence's absolute positions, and merges the
  partial states by log-sum-exp: equal to the single-process result for any placement.

Failures: every actor call has a timeout. An actor that died is reported to the registry at once
(its holdings leave it). A group whose only holders died is a miss (``contains`` is False, the
caller puts it again); a sequence whose home pool died, or whose remote part has no other
holder, raises ``HolderLostError`` (an ``UnknownKeyError``): recompute, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import secrets
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import ray
import torch

from ..cache import DEFAULT_TENANT
from ..config import CacheConfig
from ..content import ContentKey, KeyMaker, media_digest, tenant_salt, tenant_scope
from ..errors import (
    DTypeError,
    ForeignKeyError,
    HolderLostError,
    MMTierError,
    ShapeError,
    UnknownKeyError,
    UnknownModalityError,
)
from ..kernels import merge_attention_states
from ..payload import token_identity
from ..stats import CacheStats, TierUsage
from ..table import SequenceHandle
from . import placement
from .client_state import ClusterSequence, Transfer, _chain, _Remote, _Seq, _Sub
from .launch import POOL_PREFIX, STORE_PREFIX
from .metrics import ClientMetrics
from .registry import HolderInfo, Location
from .settings import ClusterSettings


class ClusterCache:
    """The cluster's cache: the same methods as ``TieredKVCache``, each with an async twin."""

    def __init__(self, settings: ClusterSettings | None = None):
        self.settings = settings or ClusterSettings()
        s = self.settings
        self._registry = ray.get_actor(s.registry_name, namespace=s.namespace)
        self.cfg = CacheConfig(**ray.get(self._registry.config.remote(), timeout=s.call_timeout_s))
        self.keys = KeyMaker(self.cfg.model, self.cfg.key_secret)
        self.metrics = ClientMetrics()
        self._id = f"client-{secrets.token_hex(6)}"
        self._seq_ids = itertools.count((secrets.randbits(30) << 32) + 1)
        self._state_lock = threading.Lock()
        self._seqs: dict[int, _Seq] = {}
        self._homed: Counter[str] = Counter()
        self._remote_uses: Counter[tuple[str, bytes]] = Counter()
        self.counters: Counter[str] = Counter()
        self._actors: dict[str, Any] = {}
        self._info: dict[str, HolderInfo] = {}
        self._node = ray.get_runtime_context().get_node_id()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mmtier-client", daemon=True)
        self._thread.start()
        self.refresh()

    # ------------------------------------------------------------------ plumbing
    def refresh(self) -> list[str]:
        """Look the pool and store actors up again (after ``start()`` added nodes)."""
        s = self.settings
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == s.namespace and a["name"].startswith((POOL_PREFIX, STORE_PREFIX))]
        with self._state_lock:
            for name in names:
                if name in self._actors:
                    continue
                try:
                    self._actors[name] = ray.get_actor(name, namespace=s.namespace)
                except ValueError:
                    continue
                node = name.split(":")[1]
                self._info[name] = HolderInfo(name, node, "pool" if name.startswith(POOL_PREFIX) else "store")
            return sorted(self._actors)

    def pools(self, node: str | None = None) -> list[str]:
        return sorted(n for n, i in self._info.items() if i.kind == "pool" and (node is None or i.node == node))

    def stores(self, node: str | None = None) -> list[str]:
        return sorted(n for n, i in self._info.items() if i.kind == "store" and (node is None or i.node == node))

    def _run(self, coro):
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout=self.settings.call_timeout_s * 4)

    async def _call(self, ref, holder: str | None = None, timeout: float | None = None):
        """Await one actor call with a timeout; typed errors come back as themselves."""
        try:
            return await asyncio.wait_for(ref, timeout or self.settings.call_timeout_s)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, MMTierError):
                raise cause from None
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.ObjectLostError) as exc:
            if holder is None:
                raise
            await self._lost(holder)
            raise HolderLostError(f"{holder} is gone ({type(exc).__name__})") from None
        except asyncio.TimeoutError:
            if holder is None:
                raise
            raise HolderLostError(f"{holder} did not answer within the timeout") from None

    async def _lost(self, holder: str) -> None:
        """A holder died: forget it here and in the registry (its holdings leave at once) —
        unless ``start()`` already recreated an actor under that name: then this client takes
        the new handle and leaves the registry alone (the new actor announced its own holdings;
        what the dead one held in memory is gone either way, and the failed call said so)."""
        with self._state_lock:
            old = self._actors.pop(holder, None)
            info = self._info.pop(holder, None)
        try:
            new = await asyncio.to_thread(ray.get_actor, holder, self.settings.namespace)
        except ValueError:
            new = None
        if new is not None and old is not None and new._actor_id != old._actor_id:
            with self._state_lock:
                self._actors[holder] = new
                self._info[holder] = info or HolderInfo(
                    holder, holder.split(":")[1], "pool" if holder.startswith(POOL_PREFIX) else "store")
            return
        await asyncio.wait_for(self._registry.drop_holder.remote(holder), self.settings.call_timeout_s)

    def _actor(self, name: str):
        a = self._actors.get(name)
        if a is None:
            raise HolderLostError(f"{name} is gone")
        return a

    async def _lookup(self, keys: Sequence[ContentKey]) -> list[Location | None]:
        return await self._call(self._registry.lookup.remote([k.hex for k in keys]))

    def _forget_evicted(self, holder: str, digests: list[str]) -> None:
        if digests:
            self._registry.remove.remote(holder, digests)     # ordered after our earlier calls

    # ------------------------------------------------------------------ keys
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

    async def attach_async(self, seq: SequenceHandle, key: ContentKey, *,
                           transfer: Transfer | None = None) -> None:
        """Reference a stored group at the sequence's next position, wherever it is held."""
        st = self._seq(seq)
        self._check_key(key, "kv")
        if key.scope != tenant_scope(self._salt(seq.tenant)):
            raise ForeignKeyError(f"key {key!r} belongs to another tenant than sequence {seq.id}")
        if transfer not in (None, "remote", "copy"):
            raise ValueError(f"transfer must be 'remote', 'copy' or None, got {transfer!r}")
        async with st.lock:
            for _attempt in range(3):       # a holder found dead on the way: look up again
                loc = (await self._lookup([key]))[0]
                self.metrics.hit(key.modality, loc is not None)
                if loc is None:
                    raise UnknownKeyError(f"{key!r} is not in the cluster cache (put it first)")
                holders = [h for h, _ in loc.holders if h in self._actors]
                if not holders:
                    self.refresh()
                    holders = [h for h, _ in loc.holders if h in self._actors]
                if not holders:
                    raise HolderLostError(f"{key!r}: no live holder")
                if st.home is None:
                    st.home = self._best_home([loc]) or self._default_home()
                    self._homed[st.home] += 1
                try:
                    await self._attach_once(st, key, loc, holders, transfer)
                except HolderLostError:
                    if st.home not in self._actors:
                        raise
                    continue
                st.attached.append(key)
                st.length += loc.num_tokens
                st.chain = _chain(st.chain, b"group:" + key.digest)
                st.tail_modality = key.modality
                self._registry.ref.remote([key.hex], 1)
                return
            raise HolderLostError(f"{key!r}: its holders kept failing")

    async def _attach_once(self, st: _Seq, key: ContentKey, loc: Location, holders: list[str],
                           transfer: Transfer | None) -> None:
        home = st.home
        if home not in holders:
            uses_key = (home, key.digest)
            self._remote_uses[uses_key] += 1
            copy = placement.should_copy(transfer, self._remote_uses[uses_key],
                                         self.settings.copy_after_remote_uses)
            if not copy:
                await self._attach_remote(st, key, self._nearest(holders, home))
                return
            await self._copy(key, loc, self._nearest(holders, home), home)
        sub = None if st.sealed else st.subs[-1]
        try:
            handle, _start, _n, evicted = await self._call(self._actor(home).attach.remote(
                sub.handle if sub else None, st.handle.tenant, key.to_wire()), home)
        except HolderLostError:
            raise
        except UnknownKeyError:
            self._forget_evicted(home, [key.hex])          # the registry was stale: a miss
            raise HolderLostError(f"{key!r} left {home} meanwhile") from None
        if sub is None:
            sub = _Sub(handle, st.length)
            st.subs.append(sub)
            st.sealed = False
        sub.keys.append(key)
        self._forget_evicted(home, evicted)

    def _nearest(self, holders: list[str], home: str) -> str:
        """A holder on the home's node first (a store there is cheapest), then any pool."""
        return placement.nearest(holders, home, self._info)

    async def _attach_remote(self, st: _Seq, key: ContentKey, holder: str) -> None:
        info = self._info[holder]
        local_start = None
        if info.kind == "pool":
            local_start = st.proxy_starts.get((holder, key.digest))
            if local_start is None:
                handle, local_start, _n, evicted = await self._call(self._actor(holder).attach.remote(
                    st.proxies.get(holder), st.handle.tenant, key.to_wire()), holder)
                st.proxies[holder] = handle
                st.proxy_starts[(holder, key.digest)] = local_start
                self._forget_evicted(holder, evicted)
        else:
            held = await self._call(self._actor(holder).holds.remote([key.to_wire()]), holder)
            if not held[0]:
                self._forget_evicted(holder, [key.hex])
                raise HolderLostError(f"{key!r} left {holder} meanwhile")
        st.remotes.append(_Remote(holder, key, st.length, local_start))
        st.sealed = True

    async def _copy(self, key: ContentKey, loc: Location, src: str, dst: str) -> None:
        """Ship a group's pages ``src -> dst`` through the object store (the client never
        touches the bytes) and record the new holder."""
        meta_ref, buf_ref = self._actor(src).export.options(num_returns=2).remote(key.to_wire())
        await self._call(meta_ref, src)
        item, evicted = await self._call(self._actor(dst).import_group.remote(key.to_wire(), meta_ref, buf_ref), dst)
        self._forget_evicted(dst, evicted)
        if item is not None:
            await self._call(self._registry.add.remote(dst, [item], _info_dict(self._info[dst])))
            self.metrics.copied(key.modality, loc.nbytes)
            self.counters["copies"] += 1

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

    # ------------------------------------------------------------------ groups
    async def contains_async(self, key: ContentKey) -> bool:
        self._check_key(key)
        loc = (await self._lookup([key]))[0]
        self.metrics.hit(key.modality, loc is not None)
        return loc is not None

    async def contains_many_async(self, keys: Sequence[ContentKey]) -> list[bool]:
        """One registry call for many keys."""
        for k in keys:
            self._check_key(k)
        return [loc is not None for loc in await self._lookup(keys)]

    async def locate_many_async(self, keys: Sequence[ContentKey]) -> list[Location | None]:
        """Where each group lives (``None``: nowhere), in one registry call."""
        for k in keys:
            self._check_key(k)
        return await self._lookup(keys) if keys else []

    async def locate_async(self, key: ContentKey) -> Location | None:
        self._check_key(key)
        return (await self._lookup([key]))[0]

    async def put_async(self, key: ContentKey, k: torch.Tensor, v: torch.Tensor, *,
                        node: str | None = None) -> bool:
        """Store a group once in the cluster; ``False`` when some actor already holds it."""
        self._check_key(key, "kv")
        k, v = k.detach().cpu(), v.detach().cpu()
        return await self._put(key, node, "put", k, v)

    async def put_embedding_async(self, key: ContentKey, x: torch.Tensor, *, node: str | None = None) -> bool:
        self._check_key(key, "embedding")
        return await self._put(key, node, "put_embedding", x.detach().cpu())

    async def _put(self, key: ContentKey, node: str | None, method: str, *payload) -> bool:
        wire = key.to_wire()
        status = await self._call(self._registry.claim.remote(key.hex, self._id, wire))
        if status == "pending":           # another client is storing it: wait for that put
            wait = self.settings.lease_ttl_s
            loc = await self._call(self._registry.wait_held.remote(key.hex, wait),
                                   timeout=wait + self.settings.call_timeout_s)
            if loc is not None:
                return False
            status = await self._call(self._registry.claim.remote(key.hex, self._id, wire))
        if status != "granted":
            return False
        target = self._least_used(self.pools(node)) if node is not None and self.pools(node) \
            else self._default_home()
        try:
            item, evicted = await self._call(getattr(self._actor(target), method).remote(wire, *payload), target)
        except BaseException:
            self._registry.unclaim.remote(key.hex, self._id)
            raise
        self._forget_evicted(target, evicted)
        if item is None:
            self._registry.unclaim.remote(key.hex, self._id)
            return False
        await self._call(self._registry.add.remote(target, [item], _info_dict(self._info[target])))
        return True

    async def get_embedding_async(self, key: ContentKey) -> torch.Tensor:
        self._check_key(key, "embedding")
        loc = (await self._lookup([key]))[0]
        self.metrics.hit(key.modality, loc is not None)
        if loc is None:
            raise UnknownKeyError(f"{key!r} is not in the cluster cache (put it first)")
        for holder, _tier in loc.holders:
            if holder not in self._actors or self._info[holder].kind != "pool":
                continue
            try:
                return await self._call(self._actors[holder].get_embedding.remote(key.to_wire()), holder)
            except HolderLostError:
                continue
        raise HolderLostError(f"{key!r}: no live holder")

    async def offload_async(self, key: ContentKey) -> bool:
        """Move a group from its pools to their nodes' stores (outlives the pool actors)."""
        self._check_key(key, "kv")
        loc = (await self._lookup([key]))[0]
        if loc is None:
            return False
        moved = False
        for holder, _ in loc.holders:
            info = self._info.get(holder)
            if info is None or info.kind != "pool" or not self.stores(info.node):
                continue
            store = self.stores(info.node)[0]
            await self._copy(key, loc, holder, store)
            dropped = await self._call(self._actors[holder].drop.remote([key.to_wire()]), holder)
            self._forget_evicted(holder, dropped)
            moved = moved or bool(dropped)
        return moved

    # ------------------------------------------------------------------ attention
    async def attention_async(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                              groups: Iterable[ContentKey] | None = None, causal: bool = True,
                              scale: float | None = None) -> torch.Tensor:
        out, _ = await self.attention_state_async(seq, layer, q, groups=groups, causal=causal, scale=scale)
        return out

    async def attention_state_async(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                                    groups: Iterable[ContentKey] | None = None, causal: bool = True,
                                    scale: float | None = None, q_positions: torch.Tensor | None = None,
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` over every part of the sequence, wherever it lives, merged exactly."""
        st = self._seq(seq)
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ShapeError("q must be [n_q, num_q_heads, head_dim]")
        q = q.detach().cpu()
        wanted = None if groups is None else set(groups)
        if wanted is not None:
            for k in wanted:
                self.keys.verify(k)
            missing = wanted - set(st.attached)
            if missing:
                raise UnknownKeyError(f"groups not attached to sequence {seq.id}: {sorted(map(str, missing))}")
        n_q = q.shape[0]
        if q_positions is None:
            if causal and n_q > st.length:
                raise ShapeError(f"{n_q} queries but the sequence holds {st.length} tokens")
            first = max(0, st.length - n_q)
            q_pos = torch.arange(first, first + n_q, dtype=torch.int64)
        else:
            q_pos = q_positions.to(torch.int64).cpu()
        for _attempt in range(2):
            plan = self._plan(st, wanted)
            try:
                states = await asyncio.gather(*(
                    self._call(self._actor(h).attend.remote(parts, layer, q, q_pos, causal, scale), h)
                    for h, parts in plan.items()))
            except HolderLostError:
                await self._fail_over(st)       # raises when nothing can replace the lost part
                continue
            remote = [h for h in plan if h != st.home]
            for h in remote:
                self.metrics.remote(self._info[h].kind if h in self._info else "pool")
            self.counters["remote_attentions"] += len(remote)
            if not states:
                return (torch.zeros(q.shape, dtype=q.dtype),
                        torch.full(q.shape[:2], float("-inf"), dtype=torch.float32))
            if len(states) == 1:
                out, lse = states[0]
            else:
                out, lse = merge_attention_states([s[0] for s in states], [s[1] for s in states],
                                                  backend="torch", out_dtype=torch.float32)
            return out.to(q.dtype), lse
        raise HolderLostError(f"sequence {seq.id}: its holders kept failing")

    def _plan(self, st: _Seq, wanted: set[ContentKey] | None) -> dict[str, list]:
        return placement.plan(st, wanted)

    async def _fail_over(self, st: _Seq) -> None:
        """Re-home remote parts whose holder died onto another holder; the home itself has no
        replacement (its private KV lived only there)."""
        if st.home is not None and st.home not in self._actors:
            with self._state_lock:
                self._seqs.pop(st.handle.id, None)
            # The sequence is gone with its home: release what it holds elsewhere (its proxies
            # on other pools, its registry references), best effort, so nothing is orphaned.
            calls = [(h, self._actors[h].release.remote([p])) for h, p in st.proxies.items()
                     if h in self._actors]
            await asyncio.gather(*(self._call(r, h) for h, r in calls), return_exceptions=True)
            st.proxies.clear()
            if st.attached:
                self._registry.ref.remote([k.hex for k in st.attached], -1)
                st.attached.clear()
            raise HolderLostError(f"sequence {st.handle.id}: its home pool {st.home} is gone; recompute it")
        lost = [r for r in st.remotes if r.holder not in self._actors]
        for r in lost:
            loc = (await self._lookup([r.key]))[0]
            holders = [h for h, _ in (loc.holders if loc else ()) if h in self._actors]
            if not holders:
                raise HolderLostError(f"{r.key!r} was held only by {r.holder}, which is gone; recompute it")
            holder = self._nearest(holders, st.home)
            st.proxies.pop(r.holder, None)
            local_start = None
            if self._info[holder].kind == "pool":
                local_start = st.proxy_starts.get((holder, r.key.digest))
                if local_start is None:
                    handle, local_start, _n, _ev = await self._call(self._actor(holder).attach.remote(
                        st.proxies.get(holder), st.handle.tenant, r.key.to_wire()), holder)
                    st.proxies[holder] = handle
                    st.proxy_starts[(holder, r.key.digest)] = local_start
            r.holder, r.local_start = holder, local_start

    # ------------------------------------------------------------------ stats and life cycle
    async def actor_stats_async(self) -> dict[str, dict]:
        """Each live actor's stats (pools: ``CacheStats.to_dict()``; stores: tier usage)."""
        names = list(self._actors)
        res = await asyncio.gather(*(self._call(
            (self._actors[n].stats if self._info[n].kind == "pool" else self._actors[n].tier_stats).remote(), n)
            for n in names), return_exceptions=True)
        return {n: r for n, r in zip(names, res) if not isinstance(r, BaseException)}

    async def stats_async(self) -> CacheStats:
        """Usage and counters summed over every live actor, plus the client's routing counters."""
        total = CacheStats()
        for d in (await self.actor_stats_async()).values():
            for tier, per in d.get("tiers", {}).items():
                for modality, u in per.items():
                    t = total.tiers.setdefault(tier, {}).setdefault(modality, TierUsage())
                    t.groups += u["groups"]
                    t.pages += u["pages"]
                    t.bytes += u["bytes"]
                    t.capacity_bytes += u["capacity_bytes"]
            for name, n in d.get("counters", {}).items():
                total.counters[name] = total.counters.get(name, 0) + n
            for modality, c in d.get("by_modality", {}).items():
                m = total.by_modality.setdefault(modality, {})
                for name, n in c.items():
                    m[name] = m.get(name, 0) + n
        for name, n in self.counters.items():
            total.counters[name] = total.counters.get(name, 0) + n
        total.sequences = len(self._seqs)
        return total

    async def leak_report_async(self) -> dict[str, dict[str, int]]:
        names = list(self._actors)
        res = await asyncio.gather(*(self._call(self._actors[n].leak_report.remote(), n) for n in names),
                                   return_exceptions=True)
        return {n: r for n, r in zip(names, res) if not isinstance(r, BaseException)}

    async def registry_stats_async(self) -> dict[str, int]:
        return await self._call(self._registry.stats.remote())

    def close(self) -> None:
        """Release every sequence this client holds and stop its event loop."""
        for st in list(self._seqs.values()):
            try:
                self.release(st.handle)
            except HolderLostError:
                continue
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self.settings.call_timeout_s)

    def __enter__(self) -> ClusterCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _info_dict(info: HolderInfo) -> dict[str, str]:
    return {"name": info.name, "node": info.node, "kind": info.kind}


def _twin(name: str):
    async_fn = getattr(ClusterCache, name + "_async")

    @functools.wraps(async_fn)
    def sync(self, *args, **kwargs):
        return self._run(async_fn(self, *args, **kwargs))

    sync.__name__ = name
    sync.__qualname__ = f"ClusterCache.{name}"
    sync.__doc__ = (async_fn.__doc__ or "") + "\n\nBlocking twin of ``" + name + "_async``."
    return sync


for _name in ("create_sequence", "append", "attach", "release", "contains", "contains_many", "locate", "locate_many",
              "put", "put_embedding", "get_embedding", "offload", "attention", "attention_state",
              "actor_stats", "stats", "leak_report", "registry_stats"):
    setattr(ClusterCache, _name, _twin(_name))


def connect(settings: ClusterSettings | None = None) -> ClusterCache:
    """A ``ClusterCache`` over the running mmtier actors (``start()`` first)."""
    if not ray.is_initialized():
        ray.init(address="auto", namespace=(settings or ClusterSettings()).namespace)
    return ClusterCache(settings)
