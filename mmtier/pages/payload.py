"""Payloads going into pages: validation (shape, dtype, NaN/Inf), writes, and content identity."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from ..config import ModalitySpec
from ..errors import DTypeError, ShapeError
from ..native import rows as native_rows
from .beside import beside, settle
from .copies import EngineBlocks, kv_into_pages
from .kernels import INDEX_DTYPE, write_kv
from .pool import PagePool


def check_kv(spec: ModalitySpec, k, v, *, block_split: bool = False, finite: bool = True) -> int:
    """K and V must both be ``[num_layers, n > 0, num_kv_heads, head_dim]`` of the spec's dtype,
    finite. Returns ``n``. ``block_split``: ``[num_layers, blocks > 0, page_size, num_kv_heads,
    head_dim]`` is taken too (``n = blocks * page_size``): an engine's blocks staged as it lays
    them, whose token axis is no single stride (``pages.copies``). ``finite=False``: shapes and
    dtypes only; the caller scans for NaN / Inf itself (``FiniteCheck``, beside its copy)."""
    if block_split and isinstance(k, EngineBlocks):
        if v is not k:
            raise ShapeError("EngineBlocks are passed as both k and v")
        k.check((spec.num_layers, k.num_tokens, spec.num_kv_heads, spec.head_dim), spec.torch_dtype)
        if k.block_shape[0] != spec.page_size:
            raise ShapeError(f"{spec.name}: blocks of {k.block_shape[0]} tokens, pages of {spec.page_size}")
        if finite and not blocks_finite(k):
            raise DTypeError(f"{spec.name}: NaN or Inf in the payload")
        return k.num_tokens
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a tensor, got {type(t).__name__}")
    if block_split and k.dim() == 5:
        want5 = (spec.num_layers, spec.page_size, spec.num_kv_heads, spec.head_dim)
        if (k.shape[0], *k.shape[2:]) != want5 or k.shape != v.shape or k.shape[1] == 0:
            raise ShapeError(f"{spec.name}: block-split k and v must be [{spec.num_layers}, blocks > 0, "
                             f"{spec.page_size}, {spec.num_kv_heads}, {spec.head_dim}] alike, got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        for t in (k, v):
            if t.dtype != spec.torch_dtype:
                raise DTypeError(f"{spec.name}: expected {spec.dtype}, got {t.dtype}")
        if finite and not kv_finite(k, v):
            raise DTypeError(f"{spec.name}: NaN or Inf in the payload")
        return k.shape[1] * k.shape[2]
    want = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    if k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != want or k.shape != v.shape:
        raise ShapeError(f"{spec.name}: k and v must be [{spec.num_layers}, n, {spec.num_kv_heads}, "
                         f"{spec.head_dim}] alike, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[1] == 0:
        raise ShapeError(f"{spec.name}: no tokens to store")
    for t in (k, v):
        if t.dtype != spec.torch_dtype:
            raise DTypeError(f"{spec.name}: expected {spec.dtype}, got {t.dtype}")
    if finite and not kv_finite(k, v):
        raise DTypeError(f"{spec.name}: NaN or Inf in the payload")
    return k.shape[1]


def kv_finite(k, v) -> bool:
    """Whether every element of a put's K and V is finite, exactly: an engine's blocks by
    ``blocks_finite``; tensors that are together exactly one storage's elements (an engine's
    stage, K and V interleaved) in one dense pass over that storage (strided reductions run
    several times slower), the exact per-tensor check deciding only when that pass finds a
    non-finite value; otherwise each tensor on its own."""
    if isinstance(k, EngineBlocks):
        return blocks_finite(k)
    flat = dense_storage((k, v))
    if flat is not None and all_finite(flat):
        return True
    return all(t.numel() == 0 or all_finite(t) for t in (k, v))


class FiniteCheck:
    """A put's NaN / Inf scan. On the CPU into CPU pages where the native row copy applies
    (``fuse``), the copy into pages tests every element it moves (``tally``, handed to
    ``write_fresh_pages``): no pass of its own; should a copy not test (another dtype, a torch
    fallback) or none run (a key already held), ``kv_finite`` decides in line at ``wait()``.
    Otherwise on the CPU ``kv_finite`` runs beside the copy (``pages.beside``), and on a GPU in
    line (its reductions are asynchronous anyway). ``wait()`` raises ``DTypeError`` for a
    payload that is not finite; the caller waits before the group becomes visible, and
    ``settle()`` on every way out, so no scan outlives the call."""

    def __init__(self, spec: ModalitySpec, k, v, *, fuse: bool = False):
        self.name = spec.name
        self._kv = (k, v)
        device = k.device if isinstance(k, (torch.Tensor, EngineBlocks)) else None
        self._future: Future[bool] | None = None
        self._ok: bool | None = None
        self.tally: native_rows.Tally | None = None
        if device is not None and device.type == "cpu":
            if fuse and _fusable(k, v):
                self.tally = native_rows.Tally()
            else:
                self._future = beside(kv_finite, k, v)
        else:
            self._ok = kv_finite(k, v)

    def wait(self) -> None:
        if self._ok is None:
            if self._future is not None:
                self._ok = self._future.result()
            elif self.tally is not None and self.tally.complete:
                self._ok = not self.tally.nonfinite
            else:
                self._ok = kv_finite(*self._kv)
        if not self._ok:
            raise DTypeError(f"{self.name}: NaN or Inf in the payload")

    def settle(self) -> None:
        settle(self._future)


def _fusable(k, v) -> bool:
    """Whether the native row copy can test this payload as it copies it into CPU pages."""
    if k.dtype not in native_rows.CHECK_KINDS or not native_rows.available():
        return False
    if isinstance(k, EngineBlocks):
        return True
    return isinstance(v, torch.Tensor) and v.dtype == k.dtype and all(
        t.shape[-1] == 1 or t.stride(-1) == 1 for t in (k, v))


def dense_storage(ts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A flat view of the storage the tensors share, when their element counts add up to it
    exactly (so every element it holds is one of theirs unless they overlap: a finite storage
    means finite tensors; the converse is only checked per tensor). ``None`` otherwise."""
    if not ts or any(t.is_contiguous() for t in ts):
        return None                    # contiguous tensors are dense already
    first = ts[0]
    st = first.untyped_storage()
    if any(t.untyped_storage().data_ptr() != st.data_ptr() or t.dtype != first.dtype for t in ts):
        return None
    n, rem = divmod(st.nbytes(), first.element_size())
    if rem or n != sum(t.numel() for t in ts):
        return None
    return torch.as_strided(first, (n,), (1,), 0)


