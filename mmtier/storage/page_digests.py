"""Per-page xxh3 digests of host pages, taken in the same pass as the copy that moves them.

A host entry keeps one xxh3 per page (the disk files keep the same). Hashing a page after it
was copied costs a second pass over memory; hashing each chunk of it right after the chunk
landed, while it sits in the CPU's cache, costs little beyond the copy.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

_CHUNK = 256 << 10      # copied, then hashed while it sits in the CPU's cache


def copy_and_digest(dst: np.ndarray, src: np.ndarray) -> list[int]:
    """Copy ``src`` rows (pages, uint8) into ``dst`` chunk by chunk (libc's memcpy) and return
    each destination page's xxh3, each chunk hashed right after it landed: one pass over
    memory for the copy and the digest together, instead of two."""
    out = []
    for dst_row, src_row in zip(dst, src):
        h = xxhash.xxh3_64()
        for at in range(0, dst_row.shape[0], _CHUNK):
            part = dst_row[at:at + _CHUNK]
            np.copyto(part, src_row[at:at + _CHUNK])
            h.update(part)
        out.append(h.intdigest())
    return out


def page_rows_of(run: torch.Tensor) -> np.ndarray:
    """A run of pages as ``[pages, page_bytes]`` uint8 rows (a view of the slab)."""
    return run.reshape(run.shape[0], -1).view(torch.uint8).numpy()
