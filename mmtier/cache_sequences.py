"""Sequences of a ``TieredKVCache``: creation, lookup, and ``append`` with the growth of a
sequence's tail run (pages planned, written, then recorded). A part of ``TieredKVCache`` (this
class is one of its bases), kept in its own file.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache_keys import DEFAULT_TENANT
from .config import ModalitySpec
from .errors import ShapeError, UnknownKeyError, UnknownModalityError
from .groups import ModalityGroup, Tier
from .payload import slot_mapping, token_identity
from .pool import PagePool
from .room import ROOM_WAIT_S
from .table import SequenceHandle, SequenceTable


@dataclass(eq=False)
class _Growth:
    """Pages allocated for ``n`` tokens at a sequence's end, not yet recorded (``_grow``)."""

    table: SequenceTable
    group: ModalityGroup | None         # the tail run they extend; None: a new run
    pool: PagePool
    pages: list[int]                    # the new pages
    n: int
    page_ids: torch.Tensor              # int32 slot mapping of the n tokens (host)
    offsets: torch.Tensor



class SequenceAPI:
    """Sequences and their private runs over ``TieredKVCache``'s own state (its lock, tables,
    pools and room making)."""

    def create_sequence(self, tenant: str | None = None) -> SequenceHandle:
        self._open()
        self._salt(tenant)
        with self._lock:
            handle = SequenceHandle(next(self._seq_ids), DEFAULT_TENANT if tenant is None else tenant)
            self._seqs[handle.id] = SequenceTable(handle)
            return handle

    def _table(self, seq: SequenceHandle) -> SequenceTable:
        if not isinstance(seq, SequenceHandle):
            raise UnknownKeyError(f"expected a SequenceHandle, got {type(seq).__name__}")
        table = self._seqs.get(seq.id)
        if table is None or table.handle != seq:
            raise UnknownKeyError(f"unknown sequence {seq.id} (released or never created)")
        return table

    def sequence(self, seq: SequenceHandle) -> SequenceTable:
        """The sequence's table (segments, views by modality and by key)."""
        with self._lock:
            return self._table(seq)

    def append(self, seq: SequenceHandle, modality: str, k: torch.Tensor, v: torch.Tensor,
               *, tokens: Sequence[int] | None = None, new_run: bool = False) -> None:
        """Append tokens' K/V (``[num_layers, n, num_kv_heads, head_dim]``) to the sequence.

        ``tokens`` (their ids) name the content for the prefix chain; without them the chain
        hashes the K/V bytes. ``new_run``: the tokens start a segment of their own instead of
        extending the tail run (a boundary the caller needs: an embedded pool places a group
        attended elsewhere between the two)."""
        self._open()
        spec = self.cfg.spec(modality)
        if spec.kind != "kv":
            raise UnknownModalityError(f"modality {modality!r} holds embeddings; use put_embedding")
        n = self._check_kv(spec, k, v)
        if tokens is not None and len(tokens) != n:
            raise ShapeError(f"{len(tokens)} token ids for {n} tokens")
        identity = token_identity(modality, k, v, tokens)
        with self._lock:
            self.lower.apply_completions()
            growth = self._grow(self._table(seq), modality, spec, n, new_run)
            try:
                self._write(growth.pool, k, v, growth.page_ids, growth.offsets)
            except BaseException:
                growth.pool.free(growth.pages)
                raise
            self._commit_growth(growth, identity)

    def _grow(self, table: SequenceTable, modality: str, spec: ModalitySpec, n: int,
              new_run: bool = False) -> _Growth:
        """Pages for ``n`` more tokens at the end of ``table``'s sequence: the device tail run
        extended (unless ``new_run``, or another thread is moving it down: its staged copy would
        miss the new tokens), or a new run. Nothing is recorded until ``_commit_growth``: a write
        that fails in between gives the new pages back and leaves the sequence as it was (lock
        held; making room may let go of it, so the plan is made again after each wait)."""
        pool = self.pools[modality]
        seq = table.handle
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            table = self._table(seq)
            tail = table.tail
            extend = not new_run and tail is not None and tail.group.key is None \
                and tail.group.modality == modality and tail.group.tier == Tier.DEVICE \
                and tail.group.busy == 0
            have = tail.group.num_tokens if extend else 0
            slack = (spec.pages_for(have) * spec.page_size - have) if extend else 0
            new_pages = spec.pages_for(max(0, n - slack))
            if new_pages <= pool.num_free:
                break
            self._make_room(pool, new_pages - pool.num_free, [tail.group] if extend else [], deadline=deadline)
        pages = pool.allocate(new_pages)
        all_pages = (tail.group.pages + pages) if extend else pages
        page_ids, offsets = slot_mapping(all_pages, have, n, spec.page_size)
        return _Growth(table, tail.group if extend else None, pool, pages, n, page_ids, offsets)

    def _commit_growth(self, g: _Growth, identity: bytes) -> ModalityGroup:
        """Record a growth whose tokens are (or will be) written: the run and the prefix chain."""
        if g.group is not None:
            group = g.group
            group.pages = group.pages + g.pages
            group.num_tokens += g.n
            g.table.grow(identity)
        else:
            group = ModalityGroup(next(self._gids), None, g.pool.spec, g.n, pages=g.pages, refs=1)
            g.table.add(group, identity)
            self.policy.on_insert(group)
        self.counters.add("appended_tokens", group.modality, g.n)
        return group
