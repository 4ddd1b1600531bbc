"""Eviction: the mechanism (``base``: heaps per tier and modality, leaf-first over prefix chains)
and the policies (``policies``: LRU, modality-priority LRU, bimodal LRU, cost-aware)."""

from .base import MAX_BUNDLE, Clock, EvictionPolicy, _Entry
from .policies import (
    POLICIES,
    BimodalLRUPolicy,
    CostAwarePolicy,
    LRUPolicy,
    ModalityLRUPolicy,
    make_policy,
)

__all__ = ["MAX_BUNDLE", "POLICIES", "BimodalLRUPolicy", "Clock", "CostAwarePolicy", "EvictionPolicy",
           "LRUPolicy", "ModalityLRUPolicy", "_Entry", "make_policy"]
