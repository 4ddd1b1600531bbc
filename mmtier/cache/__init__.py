"""The in-process cache: ``TieredKVCache`` (``tiered.py``), a facade over parts that each own
their state (keys, group index, residency, sequences, shared groups, attention, engine surface,
page I/O, holdings), and the typed results of its calls for a serving process (``GroupPages``,
``GroupInfo``, ``PageUsage``)."""

from .holdings import GroupInfo, PageUsage
from .keys import DEFAULT_TENANT
from .page_io import GroupPages
from .tiered import TieredKVCache

__all__ = ["DEFAULT_TENANT", "GroupInfo", "GroupPages", "PageUsage", "TieredKVCache"]
