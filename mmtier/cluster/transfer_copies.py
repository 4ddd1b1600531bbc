"""``GroupCopier``: ships a group's pages from one holder to another through the object store
(raw page buffers, per-page checksums checked where they land; the client never touches the
bytes) and records the new holder in the registry. Attaching by copy and ``offload`` both use
it; it counts what it moved."""

from __future__ import annotations

from collections import Counter

from ..content import ContentKey
from .client_holders import Holders
from .metrics import ClientMetrics
from .registry import Location


class GroupCopier:
    def __init__(self, holders: Holders, metrics: ClientMetrics, counters: Counter[str]):
        self.holders = holders
        self.metrics = metrics
        self.counters = counters

    async def copy(self, key: ContentKey, loc: Location, src: str, dst: str) -> None:
        h = self.holders
        meta_ref, buf_ref = h.actor(src).export.options(num_returns=2).remote(key.to_wire())
        await h.call(meta_ref, src)
        item, evicted = await h.call(h.actor(dst).import_group.remote(key.to_wire(), meta_ref, buf_ref), dst)
        h.forget_evicted(dst, evicted)
        if item is not None:
            await h.announce(dst, [item])
            self.metrics.copied(key.modality, loc.nbytes)
            self.counters["copies"] += 1
