"""``PageIO``: a ``TieredKVCache``'s groups as raw pages and back, for moving a group between
caches as plain bytes (``TieredKVCache.export_pages`` / ``import_pages``).

A ``GroupPages`` is one page-major ``uint8`` buffer in the cache's own page layout, the token
count that rebuilds the group from it, and the xxh3 of each page: the importer checks the pages
as they landed against them, so a transfer is a verified read like a disk or host one (a
mismatch is a miss: ``CorruptDataError``, counted, nothing kept). ``to_wire`` / ``from_wire``
are its form between processes (``({"num_tokens", "xxh3"}, buffer)``). The group index, pools,
residency are given to this part (the lock is residency's); it holds no state of its own.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..content import ContentKey
from ..core.groups import Tier
from ..errors import CorruptDataError, ShapeError, UnknownKeyError
from ..eviction import EvictionPolicy
from ..pages.pool import PagePool
from ..stats import Counters
from ..storage.arrow_format import page_sums
from ..tiers.residency import Residency
from .group_index import GroupIndex
from .keys import CacheKeys
from .shared_groups import SharedGroups
from .transfer_sums import check_pages


@dataclass(frozen=True)
class GroupPages:
    """A group's pages as one page-major buffer: ``data`` (``uint8 [n_pages * page_bytes]``),
    the ``num_tokens`` they hold and the xxh3 of each page (``sums``)."""

    num_tokens: int
    data: np.ndarray
    sums: tuple[int, ...]

    def to_wire(self) -> tuple[dict, np.ndarray]:
        """``({"num_tokens", "xxh3"}, data)``: what travels between processes."""
        return {"num_tokens": self.num_tokens, "xxh3": list(self.sums)}, self.data

    @classmethod
    def from_wire(cls, meta: dict, buf: np.ndarray) -> GroupPages:
        """The pages of a ``to_wire`` pair; ``ShapeError`` when the meta carries no checksums."""
        sums = meta.get("xxh3")
        if not isinstance(sums, list):
            raise ShapeError(f"an export's meta carries one xxh3 per page, got {type(sums).__name__}")
        return cls(int(meta["num_tokens"]), buf, tuple(int(s) for s in sums))


def _with_sums(num_tokens: int, pages: torch.Tensor, page_bytes: int,
               sums: Sequence[int] | None = None) -> GroupPages:
    """``pages`` (whole pages, any shape) as a ``GroupPages``; ``sums`` when known already (a
    host entry's verified digests), else computed from the bytes."""
    flat = pages.view(torch.uint8).reshape(-1).numpy()
    if sums is None:
        sums = page_sums([flat.reshape(-1, page_bytes)]).tolist()
    return GroupPages(num_tokens, flat, tuple(int(s) for s in sums))


class PageIO:
    """Export and import of whole groups as page bytes (see the module's docstring)."""

    def __init__(self, pools: dict[str, PagePool], keyer: CacheKeys, index: GroupIndex,
                 residency: Residency, shared: SharedGroups, policy: EvictionPolicy, counters: Counters):
        self.lock, self.pools, self.keyer, self.index = residency.lock, pools, keyer, index
        self.residency, self.shared, self.policy, self.counters = residency, shared, policy, counters

    def export(self, key: ContentKey, *, copy: bool = True) -> GroupPages:
        """``TieredKVCache.export_pages`` (its contract is documented there)."""
        spec = self.keyer.check_key(key)
        if spec.kind == "embedding":             # encoder outputs: padded to pages
            with self.lock:
                group = self.index.get(key)
                on_device = group is not None and group.tier == Tier.DEVICE
            if not on_device:
                x = self.shared.get_embedding(key)
                n = x.shape[0]
                pages = torch.zeros(spec.pages_for(n) * spec.page_size, spec.width, dtype=x.dtype)
                pages[:n] = x
                return _with_sums(n, pages, spec.page_bytes)
        with self.lock:
            group = self.index.get(key)
            if group is None:
                raise UnknownKeyError(f"{key!r} is not held here")
            if group.tier == Tier.DEVICE:
                view = self.pools[key.modality].view
                runs = page_runs(group.pages)
                if len(runs) == 1 and not copy and view.device.type == "cpu":
                    data = view[runs[0].page:runs[0].page + runs[0].count]   # a view, no copy
                else:                                  # one copy per run, straight to host memory
                    data = torch.empty((len(group.pages), *view.shape[1:]), dtype=view.dtype)
                    for page, at, n in runs:
                        data[at:at + n].copy_(view[page:page + n])
                return _with_sums(group.num_tokens, data, spec.page_bytes)
            sums = list(group.location.sums) if group.tier == Tier.HOST and group.location.sums else None
            pages = self.residency.read_pages(group)      # verified (a disk read lets go of the lock)
            num_tokens = group.num_tokens
            group.hits += 1
            self.policy.on_access(group)
            self.counters.add("exports", key.modality)
        rest = num_tokens % spec.page_size
        if rest:             # the last page's unused slots may hold an earlier owner's bytes: zeros
            pages[-1, :, :, rest:] = 0
            if sums is not None:
                sums[-1] = int(page_sums([pages[-1:].reshape(1, -1).view(torch.uint8).numpy()])[0])
        return _with_sums(num_tokens, pages, spec.page_bytes, sums)

    def import_(self, key: ContentKey, shipped: GroupPages) -> bool:
        """``TieredKVCache.import_pages`` (its contract is documented there)."""
        spec = self.keyer.check_key(key)
        n, buf = shipped.num_tokens, shipped.data
        n_pages = spec.pages_for(n)
        if buf.dtype != np.uint8 or buf.size != n_pages * spec.page_bytes or n <= 0:
            raise ShapeError(f"{key.modality}: buffer of {buf.size} bytes for {n} tokens "
                             f"({n_pages} pages of {spec.page_bytes} bytes)")
        sums = shipped.sums
        if len(sums) != n_pages:
            raise ShapeError(f"{key.modality}: an export's meta carries one xxh3 per page ({n_pages}), "
                             f"got {len(sums)}")
        with warnings.catch_warnings():        # a read-only object-store buffer: only read from
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(buf)        # bytes, copied as bytes (a plain memcpy per run)
        pb = spec.page_bytes
        pool = self.pools[key.modality]
        with self.lock:
            if key in self.index:
                return False
            pages = self.residency.allocate(pool, n_pages, [])
        stored = False
        on_host = pool.view.device.type == "cpu"
        try:
            for page, at, count in page_runs(pages):   # from the buffer into the pages: the one copy
                dst = pool.view[page:page + count].view(-1).view(torch.uint8)
                part = buf[at * pb:(at + count) * pb]
                if on_host:     # libc's memcpy (non-temporal stores past the cache): ~1.3x torch's copy
                    np.copyto(dst.numpy(), part)
                    landed = dst.numpy()                 # what the pages hold now is what is checked
                else:
                    dst.copy_(src[at * pb:(at + count) * pb])
                    landed = part                        # checked in host memory, not on the device
                try:
                    check_pages(landed.reshape(count, pb), sums[at:at + count], repr(key))
                except CorruptDataError:
                    self.counters.add("corrupt_reads", key.modality)
                    self.counters.add("transfer_corrupt_reads", key.modality)
                    raise
            with self.lock:
                if key not in self.index:
                    self.index.insert(key, spec, n, pages)
                    stored = True
        finally:
            if not stored:
                with self.lock:
                    pool.free(pages)
        return stored


class Run(NamedTuple):
    """Consecutive page ids: the first, its index in the group's page list, how many."""

    page: int
    at: int
    count: int


def page_runs(pages: Sequence[int]) -> list[Run]:
    """A group's page list as runs of consecutive page ids (one copy each)."""
    runs: list[Run] = []
    for i, p in enumerate(pages):
        if runs and runs[-1].page + runs[-1].count == p:
            runs[-1] = runs[-1]._replace(count=runs[-1].count + 1)
        else:
            runs.append(Run(p, i, 1))
    return runs
