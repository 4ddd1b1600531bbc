"""``SharedGroups``: the content-keyed groups of a ``TieredKVCache`` as callers see them:
``contains``, ``put`` / ``put_embedding`` (stored once) and ``get_embedding``. The groups are the
index's; this part checks, writes and counts (``attach`` is the sequences').
"""

from __future__ import annotations

import torch

from ..config import CacheConfig, ModalitySpec
from ..content import ContentKey
from ..errors import ShapeError
from ..eviction import EvictionPolicy
from ..pages.payload import FiniteCheck, check_kv, check_payload, write_embedding, write_fresh_pages
from ..stats import Counters
from ..storage.host import write_host_slots
from ..tiers.residency import Residency
from .group_index import GroupIndex
from .keys import CacheKeys


class SharedGroups:
    """Stores and reads shared groups; holds no state of its own beyond the parts it is given."""

    def __init__(self, cfg: CacheConfig, keyer: CacheKeys, index: GroupIndex,
                 residency: Residency, policy: EvictionPolicy, counters: Counters):
        self.cfg, self.keyer, self.index, self.residency = cfg, keyer, index, residency
        self.lock = residency.lock
        self.policy, self.counters = policy, counters

    def contains(self, key: ContentKey) -> bool:
        self.keyer.check_key(key)
        with self.lock:
            self.residency.apply_copies()
            group = self.index.get(key)
            self.counters.add("hits" if group is not None else "misses", key.modality)
            if group is not None:
                group.hits += 1          # a lookup hit; recency moves on use (attach, read)
                if group.generated:
                    self.counters.add("decode_hits", key.modality)
            return group is not None

    def put(self, key: ContentKey, k: torch.Tensor, v: torch.Tensor, *, generated: bool = False) -> bool:
        self.residency.check_open()
        spec = self.keyer.check_key(key, "kv")
        n = check_kv(spec, k, v, block_split=True, finite=False)
        backend = self.cfg.attention_backend
        on_cpu = self.residency.pools[key.modality].device.type == "cpu"
        finite = FiniteCheck(spec, k, v, fuse=on_cpu)   # the NaN / Inf scan: in or beside the copy
        try:
            stored = self.store(key, spec, n, lambda pool, pages: write_fresh_pages(
                pool, k, v, pages, backend, finite.tally), ready=finite.wait,
                write_host=lambda host, entry: write_host_slots(host, entry, k, v, finite.tally),
                generated=generated)
            finite.wait()                     # a key already held: the payload is still checked
            return stored
        finally:
            finite.settle()

    def put_embedding(self, key: ContentKey, x: torch.Tensor) -> bool:
        self.residency.check_open()
        spec = self.keyer.check_key(key, "embedding")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != spec.width or x.shape[0] == 0:
            raise ShapeError(f"{key.modality}: embedding must be [n_tokens > 0, {spec.width}], "
                             f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        check_payload(spec, x)
        return self.store(key, spec, x.shape[0], lambda pool, pages: write_embedding(pool, x, pages))

    def store(self, key: ContentKey, spec: ModalitySpec, n: int, write, ready=None, write_host=None, *,
              generated: bool = False) -> bool:
        """A new shared group of ``n`` tokens: pages (making room), ``write(pool, pages)``, then
        ``ready()`` (a check of the payload that ran beside the write: it raises to refuse it),
        index. A refusal frees the pages and records nothing; room made for them by moving
        groups one tier down stays made (those groups are intact there). With ``write_host``
        (``write_host(host tier, entry)`` fills host slots), a put the placement policy sends
        around a full pool lands in the host tier instead, in one copy (``tiers.placement``;
        ``Residency.store_host``)."""
        with self.lock:
            self.residency.apply_copies()
            if key in self.index:
                return False
            pool = self.residency.pools[key.modality]
            if write_host is not None and self.residency.placement.around(pool, spec.pages_for(n)):
                stored = self.residency.store_host(key, spec, n, write_host, ready, generated=generated)
                if stored is not None:
                    return stored
                if key in self.index:            # put by another thread while room was made
                    return False
            pages = self.residency.allocate(pool, spec.pages_for(n), [])
            if key in self.index:            # put by another thread while room was made
                pool.free(pages)
                return False
            try:
                write(pool, pages)
                if ready is not None:
                    ready()
            except BaseException:            # nothing recorded: the call changes nothing
                pool.free(pages)
                raise
            self.index.insert(key, spec, n, pages, generated=generated)
            return True

    def get_embedding(self, key: ContentKey) -> torch.Tensor:
        spec = self.keyer.check_key(key, "embedding")
        with self.lock:
            self.residency.apply_copies()
            group = self.index.require(key)
            group.hits += 1
            self.counters.add("embedding_reads", key.modality)
            self.policy.on_access(group)
            self.residency.promote(group)        # may let go of the lock while it waits
            group = self.index.require(key)
            pages = self.residency.read_pages(group)
            return pages.reshape(-1, spec.width)[: group.num_tokens].clone()
