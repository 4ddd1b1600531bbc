"""Sequence tables (the seed's ``MultimodalBlockTable``): ordered segments of modality groups.

A segment places a group at an absolute start position of a sequence. Views: by modality
(``text_blocks``, ``vision_blocks``, ``audio_blocks``, ``video_blocks``: a video's segments,
``blocks(modality)``) and by content key
(``by_key``); ``compile`` turns the chosen segments into the int32 CSR operands of the kernels,
one per (pool view, tier) that holds some of them.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..config import ModalitySpec
from ..content import ContentKey
from ..kernels.layout import HostTables, PagedKV, paged_kv_from_host
from ..kernels.scales import spec_scales
from .groups import ModalityGroup


@dataclass(frozen=True)
class Segment:
    group: ModalityGroup
    start: int
    before: bytes = b"\0" * 32        # the sequence's prefix chain where the segment starts (EMPTY_CHAIN)

    @property
    def num_tokens(self) -> int:
        return self.group.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.group.num_tokens


EMPTY_CHAIN = b"\0" * 32


def naming(key: ContentKey, before: bytes) -> bytes | None:
    """The digest that names a sequence's content once ``key`` is placed where its chain is
    ``before`` (a valid parent of what comes next): a prefix-dependent key names all before it
    and itself; a content-only key names only itself, so only at a sequence's start."""
    if key.sharing == "prefix" or before == EMPTY_CHAIN:
        return key.digest
    return None


@dataclass(frozen=True)
class SequenceHandle:
    """What ``create_sequence`` returns: the sequence id and its (server-side) tenant."""

    id: int
    tenant: str


