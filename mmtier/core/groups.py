"""Modality groups: the unit of sharing, residency and eviction.

A group is every page of one media item (an image, an audio clip, a video segment) or of one
run of tokens a sequence appended. Its pages move between tiers together and are freed
together; no tier ever holds part of a group. Shared groups have a ``ContentKey``; a run of
appended tokens owned by one sequence has ``key is None`` until it is sealed under a chained key.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from ..config import ModalitySpec
from ..content import ContentKey


class Tier(enum.IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2


@dataclass(eq=False)
class ModalityGroup:
    gid: int
    key: ContentKey | None
    spec: ModalitySpec
    num_tokens: int
    tier: Tier = Tier.DEVICE
    pages: list[int] = field(default_factory=list)   # device page ids while tier is DEVICE
    location: Any = None                             # the lower tier's handle while elsewhere
    refs: int = 0                                    # sequences that hold the group
    pins: int = 0                                    # explicit pins (attention in progress, ...)
    leases: dict[int, float] = field(default_factory=dict)   # lease id -> monotonic expiry
    last_access: float = field(default_factory=time.monotonic)
    hits: int = 0
    busy: int = 0                                    # copies in flight from or to its pages
    freed: bool = False                              # gone from the cache; its storage goes
                                                     # when the last pin is dropped
    parent: ModalityGroup | None = None              # the group its key chains (prefix-dependent)
    generated: bool = False                          # KV of tokens a model generated (an answer):
                                                     # admitted on probation, counted apart

    @property
    def modality(self) -> str:
        return self.spec.name or ""

    @property
    def shared(self) -> bool:
        return self.key is not None

    @property
    def num_pages(self) -> int:
        return self.spec.pages_for(self.num_tokens)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.spec.page_bytes

    @property
    def recompute_cost(self) -> float:
        return self.num_tokens * self.spec.recompute_cost

    def live_leases(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        expired = [lid for lid, until in self.leases.items() if until <= now]
        for lid in expired:
            del self.leases[lid]
        return len(self.leases)

    @property
    def evictable(self) -> bool:
        """Nothing holds it: no sequence, no pin, no live lease, no copy in flight."""
        return self.refs == 0 and self.pins == 0 and self.busy == 0 and self.live_leases() == 0

    def __repr__(self) -> str:
        name = repr(self.key) if self.key else f"private#{self.gid}"
        return f"<group {name} {self.modality} {self.num_tokens} tok {self.tier.name} refs={self.refs}>"
