"""Destination pages of a disk read: one tensor or several contiguous runs, addressed by page index.

The reads of the disk tier (``arrow_format.read_file``, ``layer_extent.read_whole`` and
``read_layer_extent``, ``direct_reads.read_whole_direct``) all land their bytes through a
``DestPages``: it checks the destination against the spec once (dtype, page shape, contiguous
CPU memory, the group's page count) and hands out ``[m, page_bytes]`` uint8 views of any span
of pages, across runs (``views``), or a sub-range of a one-run destination as a destination of
its own (``sub``, the batched read's per-group part). Nothing else of the disk tier lives here:
it is the type the format and the lean reads share, below both.

``DestTokens`` is the other destination a whole-group read can have: a group's K and V
token-major (``[L, T, H, D]``, each layer contiguous), what ``read_group`` returns. A layer-major
file holds, per layer, each page's K tokens then its V tokens, so a layer's extent lands in
``K[l]`` and ``V[l]`` in page-sized pieces, in order: the read scatters there directly and the
group is copied once (disk -> window -> K, V), not twice through page-major staging. The last
page's padding past the group's tokens is read (and checked) but lands nowhere.
Both destinations offer the same two calls to the reads: ``layer_slices`` (the writable pieces
of one layer extent, in file order: a buffered ``preadv`` target) and ``layer_writer`` (copies
any byte range of a layer extent into its place: a direct read's window by window).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from ..config import ModalitySpec
from ..errors import CorruptDataError, DTypeError, ShapeError


def layer_slices(views: Sequence[np.ndarray], layer: int, layer_bytes: int) -> list[np.ndarray]:
    """Layer ``layer``'s slice of every page of ``views`` (``[k, page_bytes]`` rows), in page
    order: the destination of one layer extent in whole pages (strided, no copy)."""
    lo = layer * layer_bytes
    return [row[lo:lo + layer_bytes] for v in views for row in v]


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

    def layer_slices(self, first: int, pages: int, layer: int, layer_bytes: int) -> list[np.ndarray]:
        """Layer ``layer``'s slice (``layer_bytes`` a page) of pages ``first..first+pages``, in
        page order: the destination of one layer extent (strided views, no copy)."""
        return layer_slices(self.views(first, pages), layer, layer_bytes)

    def layer_writer(self, first: int, pages: int, layer_bytes: int):
        """``copy(layer, a, src)``: bytes ``a..a+len(src)`` of layer ``layer``'s extent (pages
        ``first..first+pages``, ``layer_bytes`` a page) into their slices of the pages."""
        views = self.views(first, pages)
        starts = [0]
        for v in views[:-1]:
            starts.append(starts[-1] + v.shape[0])
        lb = layer_bytes

        def copy(layer: int, a: int, src: np.ndarray) -> None:
            col = layer * lb
            pos, b = a, a + src.nbytes
            while pos < b:
                r, c = divmod(pos, lb)
                i = bisect.bisect_right(starts, r) - 1
                rows, local = views[i], r - starts[i]
                if c or b - pos < lb:            # part of one page's slice
                    n = min(lb - c, b - pos)
                    rows[local, col + c:col + c + n] = src[pos - a:pos - a + n]
                else:                            # whole slices of consecutive pages of one run
                    k = min((b - pos) // lb, rows.shape[0] - local)
                    n = k * lb
                    rows[local:local + k, col:col + lb] = src[pos - a:pos - a + n].reshape(k, lb)
                pos += n
        return copy


class DestTokens:
    """A group's K and V, token-major ``[L, T, H, D]`` (CPU, ``spec``'s dtype, each layer's
    tokens contiguous: any layer stride), as the destination of a whole-group read of ``n``
    pages: page ``r`` of layer ``l`` is ``K[l]``'s and ``V[l]``'s tokens ``r*P..(r+1)*P``."""

    def __init__(self, spec: ModalitySpec, k: torch.Tensor, v: torch.Tensor, n: int):
        if spec.kind != "kv":
            raise ShapeError(f"{spec.name} holds embeddings, not K and V")
        L, _, P, H, D = spec.page_shape
        for name, t in (("k", k), ("v", v)):
            if not usable_tokens(t, spec):
                raise ShapeError(f"{name} {tuple(t.shape)} {t.dtype} is not [{L}, T, {H}, {D}] "
                                 f"{spec.torch_dtype} on the CPU with each layer contiguous")
        if k.shape != v.shape or not (n - 1) * P < k.shape[1] <= n * P:
            raise ShapeError(f"k {tuple(k.shape)}, v {tuple(v.shape)}: not the tokens of {n} pages of {P}")
        self.layers = L
        self.total = n
        self.page_bytes = spec.page_bytes
        self.half = P * H * D * spec.itemsize            # one page's K (or V) of one layer
        self.token_bytes = k.shape[1] * H * D * spec.itemsize
        self.k = [k[layer].reshape(-1).view(torch.uint8).numpy() for layer in range(L)]
        self.v = [v[layer].reshape(-1).view(torch.uint8).numpy() for layer in range(L)]

    def layer_slices(self, first: int, pages: int, layer: int, layer_bytes: int) -> list[np.ndarray]:
        """The writable pieces of layer ``layer``'s extent (pages ``first..first+pages``) in
        file order: each page's K, then its V; past the group's tokens, scratch buffers of
        their own (a pad is read and checked, then dropped)."""
        self._check_span(first, pages)
        if layer_bytes != 2 * self.half:
            raise CorruptDataError(f"layer slices of {layer_bytes} bytes, not {2 * self.half}")
        out: list[np.ndarray] = []
        for page in range(first, first + pages):
            for side in (self.k[layer], self.v[layer]):
                lo, hi = page * self.half, (page + 1) * self.half
                if hi <= self.token_bytes:
                    out.append(side[lo:hi])
                    continue
                if lo < self.token_bytes:
                    out.append(side[lo:self.token_bytes])
                out.append(np.empty(hi - max(lo, self.token_bytes), np.uint8))
        return out

    def layer_writer(self, first: int, pages: int, layer_bytes: int):
        """``copy(layer, a, src)``: bytes ``a..a+len(src)`` of layer ``layer``'s extent (pages
        ``first..first+pages``) into ``K[layer]`` and ``V[layer]``; pad bytes are dropped."""
        self._check_span(first, pages)
        half, end = self.half, self.token_bytes
        if layer_bytes != 2 * half:
            raise CorruptDataError(f"layer slices of {layer_bytes} bytes, not {2 * half}")
        whole = end // half                          # pages whose tokens are all the group's

        def copy(layer: int, a: int, src: np.ndarray) -> None:
            kd, vd = self.k[layer], self.v[layer]
            pos, b = a, a + src.nbytes
            while pos < b:
                r, c = divmod(pos, 2 * half)
                page = first + r
                m = min((b - pos) // (2 * half), whole - page) if c == 0 else 0
                if m > 0:                            # whole pages: one strided copy a side
                    pairs = src[pos - a:pos - a + 2 * m * half].reshape(m, 2, half)
                    kd[page * half:(page + m) * half].reshape(m, half)[:] = pairs[:, 0]
                    vd[page * half:(page + m) * half].reshape(m, half)[:] = pairs[:, 1]
                    pos += 2 * m * half
                    continue
                side, off = (kd, c) if c < half else (vd, c - half)
                n = min(half - off, b - pos)
                lo = page * half + off
                keep = max(0, min(lo + n, end) - lo)     # past the tokens: the pad, dropped
                if keep:
                    side[lo:lo + keep] = src[pos - a:pos - a + keep]
                pos += n
        return copy

    def put_pages(self, pages: torch.Tensor) -> None:
        """Whole page-major pages ``[n, L, 2, P, H, D]`` (a read that could not land here
        directly) into K and V."""
        rows = pages.reshape(pages.shape[0], -1).view(torch.uint8).numpy()
        lb = 2 * self.half
        write = self.layer_writer(0, self.total, lb)
        for layer in range(self.layers):
            write(layer, 0, np.ascontiguousarray(rows[:, layer * lb:(layer + 1) * lb]).reshape(-1))

    def _check_span(self, first: int, pages: int) -> None:
        if first < 0 or first + pages > self.total:
            raise CorruptDataError(f"pages {first}..{first + pages} outside the group's {self.total}")


def usable_tokens(t: object, spec: ModalitySpec) -> bool:
    """Whether ``t`` can be a ``DestTokens`` side for ``spec``: a CPU tensor ``[L, T, H, D]`` of
    its dtype whose layers are each contiguous."""
    if not isinstance(t, torch.Tensor) or t.is_cuda or t.dim() != 4 or t.dtype != spec.torch_dtype:
        return False
    L, _, _, H, D = spec.page_shape
    if t.shape[0] != L or t.shape[2] != H or t.shape[3] != D or t.shape[1] == 0:
        return False
    return t.stride(3) == 1 and t.stride(2) == D and t.stride(1) == H * D
