"""A cache's statistics as reports for a metrics system: how much each event counter grew since
the last report, and what each tier holds now. Ray actors publish them through Ray's metrics
(``cluster/metrics.py``), engine processes through their engine's own Prometheus endpoint
(``engines/vllm/metrics.py``). No metrics library here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

EVENTS = ("hits", "misses", "puts", "attaches", "shared_attaches", "evictions", "spills",
          "restores", "corrupt_reads", "embedding_reads", "appended_tokens", "decode_puts", "decode_hits",
          # the write-behind to the disk tier (``tiers.durability``): groups and bytes made
          # durable, saves it dropped (the disk behind or full), writes that failed
          "durable_writes", "durable_bytes", "durable_dropped", "durable_write_errors")


def increments(seen: dict[tuple[str, str], int], by_modality: Mapping[str, Mapping[str, int]]
               ) -> dict[tuple[str, str], int]:
    """``(event, modality) -> growth`` of the cumulative counters ``by_modality`` since ``seen``
    (which is updated). A counter that went down (its cache was replaced) counts from there on."""
    out: dict[tuple[str, str], int] = {}
    for modality, counts in by_modality.items():
        for event in EVENTS:
            now = int(counts.get(event, 0))
            before = seen.get((event, modality), 0)
            if now > before:
                out[(event, modality)] = now - before
            seen[(event, modality)] = now
    return out


@dataclass
class StatsReport:
    """Reports of one cache (anything with ``stats()``), at most every ``min_interval_s``:
    ``{"events": {"event|modality": growth}, "usage": {cache id: {"tier|modality": [bytes,
    groups]}}}``, plain JSON-able values (an engine ships them between its processes)."""

    cache: Any
    min_interval_s: float = 1.0
    _last: float | None = None
    _seen: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def source(self) -> str:
        return f"{os.getpid()}:{id(self.cache):x}"

    def take(self, now: float | None = None) -> dict | None:
        """The report since the last one, or ``None`` when the last was under the interval ago."""
        now = time.monotonic() if now is None else now
        if self._last is not None and now - self._last < self.min_interval_s:
            return None
        self._last = now
        stats = self.cache.stats()
        events = {f"{e}|{m}": n for (e, m), n in increments(self._seen, stats.by_modality).items()}
        usage = {f"{tier}|{m}": [u.bytes, u.groups] for tier, per in stats.tiers.items() for m, u in per.items()}
        return {"events": events, "usage": {self.source: usage}}
