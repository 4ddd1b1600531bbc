"""``TieredKVCache``: the in-process cache, a small facade over parts that each own their state.

Every public method validates its input completely before it changes anything, so a call that
raises leaves the cache exactly as it was. One lock (``OwnerLock``) guards the bookkeeping only:
attention is planned under it (segments chosen, groups pinned, operands captured), computed
without it, and unpinned under it again; a call that must wait for a copy (a spill that makes
room, a restore from disk) marks the groups it works on and lets go of the lock for the wait.

The parts, one file each, are given the parts they use in their constructors; the lock is
``Residency``'s (it creates it; the others take it from there, so ownership runs one way, down):
``CacheKeys`` (``keys.py``: tenants, content and prefix keys, key checks), ``GroupIndex``
(``group_index.py``: key -> group, ids, lineage), ``Residency`` (``tiers/residency.py``: the lock,
lower tiers, room, promotion, leases, export, stats and the life cycle; the lower tiers'
``GroupOwner``; it applies landed copies, ``apply_copies``),
``Sequences`` (``sequences.py``: tables, appends, attach and release), ``SharedGroups``
(``shared_groups.py``: contains, put, get_embedding), ``AttentionPlanner``
(``attention/planner.py``), ``EngineSurface``
(``engine_surface.py``: per-layer writes, seal, batched attention through
``attention/batch_planner.py``), ``PageIO``
(``page_io.py``: a group as page bytes and back) and ``Holdings`` (``holdings.py``: group
snapshots, explicit drops, page usage: what a pool serving the cache asks), and, with a disk
tier, ``WriteBehind`` (``tiers/durability.py``: every saved group also written to disk in the
background, the index telling it of each, ``GroupIndex.on_saved``). This file builds them and
delegates; it holds no bookkeeping of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..attention.planner import AttentionPlanner
from ..config import CacheConfig
from ..content import ContentKey, KeyMaker
from ..core.lineage import Lineage
from ..core.locking import OwnerLock
from ..core.segments import SequenceHandle, SequenceTable
from ..eviction import EvictionPolicy, make_policy
from ..pages.layer_writes import Reservation
from ..pages.pool import DeviceArena, PagePool
from ..stats import CacheStats, Counters
from ..tiers.durability import WriteBehind
from ..tiers.leases import Lease, LeaseTable
from ..tiers.lower import LowerTiers
from ..tiers.residency import Residency
from ..tiers.room import Room
from .engine_surface import EngineSurface
from .group_index import GroupIndex
from .holdings import GroupInfo, Holdings, PageUsage
from .keys import CacheKeys
from .page_io import GroupPages, PageIO
from .sequences import Sequences
from .shared_groups import SharedGroups


class TieredKVCache:
    """Paged, modality-aware KV cache with content-keyed sharing (see docs/design.md's contract)."""

    def __init__(self, cfg: CacheConfig, policy: EvictionPolicy | None = None):
        """``policy``: an eviction policy instance to use instead of ``cfg.eviction_policy``'s
        (an offline reference in a benchmark, say); it must be new (it has seen no group)."""
        self.cfg = cfg
        self.arena = DeviceArena(cfg)
        self.pools: dict[str, PagePool] = self.arena.pools
        self.keys = KeyMaker(cfg.model, cfg.key_secret)
        self.policy = policy if policy is not None else make_policy(cfg)
        self.counters = Counters()
        self.index = GroupIndex(self.policy, self.counters)
        self.residency = Residency(cfg, self.pools, self.keys, self.index, self.policy, self.counters)
        self.lock: OwnerLock = self.residency.lock     # residency owns the lock; the parts take it there
        # every saved group also written to disk in the background (with a disk tier)
        self.durable = (WriteBehind(cfg, self.residency, self.index, self.counters)
                        if cfg.disk_dir is not None and cfg.write_behind else None)
        self.index.on_saved = self.durable.saved if self.durable is not None else None
        self.keyer = CacheKeys(cfg, self.keys, self.index.lineage, self.lock)
        self.seqs = Sequences(cfg, self.keyer, self.index, self.residency, self.policy, self.counters)
        self.shared = SharedGroups(cfg, self.keyer, self.index, self.residency, self.policy, self.counters)
        self.planner = AttentionPlanner(cfg, self.arena.device, self.keys, self.seqs, self.residency,
                                        self.policy, self.counters)
        self.engine = EngineSurface(cfg, self.keyer, self.index, self.seqs, self.residency, self.planner,
                                    self.policy)
        self.page_io = PageIO(self.pools, self.keyer, self.index, self.residency, self.shared, self.policy,
                              self.counters)
        self.holdings = Holdings(self.pools, self.index, self.seqs, self.residency, self.counters)

    # ------------------------------------------------------------------ the parts' state, read-only
    @property
    def lower(self) -> LowerTiers:
        return self.residency.lower

    @property
    def room(self) -> Room:
        return self.residency.room

    @property
    def leases(self) -> LeaseTable:
        return self.residency.leases

    @property
    def lineage(self) -> Lineage:
        return self.index.lineage

    @property
    def closed(self) -> bool:
        return self.residency.closed

    # ------------------------------------------------------------------ keys and tenants
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
        return self.keyer.content_key(modality, media, tenant=tenant, parent=parent, params=params)

    def prefix_key(self, seq: SequenceHandle) -> ContentKey:
        """A key naming everything ``seq`` holds so far; pass it as ``parent=`` to chain."""
        return self.seqs.prefix_key(seq)

    def chain_key(self, seq: SequenceHandle, modality: str) -> ContentKey:
        """A key of ``modality`` naming the sequence's chain as it stands (the parent of what
        follows a group attended elsewhere, whose chain the local table carries)."""
        return self.keys.chain(modality=modality, chain_digest=self.seqs.sequence(seq).chain,
                               tenant_salt=self.keyer.salt(seq.tenant))

    def device_bytes(self, modality: str) -> int:
        """Bytes of ``modality``'s device pool (every page, used or not)."""
        pool = self.pools[modality]
        return pool.num_pages * pool.spec.page_bytes

    def shard_key(self, key: ContentKey, shard: str) -> ContentKey:
        """The key of one shard of ``key``'s group (a tensor-parallel rank's heads, a pipeline
        stage's layers: ``KeyMaker.shard``); ``key`` must be this cache's."""
        return self.keys.shard(key, shard)

    def state_key(self, key: ContentKey, modality: str) -> ContentKey:
        """The key of the recurrent state after ``key``'s group in the pool ``modality``
        (``KeyMaker.state``); ``key`` must be this cache's."""
        return self.keys.state(key, modality)

    # ------------------------------------------------------------------ sequences
    def create_sequence(self, tenant: str | None = None) -> SequenceHandle:
        return self.seqs.create(tenant)

    def sequence(self, seq: SequenceHandle) -> SequenceTable:
        """The sequence's table (segments, views by modality and by key)."""
        return self.seqs.sequence(seq)

    def append(self, seq: SequenceHandle, modality: str, k: torch.Tensor, v: torch.Tensor,
               *, tokens: Sequence[int] | None = None, new_run: bool = False) -> None:
        """Append tokens' K/V (``[num_layers, n, num_kv_heads, head_dim]``) to the sequence.

        ``tokens`` (their ids) name the content for the prefix chain; without them the chain
        hashes the K/V bytes. ``new_run``: the tokens start a segment of their own instead of
        extending the tail run (a boundary the caller needs: an embedded pool places a group
        attended elsewhere between the two)."""
        self.seqs.append(seq, modality, k, v, tokens=tokens, new_run=new_run)

    def attach(self, seq: SequenceHandle, key: ContentKey) -> None:
        """Reference a stored group at the sequence's next position (no copy). A prefix-dependent
        group only where the sequence holds the prefix it was derived under (``PrefixMismatchError``
        otherwise, nothing changed); a content-only group anywhere."""
        self.seqs.attach(seq, key)

    def attach_placed(self, seq: SequenceHandle, key: ContentKey) -> None:
        """``attach`` without the prefix check: ``seq`` holds only some parts of a bigger
        sequence (a cluster sequence's run or proxy on a pool) whose client checked the key's
        place in it. The tenant check stays."""
        self.seqs.attach(seq, key, placed=True)

    def check_attach(self, seq: SequenceHandle, key: ContentKey) -> None:
        """The checks ``attach`` makes (``ForeignKeyError``, ``PrefixMismatchError``,
        ``UnknownKeyError`` for a released sequence), with nothing attached: for a group the
        sequence will attend where it lives, on another node."""
        self.seqs.check_attach(seq, key)

    def chain_elsewhere(self, seq: SequenceHandle, key: ContentKey) -> None:
        """The sequence's chain extended by ``key``'s group, attended where it lives (another
        node), so that its later keys derive as after a local ``attach``; no tokens added."""
        self.seqs.chain_elsewhere(seq, key)

    def release(self, seq: SequenceHandle) -> None:
        """Drop the sequence's references; its private runs are freed, shared groups stay cached.
        Reservations of it that are not fully written (a step that failed part-way) end here:
        their runs are unpinned and freed with the rest, and writing to them is refused."""
        self.seqs.release(seq, (self.planner.compiled, self.engine.steps))

    # ------------------------------------------------------------------ shared groups
    def contains(self, key: ContentKey) -> bool:
        return self.shared.contains(key)

    def put(self, key: ContentKey, k: torch.Tensor, v: torch.Tensor, *, generated: bool = False) -> bool:
        """Store a group's K/V once; ``False`` (and nothing written) when it is already held.
        ``k, v``: ``[num_layers, n, num_kv_heads, head_dim]``, or block-split ``[num_layers,
        blocks, page_size, num_kv_heads, head_dim]`` (an engine's blocks staged as it lays them,
        any strides): each run of pages is then one strided copy from its run of blocks.
        ``generated``: the KV of tokens a model generated (an answer a next turn may repeat):
        the eviction policy admits it on probation, and its puts and hits are counted apart
        (``decode_puts``, ``decode_hits``)."""
        return self.shared.put(key, k, v, generated=generated)

    def put_embedding(self, key: ContentKey, x: torch.Tensor) -> bool:
        """Store encoder outputs ``[n_tokens, width]`` under a content-only key."""
        return self.shared.put_embedding(key, x)

    def get_embedding(self, key: ContentKey) -> torch.Tensor:
        """A copy of the stored encoder outputs ``[n_tokens, width]``."""
        return self.shared.get_embedding(key)

    # ------------------------------------------------------------------ attention
    def attention(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                  groups: Iterable[ContentKey] | None = None, causal: bool = True,
                  scale: float | None = None, modalities: Iterable[str] | None = None) -> torch.Tensor:
        """Attention of ``q [n_q, num_q_heads, head_dim]`` over the sequence's pages.

        Queries are the last ``n_q`` positions; causal by absolute position; ``groups`` restricts
        the keys to those groups (cross-attention)."""
        return self.planner.attention(seq, layer, q, groups=groups, causal=causal, scale=scale,
                                      modalities=modalities)

    def attention_state(self, seq: SequenceHandle, layer: int, q: torch.Tensor, *,
                        groups: Iterable[ContentKey] | None = None, causal: bool = True,
                        scale: float | None = None, q_positions: torch.Tensor | None = None,
                        modalities: Iterable[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``: the partial state that merges exactly with others (other tiers, nodes)."""
        return self.planner.attention_state(seq, layer, q, groups=groups, causal=causal, scale=scale,
                                            q_positions=q_positions, modalities=modalities)

    def attention_state_parts(self, parts: Sequence[tuple[SequenceHandle, Iterable[ContentKey] | None, int, int | None]],
                              layer: int, q: torch.Tensor, q_positions: torch.Tensor, *,
                              causal: bool = True, scale: float | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` over parts of local sequences that hold pieces of a bigger sequence
        (a pool's runs and proxies of a cluster sequence), all in one call: part ``(seq, keys,
        offset, start)`` adds the segments of ``seq`` (those of ``keys`` when given; only the one
        at local position ``start`` when given) at ``local position + offset``; ``q_positions``
        are positions of the bigger sequence. A segment named by two parts is refused."""
        return self.planner.attention_state_parts(parts, layer, q, q_positions, causal=causal, scale=scale)

    # ------------------------------------------------------------------ the engine's surface
    def reserve(self, seq: SequenceHandle, modality: str, n: int, *,
                tokens: Sequence[int] | None = None, new_run: bool = False) -> Reservation:
        """Add ``n`` tokens to ``seq`` whose K/V will arrive one layer at a time
        (``write_layer``). Their pages stay on the device until every layer is written.
        ``tokens`` (their ids) name them in the prefix chain; without them the run is unique
        (its prefix never matches another sequence's). ``new_run``: start a run of their own
        (one that ``seal`` can turn into a shared group)."""
        return self.engine.reserve(seq, modality, n, tokens=tokens, new_run=new_run)

    def write_layer(self, res: Reservation, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer (``k, v [n, num_kv_heads, head_dim]``) of a reservation's tokens."""
        self.engine.write_layer(res, layer, k, v)

    def seal(self, seq: SequenceHandle, key: ContentKey, run: Reservation | None = None) -> bool:
        """Make a run of the sequence the shared group ``key``, in place (no copy): later
        sequences of the tenant ``attach`` it. The run is the sequence's last one, or with
        ``run`` the one that reservation started (``reserve(new_run=True)``): a step that
        reserved several runs (a prefill over a text span and an image) seals each. The run must
        be fully written. A prefix-dependent ``key`` must be derived under the prefix the run
        follows (``PrefixMismatchError`` otherwise, as for ``attach``). ``False`` (the run stays
        private) when ``key`` is already held or the run has left the device."""
        return self.engine.seal(seq, key, run)

    def attention_batch(self, seqs: Sequence[SequenceHandle], layer: int, q: torch.Tensor,
                        q_indptr: torch.Tensor | Sequence[int], *,
                        groups: Sequence[Iterable[ContentKey] | None] | None = None,
                        causal: bool = True, scale: float | None = None) -> torch.Tensor:
        """Attention for a batch of sequences in one call: rows ``q_indptr[b]:q_indptr[b+1]`` of
        ``q [total_q, num_q_heads, head_dim]`` are the last queries of ``seqs[b]``; ``groups[b]``
        restricts sequence ``b`` to those groups (cross-attention). Device pages of every
        sequence go through one kernel launch per pool."""
        return self.engine.attention_batch(seqs, layer, q, q_indptr, groups=groups, causal=causal,
                                           scale=scale)

    def attention_batch_state(self, seqs: Sequence[SequenceHandle], layer: int, q: torch.Tensor,
                              q_indptr: torch.Tensor | Sequence[int], *,
                              groups: Sequence[Iterable[ContentKey] | None] | None = None,
                              causal: bool = True, scale: float | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``attention_batch``'s ``(out, lse)``."""
        return self.engine.attention_batch_state(seqs, layer, q, q_indptr, groups=groups,
                                                 causal=causal, scale=scale)

    # ------------------------------------------------------------------ tiers, leases and export
    def lease(self, key: ContentKey, ttl: float = 30.0) -> Lease:
        """Protect a group from eviction for ``ttl`` seconds (a read or transfer in progress)."""
        return self.residency.lease(key, ttl)

    def release_lease(self, lease: Lease) -> None:
        self.residency.release_lease(lease)

    def read_group(self, key: ContentKey, *, lease: Lease | None = None,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A stored group's ``(k, v)`` ``[num_layers, n, num_kv_heads, head_dim]``, from whichever
        tier holds it (export, transfer to another node): new CPU tensors, or ``out`` (two
        tensors of that shape and dtype, any device and strides, or block-split ``[num_layers,
        n / page_size, page_size, num_kv_heads, head_dim]`` for a group of whole pages: an
        engine's staging in its own block layout), which is returned. The pages
        are copied once, run by run, straight into the result (a disk group is read into a
        reused staging buffer first). With a ``lease``, the copy is returned only if the lease
        was still live when it finished (``LeaseExpiredError`` otherwise): memory reused
        meanwhile is never returned."""
        return self.residency.read_group(key, lease=lease, out=out)

    def read_groups(self, keys: Sequence[ContentKey], *,
                    out: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``read_group`` of several groups in one call: the disk reads all start first and run
        side by side (the mover's workers, up to ``max_inflight_bytes``), the groups in memory
        are copied meanwhile. ``out``: one ``(k, v)`` pair per key, or ``None``."""
        return self.residency.read_groups(keys, out=out)

    def inventory(self) -> list[tuple[ContentKey, str, int]]:
        """Every stored shared group: ``(key, tier name, bytes)`` (registries rebuild from it)."""
        return self.residency.inventory()

    def holds(self, keys: Iterable[ContentKey]) -> list[bool]:
        """Whether each key is stored in some tier, counting no hit or miss (a transfer's check,
        not a use)."""
        return self.residency.holds(keys)

    def flush(self) -> None:
        """Wait for the copies in flight (background spills, prefetches, the write-behind's
        queue) and apply them; the wait is outside the lock, bounded in time."""
        if self.durable is not None:
            self.durable.drain()
        self.residency.flush()

    def prefetch(self, key: ContentKey) -> bool:
        """Start bringing a disk-resident group up to host memory; ``True`` if a copy started."""
        return self.residency.prefetch(key)

    def export_pages(self, key: ContentKey, *, copy: bool = True) -> GroupPages:
        """A held group's pages as one page-major ``uint8`` buffer, with its token count and the
        xxh3 of each page (``import_pages`` checks them: a transfer is a verified read). One copy
        from the device; from the host tier its verified pages (their digests are the entry's
        own); from disk one verified read (``CorruptDataError``: the group is dropped); bytes
        past the last token are zeros. ``copy=False``: a device group on the CPU whose pages are
        one run comes back as a *view* of the arena (hold a lease while reading it).
        ``UnknownKeyError`` when the key is not held."""
        return self.page_io.export(key, copy=copy)

    def import_pages(self, key: ContentKey, pages: GroupPages) -> bool:
        """Store a group from ``export_pages``' bytes (read in place, one copy run by run into
        fresh pages, filled outside the lock); ``False`` and nothing changed when ``key`` is held
        already (or another thread imported it meanwhile). ``ShapeError`` for a buffer or
        checksums of the wrong size; ``CorruptDataError`` (counted) when a page does not match its
        checksum. Pages taken and not kept are given back."""
        return self.page_io.import_(key, pages)

    # ------------------------------------------------------------------ what a serving process asks
    def group_info(self, key: ContentKey) -> GroupInfo | None:
        """A snapshot of the shared group ``key`` (``None`` when not held); no hit counted."""
        return self.holdings.group_info(key)

    def group_infos(self) -> list[GroupInfo]:
        """Snapshots of every shared group held, in one look under the lock."""
        return self.holdings.group_infos()

    def indexed(self, keys: Iterable[ContentKey]) -> list[bool]:
        """Whether each key is held right now, as the index stands (unlike ``holds``, finished
        copies in flight are not applied first); no hit or miss counted."""
        return self.holdings.indexed(keys)

    def drop_unreferenced(self, keys: Iterable[ContentKey]) -> list[ContentKey]:
        """Let go of the groups among ``keys`` that nothing references, pins or leases (an
        explicit move elsewhere, not an eviction: not counted as one); returns those dropped."""
        return self.holdings.drop_unreferenced(keys)

    def page_usage(self) -> PageUsage:
        """Device pages in use against the pages of cached device groups (a leak check)."""
        return self.holdings.page_usage()

    def groups_lost(self) -> int:
        """How many groups left so far other than by a drop (evicted at the bottom, or a corrupt
        copy forgotten): cheap, for telling when to look which ones."""
        return self.holdings.groups_lost()

    # ------------------------------------------------------------------ stats and life cycle
    def stats(self) -> CacheStats:
        stats = self.residency.stats()
        if self.durable is not None:
            stats.counters.update(self.durable.gauges())
        return stats

    def close(self) -> None:
        """Wait for in-flight copies (the write-behind's queue first), then close the lower tiers
        (files stay for a restart)."""
        if self.durable is not None:
            self.durable.close()
        self.residency.close()

    def __enter__(self) -> TieredKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
