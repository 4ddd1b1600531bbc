"""Follow the leader between whole policies (LRU and DIP by default), each judged on a shadow
cache of the device tier's size that runs that policy's own code, leaf-first and in bytes."""

from __future__ import annotations

from ..config import CacheConfig
from ..core.groups import ModalityGroup, Tier
from .base import Clock, EvictionPolicy
from .dip import DIPPolicy
from .lru import LRUPolicy


class Shadow:
    """A key-only device tier run by one policy: stand-in groups (digest, modality, tokens,
    parent; no pages), room made by the policy's own ``victims`` as the cache does, whole groups,
    leaf-first. ``use`` says whether a reference would have been a prefix hit here: the group is
    resident and its parent's latest use was a hit (a request's chain is used root first)."""

    def __init__(self, policy: EvictionPolicy):
        self.policy = policy
        self.groups: dict[bytes, ModalityGroup] = {}
        self.nbytes: dict[str, int] = {}
        self.hit: dict[bytes, bool] = {}          # digest -> its latest use was a prefix hit
        self._gid = 0

    def use(self, group: ModalityGroup, cap: dict[str, int]) -> bool:
        d = group.key.digest
        s = self.groups.get(d)
        p = group.parent.key.digest if group.parent is not None and group.parent.key is not None else None
        hit = s is not None and (p is None or self.hit.get(p, p in self.groups))
        if s is not None:
            s.hits += 1
            s.refs = group.refs
            self.policy.on_access(s)
        else:
            s = self._store(group, p, cap)
        self.hit[d] = hit
        return hit

    def refs(self, group: ModalityGroup) -> None:
        """The real group's references changed (attach, release): the stand-in's follow."""
        s = self.groups.get(group.key.digest)
        if s is None or s.refs == group.refs:
            return
        s.refs = group.refs
        if s.refs == 0:
            self.policy.on_release(s)
        else:
            self.policy.on_access(s)

    def release(self, group: ModalityGroup) -> None:
        s = self.groups.get(group.key.digest)
        if s is not None and s.refs:
            s.refs = 0
            self.policy.on_release(s)

    def _store(self, group: ModalityGroup, parent: bytes | None, cap: dict[str, int]) -> ModalityGroup | None:
        mod = group.modality
        need = self.nbytes.get(mod, 0) + group.nbytes - cap.get(mod, 0)
        if need > 0:
            got = 0
            chosen = []
            for v in self.policy.victims(Tier.DEVICE, need, mod):
                if got >= need:
                    break
                chosen.append(v)
                got += v.nbytes if v.modality == mod else 0
            if got < need:
                return None                        # everything here is held: not admitted
            for v in chosen:
                del self.groups[v.key.digest]
                self.hit.pop(v.key.digest, None)
                self.nbytes[v.modality] -= v.nbytes
                self.policy.on_remove(v)
        self._gid += 1
        s = ModalityGroup(self._gid, group.key, group.spec, group.num_tokens, refs=group.refs,
                          parent=self.groups.get(parent) if parent is not None else None, last_access=0.0)
        self.groups[group.key.digest] = s
        self.nbytes[mod] = self.nbytes.get(mod, 0) + s.nbytes
        self.policy.on_insert(s)
        return s


