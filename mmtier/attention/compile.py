"""The kernels' operands compiled from sequence tables: the chosen segments of one sequence
(``compile_segments``) or of a batch (``compile_batch``) as int32 CSR ``PagedKV`` operands, one
per (pool view, tier) that holds some of them, their tables shared across the layers of a step.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import torch

from ..config import ModalitySpec
from ..core.groups import ModalityGroup
from ..core.segments import Segment
from .kernels.layout import HostTables, PagedKV, paged_kv_from_host
from .kernels.scales import spec_scales


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
