"""``TieredKVCache``: the in-process cache. Composes pools, groups, tables, keys and policy.

Every public method validates its input completely before it changes anything, so a call that
raises leaves the cache exactly as it was. One re-entrant lock guards the bookkeeping.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterable, Sequence
from contextlib import nullcontext

import torch

from .batch_attention import attend_batch, query_bounds
from .config import CacheConfig, ModalitySpec
from .content import ContentKey, KeyMaker, media_digest, tenant_salt, tenant_scope
from .errors import (
    CapacityError,
    ClosedError,
    DTypeError,
    ForeignKeyError,
    ShapeError,
    UnknownKeyError,
    UnknownModalityError,
)
from .eviction import make_policy
from .groups import ModalityGroup, Tier
from .kernels import merge_attention_states, paged_attention
from .layer_writes import Reservation, write_one_layer
from .leases import Lease, LeaseTable
from .payload import (
    check_kv,
    check_payload,
    token_identity,
    write_embedding,
    write_fresh_pages,
    write_slots,
)
from .pool import DeviceArena, PagePool
from .residency import LowerTiers
from .stats import CacheStats, Counters, TierUsage
from .table import Segment, SequenceHandle, SequenceTable, compile_segments

DEFAULT_TENANT = "default"


class TieredKVCache:
    """Paged, modality-aware KV cache with content-keyed sharing (see DESIGN.md's contract)."""

    def __init__(self, cfg: CacheConfig):
        self.cfg = cfg
        self.arena = DeviceArena(cfg)
        self.pools: dict[str, PagePool] = self.arena.pools
        self.keys = KeyMaker(cfg.model, cfg.key_secret)
        self.policy = make_policy(cfg)
        self.counters = Counters()
        self._lock = threading.RLock()
        self._groups: dict[ContentKey, ModalityGroup] = {}
        self._seqs: dict[int, SequenceTable] = {}
        self._gids = itertools.count(1)
        self._seq_ids = itertools.count(1)
        self._closed = False
        self.leases = LeaseTable(ttl=30.0, clock=self.policy.clock)
        self.lower = LowerTiers(self)
        self.lower.adopt_disk_inventory()

    # ------------------------------------------------------------------ keys and tenants
    def _salt(self, tenant: str | None) -> bytes:
        tenant = DEFAULT_TENANT if tenant is None else tenant
        if not isinstance(tenant, str) or not tenant:
            raise ForeignKeyError(f"tenant must be a non-empty string, got {tenant!r}")
        return tenant_salt(self.cfg.key_secret, tenant)

    def content_key(
        self,
        modality: str,
        media: bytes | bytearray | memoryview,
        *,
        tenant: str | None = None,
        parent: ContentKey | None = None,
        params: dict[str, object] | None = None,
    ) -> ContentKey:
        """The key of a media item: hashes the bytes here (never trusts a caller's id).

        ``parent`` (a ``prefix_key``) makes the key prefix-dependent; ``params`` are the
        preprocessing parameters that change the tokens (resolution, sample rate, ...)."""
        spec = self.cfg.spec(modality)
        if not isinstance(media, (bytes, bytearray, memoryview)):
            raise DTypeError(f"media must be bytes-like, got {type(media).__name__}")
        return self.keys.derive(
            modality=modality, layout=spec.layout_fields(), media=media_digest(media, params),
            tenant_salt=self._salt(tenant), parent=parent)

    def prefix_key(self, seq: SequenceHandle) -> ContentKey:
        """A key naming everything ``seq`` holds so far; pass it as ``parent=`` to chain."""
        with self._lock:
            table = self._table(seq)
            modality = table.tail.group.modality if table.tail else next(iter(self.cfg.modalities))
            return self.keys.chain(modality=modality, chain_digest=table.chain,
                                   tenant_salt=self._salt(seq.tenant))

    def _check_key(self, key: ContentKey, kind: str | None = None) -> ModalitySpec:
        self.keys.verify(key)
        spec = self.cfg.spec(key.modality)
        if kind is not None and spec.kind != kind:
            raise UnknownModalityError(f"modality {key.modality!r} holds {spec.kind!r} payloads, not {kind!r}")
        return spec

    # ------------------------------------------------------------------ sequences
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
               *, tokens: Sequence[int] | None = None) -> None:
        """Append tokens' K/V (``[num_layers, n, num_kv_heads, head_dim]``) to the sequence.

        ``tokens`` (their ids) name the content for the prefix chain; without them the chain
        hashes the K/V bytes."""
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
            _, pool, page_ids, offsets = self._grow(self._table(seq), modality, spec, n, identity)
            self._write(pool, k, v, page_ids, offsets)

    def _grow(self, table: SequenceTable, modality: str, spec: ModalitySpec, n: int, identity: bytes,
              new_run: bool = False):
        """``n`` more tokens at the end of ``table``: the device tail run extended (unless
        ``new_run``), or a new run. Returns ``(group, pool, page ids, slot offsets)`` of the new
        tokens (lock held)."""
        tail = table.tail
        extend = not new_run and tail is not None and tail.group.key is None \
            and tail.group.modality == modality and tail.group.tier == Tier.DEVICE
        pool = self.pools[modality]
        have = tail.group.num_tokens if extend else 0
        slack = (spec.pages_for(have) * spec.page_size - have) if extend else 0
        new_pages = spec.pages_for(max(0, n - slack))
        protect = [tail.group] if extend else []
        pages = self._allocate(pool, new_pages, protect)
        if extend:
            group = tail.group
            all_pages = group.pages + pages
        else:
            group = ModalityGroup(next(self._gids), None, spec, 0, pages=pages, refs=1)
            all_pages = pages
        slots = torch.arange(have, have + n)
        page_ids = torch.tensor(all_pages, dtype=torch.int64)[slots // spec.page_size]
        if extend:
            group.pages = all_pages
            group.num_tokens += n
            table.extend_chain(identity)
        else:
            group.num_tokens = n
            table.add(group, identity)
            self.policy.on_insert(group)
        self.counters.add("appended_tokens", modality, n)
        return group, pool, page_ids, slots % spec.page_size

    # ------------------------------------------------------------------ shared groups
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
        """Store a group's K/V once; ``False`` (and nothing written) when it is already held."""
        self._open()
        spec = self._check_key(key, "kv")
        n = self._check_kv(spec, k, v)
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
            write(pool, pages)
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
            if self._ensure_device(group):
                pool = self.pools[key.modality]
                pages = pool.view[torch.tensor(group.pages, device=pool.device)]
            elif group.tier == Tier.HOST:
                pages = group.location.gather()
            else:
                pages = self.lower._read_disk(group)
            return pages.reshape(-1, spec.width)[: group.num_tokens].clone()

    def attach(self, seq: SequenceHandle, key: ContentKey) -> None:
        """Reference a stored group at the sequence's next position (no copy)."""
        self._open()
        spec = self._check_key(key, "kv")
        del spec
        with self._lock:
            self.lower.apply_completions()
            table = self._table(seq)
            if key.scope != tenant_scope(self._salt(seq.tenant)):
                raise ForeignKeyError(f"key {key!r} belongs to another tenant than sequence {seq.id}")
            group = self._require(key)
            self._ensure_device(group)
            shared = group.refs > 0 or group.hits > 0
            table.add(group, b"group:" + key.digest)
            group.refs += 1
            group.last_access = time.monotonic()
            self.policy.on_access(group)
            self.counters.add("attaches", key.modality)
            if shared:
                self.counters.add("shared_attaches", key.modality)

    def release(self, seq: SequenceHandle) -> None:
        """Drop the sequence's references; its private runs are freed, shared groups stay cached."""
        with self._lock:
            self.lower.apply_completions()
            table = self._table(seq)
            for seg in table.segments:
                group = seg.group
                group.refs -= 1
                if group.key is None:
                    if group.refs == 0:
                        self._free_group(group)
                elif group.refs == 0:
                    self.policy.on_release(group)
            del self._seqs[seq.id]

    def _insert_group(self, key: ContentKey, spec: ModalitySpec, n: int, pages: list[int]) -> ModalityGroup:
        group = ModalityGroup(next(self._gids), key, spec, n, pages=pages)
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

    # ------------------------------------------------------------------ attention
    def attention(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                  groups: Iterable[ContentKey] | None = None, causal: bool = True,
                  scale: float | None = None, modalities: Iterable[str] | None = None) -> torch.Tensor:
        """Attention of ``q [n_q, num_q_heads, head_dim]`` over the sequence's pages.

        Queries are the last ``n_q`` positions; causal by absolute position; ``groups`` restricts
        the keys to those groups (cross-attention)."""
        out, _ = self.attention_state(seq, layer, q, groups=groups, causal=causal, scale=scale,
                                      modalities=modalities)
        return out

    def attention_state(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                        groups: Iterable[ContentKey] | None = None, causal: bool = True,
                        scale: float | None = None, q_positions: torch.Tensor | None = None,
                        modalities: Iterable[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``: the partial state that merges exactly with others (other tiers, nodes)."""
        self._check_q(q)
        with self._lock:
            self.lower.apply_completions()
            table = self._table(seq)
            segments = self._select(seq, table, groups)
            if modalities is not None:
                mods = set(modalities)
                for m in mods:
                    self.cfg.spec(m)
                segments = [s for s in segments if s.group.modality in mods]
            n_q = q.shape[0]
            length = table.length
            if q_positions is None:
                if causal and n_q > length:
                    raise ShapeError(f"{n_q} queries but the sequence holds {length} tokens")
                q_pos = torch.arange(max(0, length - n_q), max(0, length - n_q) + n_q, dtype=torch.int32)
            else:
                q_pos = q_positions.to(torch.int32).cpu()
            return self._attend_checked(segments, layer, q, q_pos, causal, scale)

    def attention_state_parts(self, parts: Sequence[tuple[SequenceHandle, Iterable[ContentKey] | None, int, int | None]],
                              layer: int, q: torch.Tensor, q_positions: torch.Tensor, *,
                              causal: bool = True, scale: float | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` over parts of local sequences that hold pieces of a bigger sequence
        (a pool's runs and proxies of a cluster sequence), all in one call: part ``(seq, keys,
        offset, start)`` adds the segments of ``seq`` (those of ``keys`` when given; only the one
        at local position ``start`` when given) at ``local position + offset``; ``q_positions``
        are positions of the bigger sequence. A segment named by two parts is refused."""
        self._check_q(q)
        with self._lock:
            self.lower.apply_completions()
            segments, seen = [], set()
            for seq, keys, offset, start in parts:
                for s in self._select(seq, self._table(seq), keys):
                    if start is not None and s.start != start:
                        continue
                    if (seq.id, s.start) in seen:
                        raise ShapeError(f"sequence {seq.id}: the segment at {s.start} is in two parts")
                    seen.add((seq.id, s.start))
                    segments.append(Segment(s.group, s.start + int(offset)))
            return self._attend_checked(segments, layer, q, q_positions.to(torch.int32).cpu(), causal, scale)

    def _check_q(self, q) -> None:
        self._open()
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ShapeError(f"q must be [n_q, num_q_heads, head_dim], got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise DTypeError(f"q dtype {q.dtype} is not float32, float16 or bfloat16")

    def _select(self, seq: SequenceHandle, table: SequenceTable, groups: Iterable[ContentKey] | None):
        """The segments of ``table``, or of those groups (verified, all attached)."""
        if groups is None:
            return table.segments
        wanted = set(groups)
        for key in wanted:
            self.keys.verify(key)
        missing = wanted - {s.group.key for s in table.segments}
        if missing:
            raise UnknownKeyError(f"groups not attached to sequence {seq.id}: {sorted(map(str, missing))}")
        return [s for s in table.segments if s.group.key in wanted]

    def _attend_checked(self, segments, layer, q, q_pos, causal, scale):
        """Check the segments fit ``q`` and ``layer``, pin them, attend (lock held)."""
        for s in segments:
            spec = s.group.spec
            if spec.kind != "kv":
                raise ShapeError(f"segment of {spec.name!r} holds embeddings, not KV")
            if not 0 <= layer < spec.num_layers:
                raise ShapeError(f"layer {layer} out of range for {spec.name!r} ({spec.num_layers} layers)")
            if spec.head_dim != q.shape[2]:
                raise ShapeError(f"q head dim {q.shape[2]} != {spec.name!r} head dim {spec.head_dim}; "
                                 "restrict with groups=")
            if q.shape[1] % spec.num_kv_heads:
                raise ShapeError(f"{q.shape[1]} query heads are not a multiple of "
                                 f"{spec.num_kv_heads} KV heads of {spec.name!r}")
        for s in segments:
            s.group.pins += 1
            self.policy.on_access(s.group)
        try:
            return self._attend(segments, layer, q, q_pos, causal, scale)
        finally:
            for s in segments:
                s.group.pins -= 1

    def _attend(self, segments, layer, q, q_pos, causal, scale):
        """Device-resident segments on the device backend; lower tiers where they live."""
        device_segs = [s for s in segments if s.group.tier == Tier.DEVICE]
        stream = self.lower.stream(segments, layer) if self.lower.enabled else None   # disk reads first:
        try:                                                          # they overlap the device part
            states = self._attend_tiers(segments, device_segs, layer, q, q_pos, causal, scale, stream)
        finally:
            if stream is not None:
                stream.close()
        if len(states) == 1:
            out, lse = states[0]
        else:
            out, lse = merge_attention_states([s[0].cpu() for s in states], [s[1].cpu() for s in states],
                                              backend="torch", out_dtype=torch.float32)
        return out.to(device=q.device, dtype=q.dtype), lse.to(q.device)

    def _attend_tiers(self, segments, device_segs, layer, q, q_pos, causal, scale, stream):
        states = []
        if device_segs or not segments:
            ops = compile_segments(device_segs, layer, self._device_view)
            dev = self.arena.device
            qd = q.to(dev)
            sharing = stream.sharing_cores() if stream is not None and dev.type == "cpu" else nullcontext()
            with sharing:
                states.append(paged_attention(
                    qd, torch.tensor([0, q.shape[0]], dtype=torch.int32, device=dev), q_pos.to(dev), ops,
                    causal=causal, scale=scale, backend=self._backend(), out_dtype=torch.float32))
        states.extend(self._attend_lower(segments, layer, q, q_pos, causal, scale, stream))
        return states

    def _attend_lower(self, segments, layer, q, q_pos, causal, scale, stream=None):
        """Partial states of host- and disk-resident segments, computed where they live."""
        if not self.lower.enabled:
            return []
        return self.lower.lower_states(segments, layer, q, q_pos, causal, scale, stream)

    def _device_view(self, group: ModalityGroup):
        pool = self.pools[group.modality]
        return (group.modality, pool.view, group.pages)

    def _backend(self) -> str:
        return self.cfg.attention_backend

    # ------------------------------------------------------------------ engine integration
    # Per-layer writes and one attention call for a batch of sequences: what an engine's model
    # runner (the transformers adapter, vLLM / SGLang connectors) calls once per layer.
    def reserve(self, seq: SequenceHandle, modality: str, n: int, *,
                tokens: Sequence[int] | None = None, new_run: bool = False) -> Reservation:
        """Add ``n`` tokens to ``seq`` whose K/V will arrive one layer at a time
        (``write_layer``). Their pages stay on the device until every layer is written.
        ``tokens`` (their ids) name them in the prefix chain; without them the run is unique
        (its prefix never matches another sequence's). ``new_run``: start a run of their own
        (one that ``seal`` can turn into a shared group)."""
        self._open()
        spec = self.cfg.spec(modality)
        if spec.kind != "kv":
            raise UnknownModalityError(f"modality {modality!r} holds embeddings; use put_embedding")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ShapeError(f"reserve needs n > 0 tokens, got {n!r}")
        if tokens is not None and len(tokens) != n:
            raise ShapeError(f"{len(tokens)} token ids for {n} tokens")
        identity = token_identity(modality, None, None, tokens) if tokens is not None else \
            b"unique:" + os.urandom(16)
        with self._lock:
            self.lower.apply_completions()
            group, pool, page_ids, offsets = self._grow(self._table(seq), modality, spec, n, identity,
                                                        new_run)
            group.pins += 1
            dev = pool.device
            return Reservation(group, pool, page_ids.to(device=dev, dtype=torch.int32),
                               offsets.to(device=dev, dtype=torch.int32), n)

    def write_layer(self, res: Reservation, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer (``k, v [n, num_kv_heads, head_dim]``) of a reservation's tokens."""
        self._open()
        with self._lock:
            write_one_layer(res, layer, k, v, self._backend())
            if res.complete:
                res.open = False
                res.group.pins -= 1

    def seal(self, seq: SequenceHandle, key: ContentKey) -> bool:
        """Make the sequence's last run (fully written, started by ``reserve(new_run=True)``) the
        shared group ``key``, in place (no copy): later sequences of the tenant ``attach`` it.
        ``False`` (the run stays private) when ``key`` is already held or the run has left the
        device."""
        self._check_key(key, "kv")
        with self._lock:
            table = self._table(seq)
            if key.scope != tenant_scope(self._salt(seq.tenant)):
                raise ForeignKeyError(f"key {key!r} belongs to another tenant than sequence {seq.id}")
            tail = table.tail
            if tail is None or tail.group.key is not None or tail.group.modality != key.modality:
                raise UnknownKeyError(f"sequence {seq.id} ends in no private {key.modality} run to seal")
            group = tail.group
            if group.pins:
                raise ShapeError(f"sequence {seq.id}: its last run is still being written")
            if key in self._groups or group.tier != Tier.DEVICE:
                return False                      # held already, or moved down meanwhile
            group.key = key
            self._groups[key] = group
            self.counters.add("puts", key.modality)
            self.counters.add("stored_tokens", key.modality, group.num_tokens)
            return True

    def attention_batch(self, seqs: Sequence[SequenceHandle], layer: int, q: torch.Tensor,
                        q_indptr: torch.Tensor | Sequence[int], *,
                        groups: Sequence[Iterable[ContentKey] | None] | None = None,
                        causal: bool = True, scale: float | None = None) -> torch.Tensor:
        """Attention for a batch of sequences in one call: rows ``q_indptr[b]:q_indptr[b+1]`` of
        ``q [total_q, num_q_heads, head_dim]`` are the last queries of ``seqs[b]``; ``groups[b]``
        restricts sequence ``b`` to those groups (cross-attention). Device pages of every
        sequence go through one kernel launch per pool."""
        return self.attention_batch_state(seqs, layer, q, q_indptr, groups=groups, causal=causal,
                                          scale=scale)[0]

    def attention_batch_state(self, seqs: Sequence[SequenceHandle], layer: int, q: torch.Tensor,
                              q_indptr: torch.Tensor | Sequence[int], *,
                              groups: Sequence[Iterable[ContentKey] | None] | None = None,
                              causal: bool = True, scale: float | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``attention_batch``'s ``(out, lse)``."""
        self._check_q(q)
        seqs = list(seqs)
        bounds = query_bounds(q_indptr, q.shape[0], len(seqs))
        if groups is not None and len(groups) != len(seqs):
            raise ShapeError(f"{len(groups)} group lists for {len(seqs)} sequences")
        with self._lock:
            self.lower.apply_completions()
            batch, positions = [], []
            for b, seq in enumerate(seqs):
                table = self._table(seq)
                batch.append(list(self._select(seq, table, None if groups is None else groups[b])))
                n_q, length = bounds[b + 1] - bounds[b], table.length
                if causal and n_q > length:
                    raise ShapeError(f"sequence {seq.id}: {n_q} queries but it holds {length} tokens")
                first = max(0, length - n_q)
                positions.append(torch.arange(first, first + n_q, dtype=torch.int32))
            q_pos = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int32)
            return attend_batch(self, batch, layer, q, bounds, q_pos, causal, scale)

    # ------------------------------------------------------------------ room and residency
    def _allocate(self, pool: PagePool, n: int, protect: list[ModalityGroup]) -> list[int]:
        """``n`` pages of ``pool``, demoting whole unreferenced groups first if needed."""
        if n > pool.num_free:
            self._make_room(pool, n - pool.num_free, protect)
        return pool.allocate(n)

    def _make_room(self, pool: PagePool, pages_needed: int, protect: list[ModalityGroup],
                   referenced: bool = True) -> None:
        """Free ``pages_needed`` pages of ``pool`` by moving whole groups down (or dropping them
        at the bottom). Unreferenced groups go first, in the policy's order; with lower tiers,
        referenced groups not in use may be demoted too (attention serves them where they are).
        ``CapacityError``, before anything moves, when not enough can go."""
        spec = pool.spec
        chosen, got = [], 0
        for g in self.policy.victims(Tier.DEVICE, pages_needed * spec.page_bytes, spec.name):
            if got >= pages_needed:
                break
            if g not in protect:
                chosen.append(g)
                got += len(g.pages)
        if got < pages_needed and referenced and self.lower.enabled:
            held = sorted((s.group for t in self._seqs.values() for s in t.segments
                           if s.group.tier == Tier.DEVICE and s.group.modality == spec.name
                           and s.group.refs > 0 and s.group.pins == 0 and s.group.busy == 0
                           and s.group not in protect), key=lambda g: g.last_access)
            for g in dict.fromkeys(held):
                if got >= pages_needed:
                    break
                if g not in chosen:
                    chosen.append(g)
                    got += len(g.pages)
        if got < pages_needed:
            raise CapacityError(
                f"{spec.name} pool: {pages_needed} more pages needed, {pool.num_free} free of {pool.num_pages} "
                f"and only {got} pages held by groups that can move (no lower tier could take more)")
        for g in chosen:
            self._demote(g)

    def _demote(self, group: ModalityGroup) -> None:
        """Move a whole device group one tier down; without a lower tier, drop it."""
        if self.lower.enabled and self.lower.demote_from_device(group):
            return
        if group.refs > 0:
            raise CapacityError(f"{group!r} is in use and no lower tier could take it")
        self._drop(group)

    def _drop(self, group: ModalityGroup) -> None:
        self.counters.add("evictions", group.modality)
        self._free_group(group)

    def _free_group(self, group: ModalityGroup) -> None:
        if group.tier == Tier.DEVICE and group.pages:
            self.pools[group.modality].free(group.pages)
            group.pages = []
        if self.lower.enabled:
            self.lower.forget(group)
        if group.key is not None and self._groups.get(group.key) is group:
            del self._groups[group.key]
        self.policy.on_remove(group)

    # ------------------------------------------------------------------ leases and export
    def lease(self, key: ContentKey, ttl: float = 30.0) -> Lease:
        """Protect a group from eviction for ``ttl`` seconds (a read or transfer in progress)."""
        self._check_key(key)
        with self._lock:
            return self.leases.grant(self._require(key), ttl)

    def release_lease(self, lease: Lease) -> None:
        with self._lock:
            self.leases.release(lease)

    def read_group(self, key: ContentKey, *, lease: Lease | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of a stored group's ``(k, v)`` ``[num_layers, n, num_kv_heads, head_dim]`` on
        the CPU, from whichever tier holds it (export, transfer to another node). With a
        ``lease``, the copy is returned only if the lease was still live when it finished
        (``LeaseExpiredError`` otherwise): memory reused meanwhile is never returned."""
        spec = self._check_key(key, "kv")
        with self._lock:
            self._open()
            self.lower.apply_completions()
            group = self._require(key)
            if lease is not None:
                self.leases.check(lease)
            if group.tier == Tier.DEVICE:
                pool = self.pools[key.modality]
                pages = pool.view[torch.tensor(group.pages, device=pool.device)].cpu()
            elif group.tier == Tier.HOST:
                pages = group.location.gather()
            else:
                pages = self.lower._read_disk(group)
            if lease is not None:
                self.leases.check(lease)
            group.hits += 1
            self.policy.on_access(group)
            self.counters.add("exports", key.modality)
        n = group.num_tokens
        flat = pages.permute(1, 2, 0, 3, 4, 5).reshape(spec.num_layers, 2, -1, spec.num_kv_heads, spec.head_dim)
        return flat[:, 0, :n].contiguous(), flat[:, 1, :n].contiguous()

    def inventory(self) -> list[tuple[ContentKey, str, int]]:
        """Every stored shared group: ``(key, tier name, bytes)`` (registries rebuild from it)."""
        with self._lock:
            self.lower.apply_completions()
            return [(g.key, g.tier.name.lower(), g.nbytes) for g in self._groups.values()]

    def _forget_corrupt(self, group: ModalityGroup) -> None:
        """A stored copy failed verification: the group is a miss from now on."""
        if group.key is not None and self._groups.get(group.key) is group:
            del self._groups[group.key]
        self.policy.on_remove(group)
        group.location = None

    def flush(self) -> None:
        """Wait for the copies in flight (background spills, prefetches) and apply them."""
        with self._lock:
            if self.lower.enabled:
                self.lower.flush()

    def prefetch(self, key: ContentKey) -> bool:
        """Start bringing a disk-resident group up to host memory; ``True`` if a copy started."""
        self._check_key(key)
        with self._lock:
            self.lower.apply_completions()
            group = self._require(key)
            return self.lower.prefetch(group) is not None

    def _ensure_device(self, group: ModalityGroup) -> bool:
        """Bring a lower-tier group to the device when room can be made without demoting
        groups in use; ``False`` when it stays below (attention serves it there)."""
        if group.tier == Tier.DEVICE:
            return True
        return self.lower.promote(group)

    # ------------------------------------------------------------------ I/O helpers
    def _check_kv(self, spec: ModalitySpec, k, v) -> int:
        return check_kv(spec, k, v)

    def _check_dtype(self, spec: ModalitySpec, t: torch.Tensor) -> None:
        check_payload(spec, t)

    def _write_fresh(self, pool: PagePool, k, v, pages: list[int]) -> None:
        write_fresh_pages(pool, k, v, pages, self._backend())

    def _write(self, pool: PagePool, k, v, page_ids: torch.Tensor, offsets: torch.Tensor) -> None:
        write_slots(pool, k, v, page_ids, offsets, self._backend())

    # ------------------------------------------------------------------ stats and life cycle
    def stats(self) -> CacheStats:
        with self._lock:
            self.lower.apply_completions()
            device: dict[str, TierUsage] = {}
            for name, pool in self.pools.items():
                device[name] = TierUsage(0, pool.num_used, pool.num_used * pool.spec.page_bytes,
                                         pool.num_pages * pool.spec.page_bytes)
            seen: set[int] = set()
            groups = list(self._groups.values()) + [s.group for t in self._seqs.values() for s in t.segments]
            for g in groups:
                if g.gid in seen or g.tier != Tier.DEVICE:
                    continue
                seen.add(g.gid)
                device[g.modality].groups += 1
            counters, by_modality = self.counters.snapshot()
            counters.update(self.lower.storage_counters())
            return CacheStats(tiers={"device": device, **self._lower_stats()}, counters=counters,
                              by_modality=by_modality, sequences=len(self._seqs))

    def _lower_stats(self) -> dict[str, dict[str, TierUsage]]:
        return self.lower.stats() if self.lower.enabled else {}

    def _open(self) -> None:
        if self._closed:
            raise ClosedError("the cache is closed")

    def close(self) -> None:
        """Wait for in-flight copies, then close the lower tiers (files stay for a restart)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.lower.close()

    def __enter__(self) -> TieredKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
