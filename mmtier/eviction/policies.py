"""The shipped eviction policies by name (``POLICIES``, ``make_policy``): LRU, modality LRU and
cost-aware in ``lru.py``, the others a file each (``bimodal.py``, ``s3fifo.py``, ``arc.py``,
``dip.py``, ``duel.py``, ``chainbip.py``, ``slru.py``). A new policy is one class in a file of its
own (or beside its kin) plus one line in ``POLICIES`` (and its name in ``config.POLICIES``)."""

from __future__ import annotations

from ..config import CacheConfig
from ..errors import ConfigError
from .arc import ARCPolicy
from .base import Clock, EvictionPolicy
from .bimodal import BimodalLRUPolicy
from .chainbip import ChainBIPPolicy
from .dip import DIPPolicy
from .duel import DuelPolicy
from .lru import CostAwarePolicy, LRUPolicy, ModalityLRUPolicy
from .s3fifo import S3FIFOPolicy
from .slru import AdaptiveSLRUPolicy

__all__ = ["POLICIES", "CostAwarePolicy", "LRUPolicy", "ModalityLRUPolicy", "make_policy"]


POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "modality_lru": ModalityLRUPolicy,
    "cost_aware": CostAwarePolicy,
    "bimodal_lru": BimodalLRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
    "dip": DIPPolicy,
    "duel": DuelPolicy,
    "chain_bip": ChainBIPPolicy,
    "adaptive_slru": AdaptiveSLRUPolicy,
}


def make_policy(cfg: CacheConfig, clock: Clock | None = None) -> EvictionPolicy:
    try:
        cls = POLICIES[cfg.eviction_policy]
    except KeyError:
        raise ConfigError(f"eviction_policy {cfg.eviction_policy!r} is not implemented",
                          ("eviction_policy",)) from None
    return cls(cfg, clock)
