"""Eviction: the mechanism (``base``: heaps per tier, modality and lane, leaf-first over prefix
chains) and the policies (``lru``: LRU, modality-priority LRU, cost-aware; ``policies``: the map by name;
``bimodal``, ``s3fifo``, ``arc``, ``dip``, ``duel``, ``chainbip``, ``slru``: one policy each; ``lanes``: what two-queue policies share)."""

from .arc import ARCPolicy
from .base import MAX_BUNDLE, Clock, EvictionPolicy, PolicyEntry
from .bimodal import BimodalLRUPolicy
from .chainbip import ChainBIPPolicy
from .dip import DIPPolicy
from .duel import DuelPolicy
from .policies import (
    POLICIES,
    CostAwarePolicy,
    LRUPolicy,
    ModalityLRUPolicy,
    make_policy,
)
from .s3fifo import S3FIFOPolicy
from .slru import AdaptiveSLRUPolicy

__all__ = ["MAX_BUNDLE", "POLICIES", "ARCPolicy", "AdaptiveSLRUPolicy", "BimodalLRUPolicy", "ChainBIPPolicy", "Clock", "CostAwarePolicy", "DIPPolicy", "DuelPolicy",
           "EvictionPolicy", "LRUPolicy", "ModalityLRUPolicy", "PolicyEntry", "S3FIFOPolicy", "make_policy"]

