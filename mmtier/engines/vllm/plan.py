"""How a vLLM request's prompt maps to mmtier groups (no vLLM import: plain data in, plan out).

The prompt is cut into segments in position order: each media item's placeholder positions
(from ``mm_features``) are one group keyed by the digest mmtier computed over the item's
processed inputs (never vLLM's identifier alone: a client may choose it through
``multi_modal_uuids``); an item whose inputs the scheduler does not have ends the plan (what
follows it is neither looked up nor stored). The text between
items is cut every ``chunk_blocks`` blocks (absolute positions) and at the end of the prompt's
full blocks, each piece keyed by its token ids. Larger chunks mean fewer, larger groups (the
per-group cost of a store is paid less often); a prefix then hits up to its last whole chunk
or media item (LMCache's chunking trade-off). ``chunk_blocks=1`` hits block by block.
Every key chains its predecessor (``parent=``), so a segment is reused only under the same
prefix, and every key carries the tenant (vLLM's ``cache_salt``), so tenants never share.

Only segments that end within the prompt's full blocks are stored or looked up; a hit is the
longest run of stored segments from the start, rounded down to a block and kept below the
prompt's length (vLLM computes at least the last prompt token itself).

A conversation's next turn repeats the last prompt and goes on: where the last prompt's full
blocks ended inside a chunk, it stored that chunk's part up to there, which the new prompt's
whole chunk does not match. ``fork_keys`` gives the keys of that chunk's parts up to each block
boundary inside it (longest first, chained to the same parent); where one is held, the prompt
is planned again with a cut there (``cuts``), so the hit reaches the last prompt's full blocks
(vLLM's own prefix cache hits block by block) while chunks stay large; the new prompt's groups
after the cut chain from that part, and the turn after finds them the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ...cache import TieredKVCache
from ...content import ContentKey
from ...errors import ShapeError

# vLLM's modality names -> the mmtier modality whose pool holds that item's decoder KV.
DEFAULT_MODALITIES = {"image": "vision", "video": "vision", "audio": "audio"}


@dataclass(frozen=True)
class MediaItem:
    """One media item of a prompt: its placeholder positions, vLLM's identifier, and the
    SHA-256 mmtier computed over its processed inputs (``None``: not at hand, not cacheable)."""

    offset: int
    length: int
    identifier: str
    modality: str
    digest: bytes | None = None


@dataclass(frozen=True)
class Segment:
    """Positions ``[start, end)`` of a prompt, stored as one group under ``key``."""

    start: int
    end: int
    key: ContentKey
    text: bool = True                  # text (cut in chunks), else a media item's positions


@dataclass(frozen=True)
class RequestPlan:
    prompt_len: int
    segments: tuple[Segment, ...]      # cacheable segments only (within the full blocks)

    def hit_tokens(self, held: Sequence[bool], block_size: int) -> int:
        """Tokens covered by the leading held segments, in whole blocks, below the prompt end."""
        end = 0
        for seg, ok in zip(self.segments, held, strict=True):
            if not ok:
                break
            end = seg.end
        end = min(end, self.prompt_len - 1)
        return end // block_size * block_size


# forks a lookup follows (``_fork``): one per earlier turn of a conversation that ended inside a
# chunk, so a conversation's n-th turn takes up to n - 1; past this many the hit stops there
MAX_FORKS = 64


def plan_request(cache: TieredKVCache, token_ids: Sequence[int], media: Sequence[MediaItem], *,
                 block_size: int, tenant: str | None, chunk_blocks: int = 1,
                 text_modality: str = "text", modality_map: dict[str, str] | None = None,
                 cuts: Sequence[int] = ()) -> RequestPlan:
    """The chained segments of a prompt (see the module's docstring); text is also cut at each
    position of ``cuts`` (block boundaries where an earlier prompt's part of a chunk ended)."""
    if chunk_blocks < 1:
        raise ShapeError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    if any(c % block_size for c in cuts):
        raise ShapeError(f"cuts must be block boundaries (blocks of {block_size}), got {sorted(cuts)}")
    n = len(token_ids)
    full = n // block_size * block_size
    chunk = chunk_blocks * block_size
    forced = sorted(set(cuts))
    modality_of = _modality_resolver(cache, text_modality, modality_map)
    tokens = np.asarray(token_ids, dtype=np.int64)
    pieces: list[tuple[int, int, str, bytes]] = []      # (start, end, modality, bytes to hash)
    pos = 0
    for item in sorted(media, key=lambda m: m.offset):
        if item.offset < pos or item.length <= 0 or item.offset + item.length > n:
            raise ShapeError(f"media item at {item.offset}+{item.length} overlaps another item "
                             f"or leaves the prompt of {n} tokens")
        pieces += _text_cuts(tokens, pos, item.offset, chunk, full, text_modality, forced)
        if item.digest is None:                  # content unknown here: nothing from it on
            break
        pieces.append((item.offset, item.offset + item.length, modality_of(item.modality),
                       b"vllm-mm\x00" + item.digest))
        pos = item.offset + item.length
    else:
        pieces += _text_cuts(tokens, pos, n, chunk, full, text_modality, forced)
    segments, parent = [], None
    for start, end, modality, data in pieces:
        if end > full:
            break
        parent = cache.content_key(modality, data, tenant=tenant, parent=parent,
                                   params={"positions": end - start})
        segments.append(Segment(start, end, parent, data.startswith(TEXT)))
    return RequestPlan(n, tuple(segments))


TEXT = b"vllm-text\x00"


def _text_cuts(tokens: np.ndarray, lo: int, hi: int, chunk: int, full: int, modality: str,
               forced: Sequence[int] = ()):
    out = []
    while lo < hi:
        end = min(hi, (lo // chunk + 1) * chunk)
        if lo < full < end:                      # the full blocks end inside this chunk
            end = full
        end = next((c for c in forced if lo < c < end), end)
        out.append((lo, end, modality, TEXT + tokens[lo:end].tobytes()))
        lo = end
    return out


def fork_keys(cache: TieredKVCache, plan: RequestPlan, index: int, token_ids: Sequence[int], *,
              block_size: int, tenant: str | None, text_modality: str = "text") -> list[tuple[int, ContentKey]]:
    """``(end, key)`` of the parts of text segment ``index`` that end on a block boundary inside
    it, longest first: the keys an earlier prompt whose full blocks ended there stored that part
    under (the same parent, the same tokens). None for a media item or a one-block segment."""
    if index >= len(plan.segments) or not plan.segments[index].text:
        return []
    seg = plan.segments[index]
    parent = plan.segments[index - 1].key if index else None
    tokens = np.asarray(token_ids[seg.start:seg.end], dtype=np.int64)
    first, last = seg.start // block_size * block_size + block_size, (seg.end - 1) // block_size * block_size
    return [(end, cache.content_key(text_modality, TEXT + tokens[:end - seg.start].tobytes(), tenant=tenant,
                                    parent=parent, params={"positions": end - seg.start}))
            for end in range(last, first - 1, -block_size)]


def _modality_resolver(cache: TieredKVCache, text: str, mapping: dict[str, str] | None
                       ) -> Callable[[str], str]:
    table = dict(DEFAULT_MODALITIES, **(mapping or {}))
    kv = {name for name, spec in cache.cfg.modalities.items() if spec.kind == "kv"}

    def resolve(vllm_modality: str) -> str:
        name = table.get(vllm_modality, vllm_modality)
        return name if name in kv else text
    return resolve


def slots_for(block_ids: Sequence[int], start: int, end: int, block_size: int) -> np.ndarray:
    """vLLM slot ids (``block * block_size + offset``) of positions ``[start, end)``."""
    pos = np.arange(start, end, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)
    if end > len(blocks) * block_size:
        raise ShapeError(f"positions up to {end} need {-(-end // block_size)} blocks, "
                         f"the request holds {len(blocks)}")
    return blocks[pos // block_size] * block_size + pos % block_size
