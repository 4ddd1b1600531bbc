"""``TieredKVCache``: the in-process cache. Composes pools, groups, tables, keys and policy.

Every public method validates its input completely before it changes anything, so a call that
raises leaves the cache exactly as it was. One lock (``OwnerLock``) guards the bookkeeping only:
attention is planned under it (segments chosen, groups pinned, operands captured), computed
without it, and unpinned under it again; a call that must wait for a copy (a spill that makes
room, a restore from disk) marks the groups it works on and lets go of the lock for the wait.
The cache composes the lower tiers (``residency``) and the attention plans, which know it only
through what it passes them (``GroupOwner``).

The public surface is split by what it holds, each part a base class over this class's state:
keys and tenants (``cache_keys``), sequences and appends (``cache_sequences``), shared groups
(``cache_groups``), attention (``cache_attention``), tier movement, leases and export
(``cache_tiers``), and the engine surface (``engine_api``). This file holds the state, the
payload I/O helpers, stats and the life cycle.
"""

from __future__ import annotations

import itertools

import torch

from .cache_attention import AttentionAPI
from .cache_groups import GroupAPI
from .cache_keys import DEFAULT_TENANT, KeyAPI
from .cache_sequences import SequenceAPI
from .cache_tiers import TierAPI
from .compiled_operands import CompiledOperands
from .config import CacheConfig, ModalitySpec
from .content import ContentKey, KeyMaker
from .engine_api import EngineAPI
from .errors import ClosedError
from .eviction import EvictionPolicy, make_policy
from .groups import ModalityGroup, Tier
from .leases import LeaseTable
from .lineage import Lineage
from .locking import OwnerLock
from .payload import check_kv, check_payload, write_fresh_pages, write_slots
from .pool import DeviceArena, PagePool
from .residency import LowerTiers
from .room import Room
from .stats import CacheStats, Counters, TierUsage
from .step_plans import StepPlans
from .table import SequenceTable

__all__ = ["DEFAULT_TENANT", "TieredKVCache"]


class TieredKVCache(EngineAPI, KeyAPI, SequenceAPI, GroupAPI, AttentionAPI, TierAPI):
    """Paged, modality-aware KV cache with content-keyed sharing (see docs/design.md's contract)."""

    def __init__(self, cfg: CacheConfig, policy: EvictionPolicy | None = None):
        """``policy``: an eviction policy instance to use instead of ``cfg.eviction_policy``'s
        (an offline reference in a benchmark, say); it must be new (it has seen no group)."""
        self.cfg = cfg
        self.arena = DeviceArena(cfg)
        self.pools: dict[str, PagePool] = self.arena.pools
        self.keys = KeyMaker(cfg.model, cfg.key_secret)
        self.policy = policy if policy is not None else make_policy(cfg)
        self.counters = Counters()
        self._compiled = CompiledOperands()     # device operands per sequence, reused while unchanged
        self._steps = StepPlans()               # batch plans, reused by the other layers of a step
        self._lock = OwnerLock()
        self._groups: dict[ContentKey, ModalityGroup] = {}
        self._seqs: dict[int, SequenceTable] = {}
        self._gids = itertools.count(1)
        self._seq_ids = itertools.count(1)
        self._closed = False
        self.leases = LeaseTable(ttl=30.0, clock=self.policy.clock)
        self.lineage = Lineage()
        self.lower = LowerTiers(cfg, self.keys, self.counters, self.policy, owner=self)
        self.room = Room(self._lock, self.policy, self.lower, self._live_groups, self._drop, self.pools)
        for group in self.lower.adopt_disk_inventory(self._groups, lambda: next(self._gids)):
            self._groups[group.key] = group
            self.policy.on_insert(group)

    # ------------------------------------------------------------------ I/O helpers
    def _check_kv(self, spec: ModalitySpec, k, v, *, block_split: bool = False) -> int:
        return check_kv(spec, k, v, block_split=block_split)

    def _check_dtype(self, spec: ModalitySpec, t: torch.Tensor) -> None:
        check_payload(spec, t)

    def _write_fresh(self, pool: PagePool, k, v, pages: list[int]) -> None:
        write_fresh_pages(pool, k, v, pages, self._backend())

    def _write(self, pool: PagePool, k, v, page_ids: torch.Tensor, offsets: torch.Tensor) -> None:
        write_slots(pool, k, v, page_ids, offsets, self._backend())

    # ------------------------------------------------------------------ stats and life cycle
    def stats(self) -> CacheStats:
        with self._lock:
            self.lower.apply_completions()
            device: dict[str, TierUsage] = {}
            for name, pool in self.pools.items():
                device[name] = TierUsage(0, pool.num_used, pool.num_used * pool.spec.page_bytes,
                                         pool.num_pages * pool.spec.page_bytes)
            seen: set[int] = set()
            groups = self._live_groups()
            for g in groups:
                if g.gid in seen or g.tier != Tier.DEVICE:
                    continue
                seen.add(g.gid)
                device[g.modality].groups += 1
            counters, by_modality = self.counters.snapshot()
            counters.update(self.lower.storage_counters())
            return CacheStats(tiers={"device": device, **self._lower_stats()}, counters=counters,
                              by_modality=by_modality, sequences=len(self._seqs))

    def _lower_stats(self) -> dict[str, dict[str, TierUsage]]:
        if not self.lower.enabled:
            return {}
        return self.lower.stats(self._live_groups())

    def _open(self) -> None:
        if self._closed:
            raise ClosedError("the cache is closed")

    def close(self) -> None:
        """Wait for in-flight copies, then close the lower tiers (files stay for a restart)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.lower.close()

    def __enter__(self) -> TieredKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
