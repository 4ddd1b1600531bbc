"""Typed statistics of a cache: usage per tier and modality, and event counters."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class TierUsage:
    groups: int = 0
    pages: int = 0
    bytes: int = 0
    capacity_bytes: int = 0


@dataclass
class CacheStats:
    """``tiers[tier][modality]`` usage (tier: 'device', 'host', 'disk'), ``counters`` by name
    (``hits``, ``misses``, ``puts``, ``shared_attaches``, ``evictions``, ``spills``, ``restores``,
    ``corrupt_reads``, ...), and the same counters split by modality in ``by_modality``."""

    tiers: dict[str, dict[str, TierUsage]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    by_modality: dict[str, dict[str, int]] = field(default_factory=dict)
    sequences: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def total_bytes(self, tier: str) -> int:
        return sum(u.bytes for u in self.tiers.get(tier, {}).values())


class Counters:
    """Event counters, overall and per modality. Thread-safe (counted outside the cache's lock too)."""

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self.modality: dict[str, Counter[str]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, modality: str | None = None, n: int = 1) -> None:
        with self._lock:
            self.total[name] += n
            if modality is not None:
                per = self.modality.get(modality)
                if per is None:                  # made once, not a fresh Counter per call
                    per = self.modality[modality] = Counter()
                per[name] += n

    def snapshot(self) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        with self._lock:
            return dict(self.total), {m: dict(c) for m, c in self.modality.items()}
