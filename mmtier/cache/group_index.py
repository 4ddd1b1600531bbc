"""``GroupIndex``: the shared groups a ``TieredKVCache`` holds, by content key: the
``ContentKey -> ModalityGroup`` map, group ids, the lineage of prefix-dependent keys (a child's
parent, so eviction takes leaves first), and the policy's filing of what enters and leaves it.
Called with the cache's lock held.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

from ..config import ModalitySpec
from ..content import ContentKey
from ..core.groups import ModalityGroup, Tier
from ..core.lineage import Lineage
from ..errors import UnknownKeyError
from ..eviction import EvictionPolicy
from ..stats import Counters


class GroupIndex:
    """Content key -> group, ids and lineage (its own state); the policy and counters are the
    cache's, told of every group indexed."""

    def __init__(self, policy: EvictionPolicy, counters: Counters):
        self.policy, self.counters = policy, counters
        self.groups: dict[ContentKey, ModalityGroup] = {}
        self.lineage = Lineage()
        self._gids = itertools.count(1)
        # told of each new shared group (a put, an import, a sealed run): the write-behind's queue
        self.on_saved: Callable[[ModalityGroup], None] | None = None

    def new_gid(self) -> int:
        return next(self._gids)

    def __contains__(self, key: ContentKey) -> bool:
        return key in self.groups

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[ModalityGroup]:
        return iter(list(self.groups.values()))

    def get(self, key: ContentKey) -> ModalityGroup | None:
        return self.groups.get(key)

    def require(self, key: ContentKey) -> ModalityGroup:
        group = self.groups.get(key)
        if group is None:
            raise UnknownKeyError(f"{key!r} is not in the cache (put it first)")
        return group

    def insert(self, key: ContentKey, spec: ModalitySpec, n: int, pages: list[int], *,
               tier: Tier = Tier.DEVICE, location: object = None, generated: bool = False) -> ModalityGroup:
        """A new shared group of ``n`` tokens on device ``pages`` (or in a lower ``tier`` at
        ``location``: a put written around the device), filed under its lineage parent;
        ``generated``: KV of generated tokens (``ModalityGroup.generated``)."""
        group = ModalityGroup(self.new_gid(), key, spec, n, tier=tier, pages=pages, location=location,
                              parent=self.lineage.parent_of(key, self.groups), generated=generated)
        self.groups[key] = group
        self.policy.on_insert(group)
        self.counters.add("puts", key.modality)
        if generated:
            self.counters.add("decode_puts", key.modality)
        self.counters.add("stored_tokens", key.modality, n)
        if self.on_saved is not None:
            self.on_saved(group)
        return group

    def adopt(self, groups: Iterable[ModalityGroup]) -> None:
        """Groups found in a lower tier (a warm restart), indexed as they are."""
        for group in groups:
            self.groups[group.key] = group
            self.policy.on_insert(group)

    def name(self, key: ContentKey, group: ModalityGroup) -> None:
        """A private run becomes the shared group ``key`` (``seal``; ``key`` not held)."""
        group.key = key
        group.parent = self.lineage.parent_of(key, self.groups)
        self.groups[key] = group
        if group.parent is not None:          # a private run became a link of a prefix chain:
            self.policy.on_remove(group)      # re-filed with its parent, so eviction takes
            self.policy.on_insert(group)      # it before the parent (leaf-first)
        self.counters.add("puts", key.modality)
        self.counters.add("stored_tokens", key.modality, group.num_tokens)
        if self.on_saved is not None:
            self.on_saved(group)

    def unindex(self, group: ModalityGroup) -> None:
        """The group's key no longer names it (a later group under the key stays)."""
        if group.key is not None and self.groups.get(group.key) is group:
            del self.groups[group.key]