@dataclass
class SequenceTable:
    handle: SequenceHandle
    segments: list[Segment] = field(default_factory=list)
    chain: bytes = b"\0" * 32        # running digest of everything the sequence holds
    open_runs: list = field(default_factory=list)   # its reservations (layer_writes.Reservation)
                                     # not yet fully written: releasing the sequence ends them
    ends: list[bytes] = field(default_factory=list)  # the chain where each segment's own tokens end
    named: dict[bytes, bytes] = field(default_factory=dict)  # chain -> digest of the prefix-
                                     # dependent key that names the same content (attached or
                                     # sealed there): a valid parent of what comes next

    @property
    def length(self) -> int:
        return self.segments[-1].end if self.segments else 0

    def add(self, group: ModalityGroup, identity: bytes, names: bytes | None = None) -> Segment:
        """A new segment; ``names``: the digest of the prefix-dependent key it was attached as."""
        seg = Segment(group, self.length, self.chain)
        self.segments.append(seg)
        self.extend_chain(identity, names)
        self.ends.append(self.chain)
        return seg

    def grow(self, identity: bytes) -> None:
        """More tokens in the tail segment's run."""
        self.extend_chain(identity)
        self.ends[-1] = self.chain

    def extend_chain(self, identity: bytes, names: bytes | None = None) -> None:
        """The chain past more content (a segment's, or a group attended elsewhere: no segment
        here); ``names``: the prefix-dependent key that content was attached as."""
        self.chain = hashlib.sha256(self.chain + identity).digest()
        if names is not None:
            self.named[self.chain] = names

    def name_segment(self, index: int, names: bytes) -> None:
        """Segment ``index`` was sealed as the prefix-dependent key ``names``."""
        self.named[self.ends[index]] = names

    @property
    def tail(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    # ---- views ----
    def blocks(self, modality: str) -> list[Segment]:
        return [s for s in self.segments if s.group.modality == modality]

    @property
    def text_blocks(self) -> list[Segment]:
        return self.blocks("text")

    @property
    def vision_blocks(self) -> list[Segment]:
        return self.blocks("vision")

    @property
    def audio_blocks(self) -> list[Segment]:
        return self.blocks("audio")

    @property
    def video_blocks(self) -> list[Segment]:
        return self.blocks("video")

    @property
    def by_key(self) -> dict[ContentKey, list[Segment]]:
        out: dict[ContentKey, list[Segment]] = {}
        for s in self.segments:
            if s.group.key is not None:
                out.setdefault(s.group.key, []).append(s)
        return out

    def groups(self) -> list[ModalityGroup]:
        return [s.group for s in self.segments]


def compile_segments(
    segments: Iterable[Segment],
    layer: int,
    view_of: Callable[[ModalityGroup], tuple[object, torch.Tensor, list[int]]],
    scale_offset: int = 0,
) -> list[PagedKV]:
    """One ``PagedKV`` (batch of one) per distinct page store of the chosen segments.

    ``view_of(group)`` names where the group's pages are: ``(store_id, page-major view,
    page ids in that view)``; segments in the same store share one operand (one launch).
    The tables are built from the host's lists, kept on the host (``PagedKV.host``: planning
    reads them, never the device) and copied to the view's device without a sync. An fp8
    store's operand carries its spec's scales (``kernels.scales``); ``scale_offset``: the model
    layer of the views' layer 0 (views that hold one layer of each page).
    """
    return compile_batch([segments], layer, view_of, scale_offset)


def compile_batch(
    batch: Sequence[Iterable[Segment]],
    layer: int,
    view_of: Callable[[ModalityGroup], tuple[object, torch.Tensor, list[int]]],
    scale_offset: int = 0,
) -> list[PagedKV]:
    """``compile_segments`` for a batch of sequences: one ``PagedKV`` per page store, whose
    ``seg_indptr`` gives batch item ``b`` the segments of ``batch[b]`` in that store (none
    where it has none), so one launch per store serves every sequence."""
    by_store: dict[object, tuple[torch.Tensor, list[list[list[int]]], list[list[int]], list[list[int]]]] = {}
    spec_of: dict[object, ModalitySpec] = {}
    size = len(batch)
    for b, segments in enumerate(batch):
        for seg in segments:
            store, view, pages = view_of(seg.group)
            entry = by_store.setdefault(store, (view, [[] for _ in range(size)],
                                                [[] for _ in range(size)], [[] for _ in range(size)]))
            spec_of.setdefault(store, seg.group.spec)
            entry[1][b].append(pages)
            entry[2][b].append(seg.start)
            entry[3][b].append(seg.num_tokens)
    operands = []
    for store, (view, page_lists, starts, lens) in by_store.items():
        seg_indptr, indptr, flat, all_starts, all_lens = [0], [0], [], [], []
        for b in range(size):
            for pages in page_lists[b]:
                flat.extend(pages)
                indptr.append(len(flat))
            all_starts.extend(starts[b])
            all_lens.extend(lens[b])
            seg_indptr.append(len(all_starts))
        op = _paged_kv(view, layer, seg_indptr, indptr, all_starts, all_lens, flat)
        scales = spec_scales(spec_of[store], view.device)
        if scales is not None:
            op = replace(op, scales=scales.shifted(scale_offset) if scale_offset else scales)
        operands.append(op)
    return operands



_INDEX_MEMO: OrderedDict[tuple, tuple[list[torch.Tensor], HostTables]] = OrderedDict()
_INDEX_LOCK = threading.Lock()
_INDEX_KEPT = 64


def _paged_kv(view: torch.Tensor, layer: int, *tables: list[int]) -> PagedKV:
    """``paged_kv_from_host`` with its tables shared: the layers of a decode step ask for the
    same tables, so they are made (and uploaded) once and reused, read-only (a small LRU keyed
    by the lists and the device; it holds tables only, never a view)."""
    key = (str(view.device), *map(tuple, tables))
    with _INDEX_LOCK:
        hit = _INDEX_MEMO.get(key)
        if hit is not None:
            _INDEX_MEMO.move_to_end(key)
            return PagedKV(view, layer, *hit[0], host=hit[1])
    op = paged_kv_from_host(view, layer, *tables)
    with _INDEX_LOCK:
        _INDEX_MEMO[key] = ([op.seg_indptr, op.seg_page_indptr, op.seg_start, op.seg_len, op.page_ids], op.host)
        while len(_INDEX_MEMO) > _INDEX_KEPT:
            _INDEX_MEMO.popitem(last=False)
    return op
