"""The per-page checksums a transfer carries: an export's meta holds ``"xxh3"``, the xxh3 of
each page of its buffer (the digests disk files and host slabs keep), and the importer checks the
pages it took against them. A mismatch is a miss (``CorruptDataError``, counted by the caller),
never wrong KV."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import CorruptDataError, ShapeError
from ..storage.arrow_format import page_sums


def with_sums(meta: dict, flat: np.ndarray, page_bytes: int, sums: Sequence[int] | None = None) -> tuple[dict, np.ndarray]:
    """``(meta + {"xxh3": [...]}, flat)``; ``sums`` when the caller has them already (a host
    entry's verified digests), else computed from ``flat`` (uint8, whole pages)."""
    if sums is None:
        sums = page_sums([flat.reshape(-1, page_bytes)]).tolist()
    return {**meta, "xxh3": [int(s) for s in sums]}, flat


def expected_sums(meta: dict, n_pages: int, what: str) -> list[int]:
    """The export's digests, one per page, or ``ShapeError`` (a meta without them is refused)."""
    sums = meta.get("xxh3")
    if not isinstance(sums, list) or len(sums) != n_pages:
        raise ShapeError(f"{what}: an export's meta carries one xxh3 per page ({n_pages}), "
                         f"got {type(sums).__name__} of {len(sums) if isinstance(sums, list) else 0}")
    return [int(s) for s in sums]


def check_pages(rows: np.ndarray, want: Sequence[int], what: str) -> None:
    """``rows`` (``[k, page_bytes]`` uint8, the pages as they landed) against ``want``."""
    if page_sums([rows]).tolist() != list(want):
        raise CorruptDataError(f"{what}: a transferred page differs from its checksum (a miss)")
