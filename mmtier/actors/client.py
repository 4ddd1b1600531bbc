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

The surface is split by what it holds, each part a base class over this class's state: actor
handles and calls (``client_calls``), keys and sequences (``client_sequences``), attaching
(``client_attach``), shared groups (``client_groups``) and attention (``client_attention``). This
file holds the state, stats, the life cycle, the blocking twins and ``connect``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import secrets
import threading
from collections import Counter
from typing import Any

import ray

from ..config import CacheConfig
from ..content import KeyMaker
from ..errors import HolderLostError
from ..stats import CacheStats, TierUsage
from .client_attach import AttachOps
from .client_attention import AttentionOps
from .client_calls import ActorCalls
from .client_groups import GroupOps
from .client_sequences import SequenceOps
from .client_state import _Seq
from .metrics import ClientMetrics
from .registry import HolderInfo
from .settings import ClusterSettings


class ClusterCache(ActorCalls, SequenceOps, AttachOps, GroupOps, AttentionOps):
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
