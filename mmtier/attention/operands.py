"""``CompiledOperands``: a sequence's device operands, compiled once and reused while nothing moved.

Every layer of a decode step, and every step of a turn, attends the same device segments of a
sequence: only the layer differs, and a layer is an offset in the pool's view, not a table. So
the int32 tables (``table.compile_segments``) are compiled once per sequence and reused by the
other layers and steps, as long as each segment still has

- the same group at the same start position,
- the same page list object (the cache never edits a group's ``pages`` in place: growth, a
  promotion, a demotion or a free each assign a new list, so ``is`` sees every move), and
- the same token count (a tail run grows within its last page without new pages).

The entry holds the page lists it compiled from, so their identities cannot be reused while it
lives. Entries are dropped when the sequence is released and kept for at most ``KEPT``
sequences (least recently used first). Mechanism only: the cache decides what to ask for (under
its lock) and owns the instance.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.segments import Segment
from .kernels.layout import PagedKV

KEPT = 256


@dataclass(eq=False)
class _Entry:
    stamp: list[tuple[object, list[int], int, int]]        # (group, its pages, tokens, start)
    ops: list[PagedKV]
    by_layer: dict[int, list[PagedKV]] = field(default_factory=dict)


def stamp(segments: list[Segment]) -> list[tuple[object, list[int], int, int]]:
    """What compiled operands of ``segments`` depend on: per segment its group, the group's
    page list (by identity), its token count and its start."""
    return [(s.group, s.group.pages, s.group.num_tokens, s.start) for s in segments]


def same(a: list[tuple[object, list[int], int, int]], b: list[tuple[object, list[int], int, int]]) -> bool:
    return len(a) == len(b) and all(
        x[0] is y[0] and x[1] is y[1] and x[2] == y[2] and x[3] == y[3] for x, y in zip(a, b))


class CompiledOperands:
    """Per sequence id, the last compiled device operands and their stamp (not thread-safe:
    used under the cache's lock)."""

    def __init__(self, kept: int = KEPT):
        self._kept = kept
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self.compiles = 0          # how many times tables were compiled (tests, stats)

    def operands(self, seq_id: int, segments: list[Segment], layer: int,
                 compile_fn: Callable[[list[Segment], int], list[PagedKV]]) -> list[PagedKV]:
        """The operands of ``segments`` (all on the device) at ``layer``: reused when the
        sequence's last compiled segments are unchanged, compiled by ``compile_fn`` otherwise."""
        now = stamp(segments)
        entry = self._entries.get(seq_id)
        if entry is None or not same(entry.stamp, now):
            self.compiles += 1
            ops = compile_fn(segments, layer)
            entry = _Entry(now, ops, {layer: ops})
            self._entries[seq_id] = entry
            while len(self._entries) > self._kept:
                self._entries.popitem(last=False)
            return ops
        self._entries.move_to_end(seq_id)
        ops = entry.by_layer.get(layer)
        if ops is None:
            ops = entry.by_layer[layer] = [op.at_layer(layer) for op in entry.ops]
        return ops

    def drop(self, seq_id: int) -> None:
        """Forget the sequence (released)."""
        self._entries.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._entries)
