"""Verified copies: the XXH3-64 of each page taken by the copy that moves it (``digests.c``).

The host tier keeps one xxh3 per page (the disk files keep the same). Taking it in a pass of
its own costs about half the copy again on this kind of CPU (the hash reads at ~15-28 GB/s
from memory, the copy moves ~10-17 GB/s); taken from the registers the copy loads anyway it
costs next to nothing. ``copy_digest`` is that copy: units (pages) of rows between two
layouts (``rows.row_space`` / ``rows.merge_dims``), the digest of each unit's source bytes
in walk order, and with ``expect`` a check that stops at the first page that differs (its
destination overwritten with NaN bytes, nothing after it copied); with ``check``, a test of
every element it moves for NaN / Inf (float16, bfloat16, float32): a put written straight into
host slots takes its digests and its finiteness scan in the pass that moves it.

``None`` where it does not apply: no native helper here, rows not whole 64-byte stripes, a
page of 240 bytes or less (xxh3's short-input paths), not on the CPU; the caller then hashes
with ``xxhash`` and copies with torch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from . import build
from .rows import MAX_DIMS, STREAM_MIN_BYTES

_I64P = ctypes.POINTER(ctypes.c_int64)


_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, _I64P, _I64P, _I64P, ctypes.c_int64,
         ctypes.c_int, ctypes.c_void_p]
_SIGNATURES = {"mmtier_copy_rows_xxh3": [*_ARGS, ctypes.c_void_p, ctypes.c_int],        # expect, threads
               "mmtier_copy_rows_xxh3_checked": [*_ARGS, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                                 ctypes.c_int]}                           # ..., threads


def _fn(name: str = "mmtier_copy_rows_xxh3"):
    lib = build.library("digests")
    if lib is None:
        return None
    fn = getattr(lib, name)
    if fn.argtypes is None:
        fn.restype = ctypes.c_int64
        fn.argtypes = _SIGNATURES[name]
    return fn


def available() -> bool:
    return _fn() is not None


@dataclass(frozen=True)
class Result:
    """``digests[u]``: unit ``u``'s xxh3 (units after ``bad`` not taken); ``bad``: the first unit
    whose digest differed from ``expect`` (its destination poisoned), else ``-1``."""

    digests: list[int]
    bad: int
    nonfinite: bool = False        # with ``check``: a NaN / Inf was among the elements


def _addrs(addrs: torch.Tensor | np.ndarray) -> np.ndarray | torch.Tensor:
    """Unit addresses as a contiguous int64 array (numpy arrays pass as they are: a put's
    addresses are built in numpy, a few microseconds less than torch's ops on 16 numbers)."""
    if isinstance(addrs, np.ndarray):
        return np.ascontiguousarray(addrs, dtype=np.int64)
    return addrs.to(torch.int64).contiguous()


def _ptr(addrs: np.ndarray | torch.Tensor) -> int:
    return addrs.ctypes.data if isinstance(addrs, np.ndarray) else addrs.data_ptr()


def copy_digest(dst_addrs: torch.Tensor | np.ndarray | None, src_addrs: torch.Tensor | np.ndarray,
                space: tuple[list[int], list[int], list[int], int] | None, *,
                expect: list[int] | tuple[int, ...] | None = None, stream: bool | None = None,
                scalar: bool = False, check: int = 0, threads: int = 1) -> Result | None:
    """Copy units (``dst_addrs`` ``None``: only digest them) over ``space`` (``rows.row_space``),
    each unit's xxh3 taken on the way; with ``expect``, stop at the first unit that differs.
    ``check`` (``rows.CHECK_KINDS``: 1 float16, 2 bfloat16, 3 float32; a copy, no ``expect``):
    every element also tested for NaN / Inf (``Result.nonfinite``). ``threads``: a copy without
    ``expect`` split over up to that many threads (runs of units of at least 4 MiB each; the
    same result). ``scalar``: the portable code only (tests). ``None`` where this does not
    apply."""
    if check and (check not in (1, 2, 3) or dst_addrs is None or expect is not None):
        return None
    fn = _fn("mmtier_copy_rows_xxh3_checked" if check else "mmtier_copy_rows_xxh3")
    if fn is None or space is None:
        return None
    shape, dstr, sstr, row = space
    total = row
    for n in shape:
        total *= n
    if row % 64 or total <= 240 or len(shape) > MAX_DIMS:
        return None
    sa = _addrs(src_addrs)
    da = _addrs(dst_addrs) if dst_addrs is not None else None
    n = len(sa)
    if da is not None and len(da) != n:
        raise ValueError(f"{len(da)} destination units, {n} source units")
    if expect is not None and len(expect) != n:
        raise ValueError(f"{len(expect)} expected digests for {n} units")
    if n == 0:
        return Result([], -1)
    if stream is None:
        stream = n * total >= STREAM_MIN_BYTES
    out = np.zeros(n, dtype=np.uint64)
    arr = ctypes.c_int64 * max(1, len(shape))
    flags = (1 if stream else 0) | (2 if scalar else 0)
    args = [_ptr(da) if da is not None else None, _ptr(sa), n, len(shape), arr(*shape), arr(*dstr),
            arr(*sstr), row, flags, out.ctypes.data]
    found = ctypes.c_int(0)
    if check:
        bad = fn(*args, check, ctypes.byref(found), max(1, threads))
    else:
        want = np.asarray(expect, dtype=np.uint64) if expect is not None else None
        bad = fn(*args, want.ctypes.data if want is not None else None, max(1, threads))
    if bad == -2:
        raise ValueError("mmtier_copy_rows_xxh3 refused its arguments")
    return Result(out.tolist(), int(bad), bool(found.value))