def blocks_finite(blocks: EngineBlocks) -> bool:
    """Whether every element of the engine's blocks is finite, exactly. Per layer (and side) one
    pass that sums the chosen blocks' rows element-wise (``embedding_bag``: the blocks are read
    once, in place, no gather): a NaN or Inf in any block makes its column's sum non-finite, so
    finite sums mean finite blocks; otherwise, or where a block is no dense row, each run of
    blocks is checked on its own (``all_finite``), which decides."""
    rows = blocks.block_rows()
    if rows is not None and rows[0].dtype not in _FP8_NONFINITE:     # fp8: no embedding_bag; by bits below
        ids = blocks.id_tensor()[None]
        if all(bool(torch.isfinite(torch.nn.functional.embedding_bag(ids, r, mode="sum").sum()))
               for r in rows):
            return True
    for t in blocks.tensors():           # each run of blocks: dense in the engine's memory order
        flat = dense_view(t)
        if not all_finite(flat if flat is not None else t):
            return False
    return True


def dense_view(t: torch.Tensor) -> torch.Tensor | None:
    """A flat view of exactly ``t``'s elements when they fill one dense stretch of memory (in
    whatever order); ``None`` otherwise."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    if not t.permute(*order).is_contiguous():
        return None
    return torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())


def check_payload(spec: ModalitySpec, t: torch.Tensor) -> None:
    if t.dtype != spec.torch_dtype:
        raise DTypeError(f"{spec.name}: expected {spec.dtype}, got {t.dtype}")
    if t.numel() and not all_finite(t):
        raise DTypeError(f"{spec.name}: NaN or Inf in the payload")


_FP8_NONFINITE = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of a floating tensor is finite, exactly, in one pass of its own
    dtype at memory speed. A finite sum means no NaN and no Inf (either would make the sum NaN
    or infinite); a sum that is not finite may also be finite values that overflowed the sum's
    dtype, so then ``aminmax`` decides: NaN propagates into min and max, an Inf is one of them,
    so both finite <=> every element finite. (The sum reads at about twice aminmax's speed on a
    CPU; no float64 upcast; one host sync.) fp8 (which torch does not sum) by its bits: the
    exponent and mantissa bits that are NaN (e4m3fn: all seven; it has no Inf) or NaN / Inf
    (e5m2: the five exponent bits)."""
    mask = _FP8_NONFINITE.get(t.dtype)
    if mask is not None:
        return not bool((t.view(torch.uint8) & mask).eq_(mask).any())
    if bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(t))).all())


def write_fresh_pages(pool: PagePool, k, v, pages: list[int], backend: str,
                      tally: native_rows.Tally | None = None) -> None:
    """Fill new pages from token 0, run by run of consecutive pages (``kv_into_pages``: one
    strided copy per run for K and for V, the partial last page sliced; no index tensor);
    ``tally``: the copies test for NaN / Inf as they go (``FiniteCheck``)."""
    del backend                                   # slices need no kernel
    kv_into_pages(pool.view, pages, k, v, tally)


def write_embedding(pool: PagePool, x: torch.Tensor, pages: list[int]) -> None:
    """Token ``i`` of ``x [n, width]`` goes to page ``pages[i // page_size]``."""
    size = pool.spec.page_size
    slots = torch.arange(x.shape[0], device=pool.device)
    page_ids = torch.tensor(pages, dtype=torch.int64, device=pool.device)[slots // size]
    pool.view[page_ids, slots % size] = x.to(pool.device)


def slot_mapping(pages: list[int], first: int, n: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page ids and in-page offsets (int32, on the host) of token slots ``first .. first + n``
    of a run laid over ``pages``."""
    slots = torch.arange(first, first + n, dtype=INDEX_DTYPE)
    return torch.tensor(pages, dtype=INDEX_DTYPE)[slots // page_size], slots % page_size


def write_slots(pool: PagePool, k, v, page_ids: torch.Tensor, offsets: torch.Tensor, backend: str) -> None:
    """Token ``i`` goes to page ``page_ids[i]``, slot ``offsets[i]`` (all layers); the int32
    indices stay on the host (the write uploads them without a device sync)."""
    dev = pool.device
    write_kv(pool.view, k.to(dev), v.to(dev), page_ids, offsets, backend=backend)


def token_identity(modality: str, k: torch.Tensor, v: torch.Tensor, tokens: Sequence[int] | None) -> bytes:
    """What appended tokens contribute to a sequence's prefix chain: their ids when given, else
    the bytes of their K/V."""
    h = hashlib.sha256(modality.encode() + b"\0")
    if tokens is not None:
        h.update(b"tokens:" + ",".join(str(int(t)) for t in tokens).encode())
    else:
        h.update(b"kv:")
        for t in (k, v):
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.digest()
