"""``Holdings``: what a ``TieredKVCache`` holds, as a process serving it to others asks (a pool
of the cluster): snapshots of its shared groups (``GroupInfo``), which keys are indexed, explicit
drops of unreferenced groups, page usage against the pages of cached groups (``PageUsage``: a
leak check) and how many groups it has lost so far. Each call takes the cache's lock itself;
none applies finished copies or counts a hit or a miss (they are checks, not uses). The group
index, sequences, pools, residency and counters are given to this part; it holds no state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..content import ContentKey
from ..core.groups import ModalityGroup, Tier
from ..pages.pool import PagePool
from ..stats import Counters
from ..tiers.residency import Residency
from .group_index import GroupIndex
from .sequences import Sequences


@dataclass(frozen=True)
class GroupInfo:
    """One shared group as it stands: where it lives, its size, how many sequences hold it and
    whether it could leave now (no reference, pin, copy or lease)."""

    key: ContentKey
    num_tokens: int
    nbytes: int
    tier: Tier
    refs: int
    evictable: bool

    @classmethod
    def of(cls, group: ModalityGroup) -> GroupInfo:
        return cls(group.key, group.num_tokens, group.nbytes, group.tier, group.refs, group.evictable)


@dataclass(frozen=True)
class PageUsage:
    """Device pages in use against the pages of cached device groups (equal when no sequence
    leaked pages), with the live sequences and leases."""

    sequences: int
    used_pages: int
    cached_pages: int
    leases: int


class Holdings:
    """Read-mostly views of the cache's groups, and explicit drops (see the module's docstring)."""

    def __init__(self, pools: dict[str, PagePool], index: GroupIndex, seqs: Sequences,
                 residency: Residency, counters: Counters):
        self.lock, self.pools, self.index, self.seqs = residency.lock, pools, index, seqs
        self.residency, self.counters = residency, counters

    def group_info(self, key: ContentKey) -> GroupInfo | None:
        with self.lock:
            group = self.index.get(key)
            return None if group is None else GroupInfo.of(group)

    def group_infos(self) -> list[GroupInfo]:
        with self.lock:
            return [GroupInfo.of(g) for g in self.index]

    def indexed(self, keys: Iterable[ContentKey]) -> list[bool]:
        with self.lock:
            return [k in self.index for k in keys]

    def drop_unreferenced(self, keys: Iterable[ContentKey]) -> list[ContentKey]:
        with self.lock:
            dropped = []
            for key in keys:
                group = self.index.get(key)
                if group is not None and group.evictable:
                    self.residency.free_group(group)
                    dropped.append(key)
            return dropped

    def page_usage(self) -> PageUsage:
        with self.lock:
            used = sum(p.num_used for p in self.pools.values())
            cached = sum(len(g.pages) for g in self.index if g.tier == Tier.DEVICE)
            return PageUsage(len(self.seqs), used, cached, len(self.residency.leases))

    def groups_lost(self) -> int:
        total = self.counters.total
        return total["evictions"] + total["corrupt_reads"]
