"""Shared groups of a ``TieredKVCache``: ``contains``, ``put`` / ``put_embedding`` (stored once),
``get_embedding``, ``attach`` (referenced at a sequence's next position) and ``release``. A part
of ``TieredKVCache`` (this class is one of its bases), kept in its own file.
"""

from __future__ import annotations

import time

import torch

from .config import ModalitySpec
from .content import ContentKey, tenant_scope
from .errors import ForeignKeyError, ShapeError, UnknownKeyError
from .groups import ModalityGroup
from .payload import write_embedding
from .table import SequenceHandle, naming


class GroupAPI:
    """Content-keyed groups, stored once and shared by reference, over ``TieredKVCache``'s own
    state (its lock, group index, tables and policy)."""

    def contains(self, key: ContentKey) -> bool:
        self._check_key(key)
        with self._lock:
            self.lower.apply_completions()
            group = self._groups.get(key)
            self.counters.add("hits" if group is not None else "misses", key.modality)
            if group is not None:
                group.hits += 1          # a lookup hit; recency moves on use (attach, read)
            return group is not None

    def put(self, key: ContentKey, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Store a group's K/V once; ``False`` (and nothing written) when it is already held.
        ``k, v``: ``[num_layers, n, num_kv_heads, head_dim]``, or block-split ``[num_layers,
        blocks, page_size, num_kv_heads, head_dim]`` (an engine's blocks staged as it lays them,
        any strides): each run of pages is then one strided copy from its run of blocks."""
        self._open()
        spec = self._check_key(key, "kv")
        n = self._check_kv(spec, k, v, block_split=True)
        return self._store(key, spec, n, lambda pool, pages: self._write_fresh(pool, k, v, pages))

    def put_embedding(self, key: ContentKey, x: torch.Tensor) -> bool:
        """Store encoder outputs ``[n_tokens, width]`` under a content-only key."""
        self._open()
        spec = self._check_key(key, "embedding")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != spec.width or x.shape[0] == 0:
            raise ShapeError(f"{key.modality}: embedding must be [n_tokens > 0, {spec.width}], "
                             f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        self._check_dtype(spec, x)
        return self._store(key, spec, x.shape[0], lambda pool, pages: write_embedding(pool, x, pages))

    def _store(self, key: ContentKey, spec: ModalitySpec, n: int, write) -> bool:
        """A new shared group of ``n`` tokens: pages (making room), ``write(pool, pages)``, index."""
        with self._lock:
            self.lower.apply_completions()
            if key in self._groups:
                return False
            pool = self.pools[key.modality]
            pages = self._allocate(pool, spec.pages_for(n), [])
            if key in self._groups:          # put by another thread while room was made
                pool.free(pages)
                return False
            try:
                write(pool, pages)
            except BaseException:            # nothing recorded: the call changes nothing
                pool.free(pages)
                raise
            self._insert_group(key, spec, n, pages)
            return True

    def get_embedding(self, key: ContentKey) -> torch.Tensor:
        """A copy of the stored encoder outputs ``[n_tokens, width]``."""
        spec = self._check_key(key, "embedding")
        with self._lock:
            self.lower.apply_completions()
            group = self._require(key)
            group.hits += 1
            self.counters.add("embedding_reads", key.modality)
            self.policy.on_access(group)
            self._promote(group)                 # may let go of the lock while it waits
            group = self._require(key)
            pages = self._read_pages(group)
            return pages.reshape(-1, spec.width)[: group.num_tokens].clone()

    def attach(self, seq: SequenceHandle, key: ContentKey) -> None:
        """Reference a stored group at the sequence's next position (no copy). A prefix-dependent
        group only where the sequence holds the prefix it was derived under (``PrefixMismatchError``
        otherwise, nothing changed); a content-only group anywhere."""
        self._attach(seq, key, placed=False)

    def _attach(self, seq: SequenceHandle, key: ContentKey, *, placed: bool) -> None:
        """``attach``; ``placed``: the caller checked the key's place in a sequence of which
        ``seq`` holds only some parts (a cluster sequence's sub-sequence or proxy on a pool)."""
        self._open()
        self._check_key(key, "kv")
        with self._lock:
            self.lower.apply_completions()
            table = self._table(seq)
            if key.scope != tenant_scope(self._salt(seq.tenant)):
                raise ForeignKeyError(f"key {key!r} belongs to another tenant than sequence {seq.id}")
            if not placed:
                self._check_place(seq, table, key, table.chain)
            self._promote(self._require(key))    # may let go of the lock while it waits
            table = self._table(seq)             # so the sequence and the group are looked up again
            group = self._require(key)
            if not placed:
                self._check_place(seq, table, key, table.chain)
            shared = group.refs > 0 or group.hits > 0
            table.add(group, b"group:" + key.digest, naming(key, table.chain))
            group.refs += 1
            group.last_access = time.monotonic()
            self.policy.on_access(group)
            self.counters.add("attaches", key.modality)
            if shared:
                self.counters.add("shared_attaches", key.modality)

    def release(self, seq: SequenceHandle) -> None:
        """Drop the sequence's references; its private runs are freed, shared groups stay cached.
        Reservations of it that are not fully written (a step that failed part-way) end here:
        their runs are unpinned and freed with the rest, and writing to them is refused."""
        with self._lock:
            self.lower.apply_completions()
            table = self._table(seq)
            self._compiled.drop(seq.id)
            self._steps.drop(seq.id)
            for res in table.open_runs:
                if res.open:
                    res.open = False
                    res.group.pins -= 1
            table.open_runs = []
            for seg in table.segments:
                group = seg.group
                group.refs -= 1
                if group.key is None:
                    if group.refs == 0:
                        self._free_group(group)      # its storage goes once no reader pins it
                elif group.refs == 0:
                    self.policy.on_release(group)
            del self._seqs[seq.id]

    def _insert_group(self, key: ContentKey, spec: ModalitySpec, n: int, pages: list[int]) -> ModalityGroup:
        group = ModalityGroup(next(self._gids), key, spec, n, pages=pages,
                              parent=self.lineage.parent_of(key, self._groups))
        self._groups[key] = group
        self.policy.on_insert(group)
        self.counters.add("puts", key.modality)
        self.counters.add("stored_tokens", key.modality, n)
        return group

    def _require(self, key: ContentKey) -> ModalityGroup:
        group = self._groups.get(key)
        if group is None:
            raise UnknownKeyError(f"{key!r} is not in the cache (put it first)")
        return group
