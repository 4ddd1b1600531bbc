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

``ClusterCache`` is a small facade over parts that each own their state: ``Holders`` (the
actor handles and how to call them), ``ClusterKeys`` (keys as every node derives them),
``SequenceBook`` (each sequence's state and home), ``Attacher`` (the copy-after-N rule and its
counts), ``SharedGroups`` (content-keyed groups), ``GroupCopier`` (pages shipped between holders)
and ``ClusterAttention`` (attention and fail-over). This file builds them, holds stats, the life
cycle, the blocking twins and ``connect``.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import threading
from collections import Counter
from collections.abc import Iterable, Sequence

import ray
import torch

from ..config import CacheConfig
from ..content import ContentKey
from ..core.segments import SequenceHandle
from ..errors import HolderLostError
from ..stats import CacheStats, TierUsage
from .client_attach import Attacher
from .client_attention import ClusterAttention
from .client_holders import Holders
from .client_keys import ClusterKeys
from .client_sequence_state import ClusterSequence, Transfer
from .client_sequences import SequenceBook
from .client_shared import SharedGroups
from .metrics import ClientMetrics
from .registry import Location
from .registry_shards import RegistryShards
from .settings import ClusterSettings
from .transfer_copies import GroupCopier


class ClusterCache:
    """The cluster's cache: the same methods as ``TieredKVCache``, each with an async twin."""

    def __init__(self, settings: ClusterSettings | None = None):
        self.settings = settings or ClusterSettings()
        s = self.settings
        registry = RegistryShards(s)
        self.cfg = CacheConfig(**registry.config().get(s.call_timeout_s))
        self._keys = ClusterKeys(self.cfg)
        self.keys = self._keys.maker
        self.metrics = ClientMetrics()
        self.counters: Counter[str] = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mmtier-client", daemon=True)
        self._thread.start()
        self.holders = Holders(s, registry, self._loop)
        self.book = SequenceBook(self.cfg, self._keys, self.holders, ray.get_runtime_context().get_node_id())
        copier = GroupCopier(self.holders, self.metrics, self.counters)
        self.attacher = Attacher(self.book, self._keys, self.holders, copier, self.metrics,
                                 s.copy_after_remote_uses)
        self.groups = SharedGroups(s, self._keys, self.holders, self.book, copier, self.metrics,
                                   f"client-{secrets.token_hex(6)}")
        self.attention_parts = ClusterAttention(self.book, self._keys, self.holders, self.attacher,
                                                self.metrics, self.counters)
        self.refresh()

    # ------------------------------------------------------------------ holders and keys
    def refresh(self) -> list[str]:
        """Look the pool and store actors up again (after ``start()`` added nodes)."""
        return self.holders.refresh()

    def pools(self, node: str | None = None) -> list[str]:
        return self.holders.pools(node)

    def stores(self, node: str | None = None) -> list[str]:
        return self.holders.stores(node)

    def content_key(self, modality: str, media: bytes | bytearray | memoryview, *,
                    tenant: str | None = None, parent: ContentKey | None = None,
                    params: dict[str, object] | None = None) -> ContentKey:
        """The key of a media item: the same bytes give the same key on every node."""
        return self._keys.content_key(modality, media, tenant=tenant, parent=parent, params=params)

    def prefix_key(self, seq: SequenceHandle) -> ContentKey:
        return self.book.prefix_key(seq)

    # ------------------------------------------------------------------ sequences
    async def create_sequence_async(self, tenant: str | None = None, *,
                                    hint_keys: Iterable[ContentKey] | None = None,
                                    node: str | None = None) -> SequenceHandle:
        """A new sequence: on ``node``'s pool, else near ``hint_keys``, else placed lazily."""
        return await self.book.create(tenant, hint_keys=hint_keys, node=node)

    def sequence(self, seq: SequenceHandle) -> ClusterSequence:
        """What the client knows of a sequence: its length, home pool and attached keys."""
        return self.book.view(seq)

    def where(self, seq: SequenceHandle) -> str | None:
        """The home pool of a sequence (``None`` until it is placed)."""
        return self.book.get(seq).home

    async def append_async(self, seq: SequenceHandle, modality: str, k: torch.Tensor, v: torch.Tensor,
                           *, tokens: Sequence[int] | None = None) -> None:
        await self.book.append(seq, modality, k, v, tokens=tokens)

    async def attach_async(self, seq: SequenceHandle, key: ContentKey, *,
                           transfer: Transfer | None = None) -> None:
        """Reference a stored group at the sequence's next position, wherever it is held."""
        await self.attacher.attach(seq, key, transfer=transfer)

    async def release_async(self, seq: SequenceHandle) -> None:
        await self.book.release(seq)

    # ------------------------------------------------------------------ shared groups
    async def contains_async(self, key: ContentKey) -> bool:
        return await self.groups.contains(key)

    async def contains_many_async(self, keys: Sequence[ContentKey]) -> list[bool]:
        """One registry call for many keys."""
        return await self.groups.contains_many(keys)

    async def locate_async(self, key: ContentKey) -> Location | None:
        return await self.groups.locate(key)

    async def locate_many_async(self, keys: Sequence[ContentKey]) -> list[Location | None]:
        """Where each group lives (``None``: nowhere), in one registry call."""
        return await self.groups.locate_many(keys)

    async def put_async(self, key: ContentKey, k: torch.Tensor, v: torch.Tensor, *,
                        node: str | None = None) -> bool:
        """Store a group once in the cluster; ``False`` when some actor already holds it."""
        return await self.groups.put(key, k, v, node=node)

    async def put_embedding_async(self, key: ContentKey, x: torch.Tensor, *, node: str | None = None) -> bool:
        return await self.groups.put_embedding(key, x, node=node)

    async def get_embedding_async(self, key: ContentKey) -> torch.Tensor:
        return await self.groups.get_embedding(key)

    async def offload_async(self, key: ContentKey) -> bool:
        """Move a group from its pools to their nodes' stores (outlives the pool actors)."""
        return await self.groups.offload(key)

    # ------------------------------------------------------------------ attention
    async def attention_async(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                              groups: Iterable[ContentKey] | None = None, causal: bool = True,
                              scale: float | None = None) -> torch.Tensor:
        out, _ = await self.attention_parts.state(seq, layer, q, groups=groups, causal=causal, scale=scale)
        return out

    async def attention_state_async(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                                    groups: Iterable[ContentKey] | None = None, causal: bool = True,
                                    scale: float | None = None, q_positions: torch.Tensor | None = None,
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` over every part of the sequence, wherever it lives, merged exactly."""
        return await self.attention_parts.state(seq, layer, q, groups=groups, causal=causal, scale=scale,
                                                q_positions=q_positions)

    # ------------------------------------------------------------------ stats and life cycle
    async def actor_stats_async(self) -> dict[str, dict]:
        """Each live actor's stats (pools: ``CacheStats.to_dict()``; stores: tier usage)."""
        h = self.holders
        names = list(h.actors)
        res = await asyncio.gather(*(h.call(
            (h.actors[n].stats if h.kind(n) == "pool" else h.actors[n].tier_stats).remote(), n)
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
        total.sequences = len(self.book)
        return total

    async def leak_report_async(self) -> dict[str, dict[str, int]]:
        h = self.holders
        names = list(h.actors)
        res = await asyncio.gather(*(h.call(h.actors[n].leak_report.remote(), n) for n in names),
                                   return_exceptions=True)
        return {n: r for n, r in zip(names, res) if not isinstance(r, BaseException)}

    async def registry_stats_async(self) -> dict[str, int]:
        return await self.holders.call(self.holders.registry.stats())

    def close(self) -> None:
        """Release every sequence this client holds and stop its event loop."""
        for st in self.book.live():
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


def _twin(name: str):
    async_fn = getattr(ClusterCache, name + "_async")

    @functools.wraps(async_fn)
    def sync(self, *args, **kwargs):
        return self.holders.run(async_fn(self, *args, **kwargs))

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
