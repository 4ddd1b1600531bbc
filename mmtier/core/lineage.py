"""Parent links of prefix-dependent groups, for leaf-first eviction.

A prefix-dependent key chains its parent's digest, which cannot be read back from the key.
``Lineage`` remembers, for keys this cache derived, the key they chain: ``content_key(...,
parent=P)`` notes ``key -> P``, and ``prefix_key(seq)`` notes ``chain key -> the key of the
sequence's last shared group``. When a group is stored, ``parent_of`` follows those notes to the
nearest stored group. The notes are bounded (least recently used dropped first): a lost note
costs eviction order, never correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from ..content import ContentKey
from .groups import ModalityGroup

MAX_NOTES = 1 << 16
MAX_HOPS = 4


class Lineage:
    def __init__(self, max_notes: int = MAX_NOTES):
        self.max_notes = max_notes
        self._up: OrderedDict[ContentKey, ContentKey] = OrderedDict()

    def note(self, child: ContentKey, parent: ContentKey) -> None:
        self._up[child] = parent
        self._up.move_to_end(child)
        while len(self._up) > self.max_notes:
            self._up.popitem(last=False)

    def parent_of(self, key: ContentKey, groups: Mapping[ContentKey, ModalityGroup]
                  ) -> ModalityGroup | None:
        """The stored group ``key`` chains (through chain keys), or ``None``. The note stays
        (refreshed), so a group evicted and stored again keeps its parent."""
        up = self._up.get(key)
        if up is not None:
            self._up.move_to_end(key)
        for _ in range(MAX_HOPS):
            if up is None:
                return None
            group = groups.get(up)
            if group is not None:
                return group
            up = self._up.get(up)
        return None

    def __len__(self) -> int:
        return len(self._up)