class DuelPolicy(EvictionPolicy):
    """Never far from the better of its experts: victims are chosen by one of several complete
    policies (``experts``: LRU first), all of which see every hook on the real groups, so each
    always holds the real cache's order by its own rule; the one in charge is the one whose
    shadow (``Shadow``: the same policy class over a key-only device tier of the real tier's size
    per modality, its high-water mark in bytes) would have had the most prefix hits, weighed by
    recompute cost (``num_tokens * recompute_cost``), over a recent window: scores decay by
    ``1 - 1 / window`` per reference, ``window`` being ``window_tiers`` times the groups
    tracked. LRU, the first expert, is in charge until the shadows have seen ``warm_tiers``
    references per group tracked, and keeps charge unless another scores ``margin`` times its
    score (switching costs hits: the cache holds what the previous leader kept). A
    reference is a store (a miss in the real cache) or an access after a new lookup hit
    (``group.hits`` grew); attaches and releases only move the stand-ins' references. Each call
    costs each expert's and each shadow's, O(log n). Leaf-first, pins and leases are the
    experts' mechanism's (the real groups), so they hold whoever is in charge."""

    name = "duel"
    expert_classes: tuple[type[EvictionPolicy], ...] = (LRUPolicy, DIPPolicy)
    window_tiers = 16.0
    margin = 1.25
    warm_tiers = 2.0

    def __init__(self, cfg: CacheConfig, clock: Clock | None = None):
        super().__init__(cfg, clock)
        self.experts = [cls(cfg, self.clock) for cls in self.expert_classes]
        self.shadows = [Shadow(cls(cfg, self.clock)) for cls in self.expert_classes]
        self.scores = [0.0] * len(self.experts)
        self.lead = 0
        self.references = 0
        self.cap: dict[str, int] = {}                  # the real device tier's peak bytes
        self._device: dict[str, int] = {}
        self._at: dict[int, tuple[str, int]] = {}      # gid -> (modality, bytes) while on device
        self._seen: dict[int, int] = {}                # gid -> hits at its latest reference

    # ------------------------------------------------------------------ hooks
    def on_insert(self, group: ModalityGroup) -> None:
        self._count(group)
        for e in self.experts:
            e.on_insert(group)
        self._seen[group.gid] = group.hits
        self._reference(group)

    def on_access(self, group: ModalityGroup) -> None:
        if group.gid not in self._seen:
            self.on_insert(group)
            return
        self._count(group)
        for e in self.experts:
            e.on_access(group)
        if group.hits > self._seen[group.gid]:
            self._seen[group.gid] = group.hits
            self._reference(group)
        elif group.key is not None:
            for s in self.shadows:
                s.refs(group)

    def on_release(self, group: ModalityGroup) -> None:
        for e in self.experts:
            e.on_release(group)
        if group.key is not None:
            for s in self.shadows:
                s.refs(group)

    def on_move(self, group: ModalityGroup, old_tier: Tier) -> None:
        self._count(group)
        for e in self.experts:
            e.on_move(group, old_tier)

    def on_remove(self, group: ModalityGroup) -> None:
        old = self._at.pop(group.gid, None)
        if old is not None:
            self._device[old[0]] -= old[1]
        self._seen.pop(group.gid, None)
        for e in self.experts:
            e.on_remove(group)
        if group.key is not None and group.refs:      # dropped while held: the stand-ins let go
            for s in self.shadows:
                s.release(group)

    def victims(self, tier: Tier, bytes_needed: int, modality: str | None = None) -> list[ModalityGroup]:
        return self.experts[self.lead].victims(tier, bytes_needed, modality)

    def __len__(self) -> int:
        return len(self._seen)

    # ------------------------------------------------------------------ scoring
    def _count(self, group: ModalityGroup) -> None:
        """Bytes on the device tier per modality, and their high-water mark (the shadows' size)."""
        old = self._at.pop(group.gid, None)
        if old is not None:
            self._device[old[0]] -= old[1]
        if group.tier == Tier.DEVICE:
            m, b = group.modality, group.nbytes
            self._at[group.gid] = (m, b)
            self._device[m] = self._device.get(m, 0) + b
            self.cap[m] = max(self.cap.get(m, 0), self._device[m])

    def _reference(self, group: ModalityGroup) -> None:
        if group.key is None:
            return
        keep = 1.0 - 1.0 / max(self.window_tiers * len(self._seen), 64.0)
        w = group.recompute_cost
        for i, s in enumerate(self.shadows):
            self.scores[i] = self.scores[i] * keep + (w if s.use(group, self.cap) else 0.0)
        self.references += 1
        if self.references < self.warm_tiers * len(self._seen):
            return                                   # too little evidence yet: LRU stays
        best = max(range(len(self.scores)), key=self.scores.__getitem__)
        if self.scores[best] > self.scores[self.lead] * (self.margin if self.lead == 0 else 1.0):
            self.lead = best
