"""The in-process cache: ``TieredKVCache`` (``tiered.py``), a facade over parts that each own
their state (keys, group index, residency, sequences, shared groups, attention, engine surface)."""

from .keys import DEFAULT_TENANT
from .tiered import TieredKVCache

__all__ = ["DEFAULT_TENANT", "TieredKVCache"]
