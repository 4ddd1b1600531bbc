"""Destination pages of a disk read: one tensor or several contiguous runs, addressed by page index.

The reads of the disk tier (``arrow_format.read_file``, ``layer_extent.read_whole`` and
``read_layer_extent``, ``direct_reads.read_whole_direct``) all land their bytes through a
``DestPages``: it checks the destination against the spec once (dtype, page shape, contiguous
CPU memory, the group's page count) and hands out ``[m, page_bytes]`` uint8 views of any span
of pages, across runs (``views``), or a sub-range of a one-run destination as a destination of
its own (``sub``, the batched read's per-group part). Nothing else of the disk tier lives here:
it is the type the format and the lean reads share, below both.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from ..config import ModalitySpec
from ..errors import CorruptDataError, DTypeError, ShapeError


class DestPages:
    """Destination pages: one tensor or several contiguous runs, addressed by page index.
    ``one_layer``: each destination page holds one layer of a page (``spec.layer_shape``)."""

    def __init__(self, spec: ModalitySpec, out: torch.Tensor | Sequence[torch.Tensor], n: int, *,
                 one_layer: bool = False):
        runs = [out] if isinstance(out, torch.Tensor) else list(out)
        shape = tuple(spec.layer_shape if one_layer else spec.page_shape)
        dtype, page_bytes = spec.torch_dtype, spec.layer_bytes if one_layer else spec.page_bytes
        self.arrays: list[np.ndarray] = []
        self.starts: list[int] = []
        at = 0
        for t in runs:
            if t.dtype != dtype or tuple(t.shape[1:]) != shape:
                raise ShapeError(f"destination {tuple(t.shape)} {t.dtype} does not fit {spec.name}")
            if t.is_cuda or not t.is_contiguous():
                raise DTypeError("destination runs must be contiguous CPU tensors")
            self.starts.append(at)
            self.arrays.append(t.reshape(-1).view(torch.uint8).numpy().reshape(t.shape[0], page_bytes))
            at += t.shape[0]
        if at != n:
            raise ShapeError(f"destination holds {at} pages, the group has {n}")
        self.total = at
        self.page_bytes = page_bytes

    def sub(self, first: int, n: int) -> DestPages:
        """Pages ``first..first+n`` as a destination of their own (one-run destinations only)."""
        if len(self.arrays) != 1 or first < 0 or first + n > self.total:
            raise ShapeError(f"pages {first}..{first + n} of a {len(self.arrays)}-run destination")
        part = object.__new__(DestPages)
        part.page_bytes = self.page_bytes
        part.arrays, part.starts, part.total = [self.arrays[0][first:first + n]], [0], n
        return part

    def views(self, first: int, k: int) -> list[np.ndarray]:
        """Pages ``first..first+k`` as ``[m, page_bytes]`` uint8 arrays (one per run touched)."""
        if first < 0 or first + k > self.total:
            raise CorruptDataError(f"pages {first}..{first + k} outside the group's {self.total}")
        if len(self.arrays) == 1:
            return [self.arrays[0][first:first + k]]
        out, i = [], 0
        while i < k:
            r = bisect.bisect_right(self.starts, first + i) - 1
            local = first + i - self.starts[r]
            m = min(self.arrays[r].shape[0] - local, k - i)
            out.append(self.arrays[r][local:local + m])
            i += m
        return out
