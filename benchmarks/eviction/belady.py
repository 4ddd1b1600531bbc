"""Belady's offline optimum at group granularity, as eviction policies fed by a next-use oracle.

Exact Belady (evict what is used furthest in the future) is optimal only for equal-size items
and one tier; with groups of different sizes and recompute costs the optimum is NP-hard, so two
standard approximations are used as the reference, each applied at every tier of the cascade:

- ``belady``: furthest next use first (whole groups).
- ``belady_size``: largest ``(next_use - now) * bytes / recompute_cost`` first, i.e. free the
  most bytes per unit of recompute cost lost, weighted by how long they would sit idle (groups
  never used again go first in both).

The oracle maps a group to the time of its next use (``inf`` when none); the simulator sets it
and advances ``now``. Neither is in ``mmtier.eviction.POLICIES``: they need the future.
"""

from __future__ import annotations

from collections.abc import Callable

from mmtier.config import CacheConfig
from mmtier.core.groups import ModalityGroup
from mmtier.eviction import EvictionPolicy, PolicyEntry

Oracle = Callable[[ModalityGroup], float]


class BeladyPolicy(EvictionPolicy):
    """Furthest next use first; ties in insertion order."""

    name = "belady"

    def __init__(self, cfg: CacheConfig, oracle: Oracle | None = None, clock=None):
        super().__init__(cfg, clock)
        self.oracle: Oracle = oracle or (lambda g: float("inf"))
        self.now = 0.0

    def _key(self, entry: PolicyEntry) -> float:
        return -self.oracle(entry.group)


class SizeAwareBeladyPolicy(BeladyPolicy):
    """Largest ``(next_use - now) * bytes / recompute_cost`` first (per-modality bytes/cost is a
    constant, ``token_bytes / recompute_cost``, so the heaps merge exactly)."""

    name = "belady_size"

    def _rank(self, key: float, modality: str, lane: int = 0) -> float:
        spec = self.cfg.modalities[modality]
        weight = spec.token_bytes / max(spec.recompute_cost, 1e-9)
        return (key + self.now) * weight
