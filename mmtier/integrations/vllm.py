"""vLLM KV connector: vLLM's paged KV saved to and loaded from the worker's embedded mmtier cache.

    kv_transfer_config = {"kv_connector": "MMTierConnector",
                          "kv_connector_module_path": "mmtier.integrations.vllm",
                          "kv_role": "kv_both",
                          "kv_connector_extra_config": {"mmtier_host_bytes": "8GiB"}}

The cache's shape (layers, KV heads of this rank, head size, KV dtype, the block size as page
size, the model's media) is read from vLLM (``vllm_shape``); the extra config gives sizes only,
or a preset / inline shape that is then checked against the engine's (a ``ConfigError`` at
startup naming the field and both values) and against the KV tensors vLLM registers.

Scheduler side: a request's prompt becomes chained groups (``vllm_plan``); the hit is the
leading run of held groups in whole blocks, looked up in one pass; where the run stops inside
a text chunk, the part of it an earlier prompt stored (a conversation's last turn ended there)
is looked up too and the prompt planned again with a cut there (``_fork``); ``build_connector_meta``
lists, per step, the groups to load (the hit) and to save (groups whose positions this step
completes). Worker side: ``start_load_kv`` reads the groups in a background thread;
``wait_for_layer_load`` copies that layer's part into vLLM's tensor; ``save_kv_layer`` copies
each saved group's part of that layer into a staging buffer; ``wait_for_save`` hands the
complete groups to a writer thread, which stores them. A group of whole vLLM blocks (a page of
the cache per block) is staged as vLLM lays its blocks out (``vllm_copy.new_stage``): runs of
consecutive blocks move as slices, and the cache copies the stage's block-split K and V into its
pages (and out of them) once; any other group moves slot by slot.

On the CPU such a group is saved with **one** copy instead (``direct`` saves): no stage; the
writer thread ``put``s straight from vLLM's blocks (``vllm_copy.engine_blocks``; the copy into
pages tests for NaN / Inf as it goes, ``native.rows``). vLLM writes its KV blocks only in a
forward pass (attention, and this connector's loads at its start; zeroing or copying blocks
as a step begins), so the next step's ``handle_preemptions`` and ``bind_connector_metadata``,
called before it does, first wait for those puts (vLLM 0.32 calls ``start_load_kv`` after the
forward on steps without synchronous loads): a block freed by a finished or preempted request
and handed to another is never written while a save still reads it. Any other group saved on
the CPU is copied out of vLLM's blocks the same way, by the writer thread after the forward
(``deferred``): no save copies anything between the forward and the step's first token. A group that
fails to load (corrupt file, evicted meanwhile) is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes those blocks (the connector sets vLLM's
``kv_load_failure_policy`` to ``"recompute"``; ``"mmtier_load_failure_policy": "fail"`` keeps
vLLM's default, which fails the request): wrong KV is never written.

Across instances (``"mmtier_cluster": {...}`` in the extra config, see ``connector_cache``): a
request whose groups are not all held here makes **one** batched registry lookup for those it
lacks, on the cache's ``EngineLink`` thread; the leading run held elsewhere is pulled whole into
the local cache (one call per group) and then counts as a hit. Meanwhile
``get_num_new_matched_tokens`` answers ``None`` (vLLM's "ask again at a later step"), so the
scheduler never waits on the cluster (a request that lacks groups here is admitted a step or
more later, once its lookup and pulls are done); a pull that fails is a miss. What the writer thread
stores is written through to the node's store and published, one publish per batch
(``EngineLink.share``): the engine process is no actor and cannot serve exports itself, and the
store's copies outlive it.

Where vLLM runs the worker in another process than the scheduler (``distributed_executor_backend``
``"mp"``, vLLM's default on one device, how ``vllm serve`` and ``LLM`` run; or ``"ray"``, as Ray
Serve LLM does on GPUs), the worker's process owns the cache (pages, tiers) and serves a lookup
channel (``lookup_channel``: a Unix socket named after vLLM's engine id); the scheduler's
process holds keys only (``engine_cache.lookup_only``: no pages, no tiers) and asks the worker
how many of a request's leading groups it holds, one round trip per lookup. With
``mmtier_cluster`` it then *locates* the rest in the registry (one lookup, nothing fetched into
its own cache) and the worker, at load, pulls what its cache lacks (one lookup, one call per
group; that step's first layer waits for it).

A request resumed after preemption is planned again by vLLM (its blocks were freed): its hit
is loaded into its new blocks like a new request's. Keys carry the tenant (``mmtier_tenant``,
then vLLM's ``cache_salt``) and the LoRA adapter (its name and path), so neither tenants nor
adapters ever share KV; media groups are keyed by the digest of the item's processed inputs.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ..content import ContentKey
from ..errors import ConfigError, MMTierError, ShapeError
from . import vllm_copy, vllm_hybrid
from .connector_cache import open_shared, release_shared, report_for
from .lookup_channel import LookupChannel
from .vllm_keys import KeyScheme
from .vllm_metrics import MMTierKVStats, MMTierPromMetrics
from .vllm_plan import RequestPlan, Segment, slots_for
from .vllm_shape import engine_shape, engine_shard

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 60.0
# forks a lookup follows (``_fork``): one per earlier turn of a conversation that ended inside a
# chunk, so a conversation's n-th turn takes up to n - 1; past this many the hit stops there
MAX_FORKS = 64
SPLIT_BACKENDS = ("ray", "mp")       # vLLM executors whose workers run in processes of their own


@dataclass(frozen=True)
class GroupCopy:
    """One group's positions ``[lo, hi)`` (within the group ``[start, end)``) and their slots."""

    req_id: str
    key: ContentKey
    start: int
    end: int
    lo: int
    hi: int
    slots: torch.Tensor          # int64 [hi - lo]
    block_ids: tuple[int, ...]   # the vLLM blocks these slots live in
    # hybrid engines (vllm_hybrid): [kv cache groups, hi - lo] slots per group, -1 where a
    # group holds no block (a sliding window let it go); None with one group
    group_slots: torch.Tensor | None = None


@dataclass
class MMTierConnectorMetadata(KVConnectorMetadata):
    loads: list[GroupCopy] = field(default_factory=list)
    saves: list[GroupCopy] = field(default_factory=list)
    # models with recurrent layers (vllm_hybrid): states to load with a hit, to save this step
    state_loads: list[vllm_hybrid.StateCopy] = field(default_factory=list)
    state_saves: list[vllm_hybrid.StateCopy] = field(default_factory=list)


@dataclass
class _ReqState:
    plan: RequestPlan
    computed: int = 0              # vLLM's locally computed tokens when the hit was asked
    hit: int = 0
    load: bool = False
    block_ids: list[list[int]] = field(default_factory=list)   # vLLM's block table per KV cache group
    saved: int = 0                 # segments [0, saved) are held or queued for saving
    cuts: tuple[int, ...] = ()     # where the plan forks off to an earlier prompt's part (_fork)
    pull: Future | None = None     # the cluster pull of the groups it lacked (once per request)


@dataclass
class _Staged:
    """A group's copy on the worker (a save being staged, or a load read): with ``blocks`` (the
    group is whole vLLM blocks, its pages vLLM's blocks), ``stage`` is laid out as vLLM's tensors
    (``vllm_copy.new_stage``) and ``k, v`` are its block-split views; otherwise ``k, v`` are
    ``[layers, n, heads, head_dim]`` moved slot by slot."""

    op: GroupCopy
    k: torch.Tensor
    v: torch.Tensor
    blocks: list[int] | None = None          # vLLM's block ids of positions [lo, hi), in order
    stage: torch.Tensor | None = None
    layers: set[int] = field(default_factory=set)
    direct: bool = False                     # k and v are vLLM's own blocks (EngineBlocks)
    deferred: bool = False                   # copied out of vLLM's blocks by the writer thread


class MMTierConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. One class for both roles, as vLLM's factory expects."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        par = vllm_config.parallel_config
        self.block_size = vllm_config.cache_config.block_size
        worker = role == KVConnectorRole.WORKER
        # tensor / pipeline parallel: each worker holds its shard (heads, layers) of every group
        self.shard = engine_shard(vllm_config, worker=worker)
        self.split = par.distributed_executor_backend in SPLIT_BACKENDS or self.shard.count > 1
        # the shape is vLLM's, this rank's (any shape the extra config gives is checked against it)
        self.shape = engine_shape(vllm_config, kv_cache_config)
        # vLLM's hybrid allocator: several KV cache groups (full and sliding-window attention),
        # each with its own block table; loads then run asynchronously (vllm_hybrid)
        self.hybrid = vllm_hybrid.kv_groups(kv_cache_config)
        if extra.get("mmtier_cluster") is not None and self.shard.count > 1:
            # refused before anything opens: the registry would have to be asked for every
            # worker's shard keys; not built yet
            raise ConfigError("mmtier_cluster with a tensor- or pipeline-parallel engine is not supported: each "
                              "worker's cache holds its own shard; drop mmtier_cluster (a disk_dir shared by the "
                              "engines still shares the groups) or run tensor_parallel_size 1",
                              ("mmtier_cluster", "tensor_parallel_size"))
        # split: the worker's process owns the cache; the scheduler's makes keys and asks it
        self.cache, self.link = open_shared(extra, lookup=self.split and not worker, engine=self.shape)
        self._released = False
        self.report = report_for(self.cache)
        self._channel = (LookupChannel(self._kv_transfer_config.engine_id or "engine", par.data_parallel_rank,
                                       worker=worker, cache=self.cache, shards=self.shard.count,
                                       shard=self.shard.index, key_of=self._key) if self.split else None)
        # A group that fails to load (corrupt, evicted since the lookup) is recomputed by vLLM:
        # vLLM 0.32 defaults to failing the request instead ("fail"), which only this connector's
        # extra config may keep. vLLM's scheduler reads the policy after it built this connector.
        policy = extra.get("mmtier_load_failure_policy", "recompute")
        if policy not in ("recompute", "fail"):
            raise ConfigError(f"mmtier_load_failure_policy must be 'recompute' or 'fail', got {policy!r}",
                              ("mmtier_load_failure_policy",))
        self._kv_transfer_config.kv_load_failure_policy = policy
        self.scheme = KeyScheme.from_extra(extra, self.block_size)
        # recurrent layers' states: one embedding pool per state tensor (vllm_shape.shape_fields)
        self.states: tuple[str, ...] = ()
        if self.hybrid is not None and self.hybrid.state_layers:
            self.states = self.shape.state_modalities
            missing = [m for m in self.states if m not in self.cache.cfg.modalities
                       or self.cache.cfg.spec(m).kind != "embedding"]
            if missing:
                raise ConfigError(f"modalities: this model's recurrent layers need the embedding pools {missing} "
                                  "(drop the shape fields to have them read from vLLM)", ("modalities",))
        if self.hybrid is not None:
            self.scheme = dataclasses.replace(self.scheme, chunk_blocks=vllm_hybrid.chunk_blocks_within(
                self.hybrid, self.block_size, self.scheme.chunk_blocks))
            log.info("mmtier: vLLM's hybrid allocator is on (%s): loads run while the request waits, "
                     "text chunks of %d blocks", self.hybrid.describe(), self.scheme.chunk_blocks)
        if self.cache.cfg.spec(self.scheme.text_modality).kind != "kv":
            raise ConfigError(f"{self.scheme.text_modality!r} must hold kv payloads", ("mmtier_text_modality",))
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        # tokens the scheduler told vLLM it would load, and tokens it then asked the worker to
        # load (equal unless a hit went unloaded); loads for requests resumed after preemption
        self.counts = {"hit_tokens": 0, "load_tokens": 0, "resumed_loads": 0}
        self._async_ops: list[GroupCopy] = []     # hybrid: loads issued at allocation, sent next
        self._async_states: list[vllm_hybrid.StateCopy] = []
        self._async_reqs: set[str] = set()        # hybrid: requests with a load (their blocks wait)
        # worker side
        self._layers: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="mmtier-load") if worker else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mmtier-save") if worker else None
        self._saving: set[Future] = set()
        self._reading_blocks: list[Future] = []  # direct saves still reading vLLM's blocks
        self._loading: list[tuple[GroupCopy, _Staged | None, Future]] = []
        self._staged: dict[ContentKey, _Staged] = {}
        self._stages = vllm_copy.StagePool()     # stages reused: a fresh one costs its first touch
        self._failed_blocks: set[int] = set()
        self._async = (vllm_hybrid.AsyncLoads(self._reader, lambda key: self.cache.read_group(key),
                                              self.cache.cfg.head_dim, self._read_state)
                       if worker and self.hybrid is not None else None)
        self._state_views: list[tuple[torch.Tensor, ...]] = []     # the recurrent layers' state tensors

    def _key(self, key: ContentKey) -> ContentKey:
        """The key this worker's cache holds ``key``'s group under: its shard's, where the
        engine has several workers (``engine_shard``), else the group's own."""
        return key if self.shard.tag is None else self.cache.shard_key(key, self.shard.tag)

    # ------------------------------------------------------------------ scheduler side
    def _plan(self, request: Request) -> _ReqState:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _ReqState(self.scheme.plan(self.cache, request))
        return state

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        state = self._plan(request)
        keys = [s.key for s in state.plan.segments]
        held = self._held(keys)
        if not all(held):          # an earlier prompt ended inside the chunk that missed
            held = self._fork(request, state, held)
            keys = [s.key for s in state.plan.segments]
        if self.link is not None and not all(held):
            if state.pull is None:                     # one lookup (and its pulls) per request
                ask = self.link.locate_async if self.split else self.link.pull_async
                state.pull = ask(keys[held.index(False):])
            if not state.pull.done():
                return None, False                     # vLLM asks again at a later step
            if self.split:                             # held by the cluster: the worker pulls them
                n = held.index(False) + (state.pull.result() if state.pull.exception() is None else 0)
                held = [i < n for i in range(len(keys))]
            else:
                held = self._lookup(keys)              # what was pulled is local now
        state.computed, state.hit = num_computed_tokens, state.plan.hit_tokens(held, self.block_size)
        if self.states:                                # a hit ends where a state is held
            state.hit = self._state_hit(state, held, request.num_tokens)
        state.saved = next((i for i, ok in enumerate(held) if not ok), len(held))
        n = max(0, state.hit - num_computed_tokens)
        return n, self.hybrid is not None and n > 0     # hybrid: loaded while the request waits

    def _state_hit(self, state: _ReqState, held: list[bool], num_tokens: int) -> int:
        """The longest hit whose end holds a state: the end of a held group on a block
        boundary, short of the last token, whose states the cache holds."""
        segs = state.plan.segments
        run = next((i for i, ok in enumerate(held) if not ok), len(held))
        for i in range(run - 1, -1, -1):
            end = segs[i].end
            if end % self.block_size or end > num_tokens - 1:
                continue
            keys = [self.cache.state_key(segs[i].key, m) for m in self.states]
            if self._channel is not None and self._channel.asks:
                if self._channel.leading_held(keys) == len(keys):
                    return end
            elif all(self.cache.contains(k) for k in keys):
                return end
        return 0

    def _state_at(self, req_id: str, state: _ReqState, end: int) -> vllm_hybrid.StateCopy | None:
        """The state after ``[0, end)``: the group ending there and vLLM's state block of it."""
        seg = next((s for s in state.plan.segments if s.end == end), None)
        if seg is None:
            return None
        table = state.block_ids[self.hybrid.state_group] if self.hybrid.state_group < len(state.block_ids) else []
        index = end // self.block_size - 1
        block = table[index] if 0 <= index < len(table) and table[index] != vllm_hybrid.NULL_BLOCK else -1
        return vllm_hybrid.StateCopy(req_id, seg.key, end, block)

    def _held(self, keys: list[ContentKey]) -> list[bool]:
        """Which of ``keys`` are held, as a leading run: the worker's cache through the lookup
        channel where it runs in another process, else this process's."""
        if self._channel is not None and self._channel.asks:
            n = self._channel.leading_held(keys)
            return [i < n for i in range(len(keys))]
        return self._lookup(keys)

    def _first_held(self, keys: list[ContentKey]) -> int | None:
        """The index of the first of ``keys`` held, each looked up in order until one is (one
        round trip where the worker runs in another process); ``None`` when none is."""
        if self._channel is not None and self._channel.asks:
            return self._channel.first_held(keys)
        return next((i for i, key in enumerate(keys) if self.cache.contains(key)), None)

    def _fork(self, request: Request, state: _ReqState, held: list[bool]) -> list[bool]:
        """Where the leading run stops inside a text chunk, the longest part of it an earlier
        prompt stored (its full blocks ended there: a conversation's last turn): the request
        is planned again with a cut there and looked up again (``vllm_plan``). Two lookups per
        fork (the chunk's parts at once, then the new plan), and a few forks per request."""
        for _ in range(MAX_FORKS):
            n = held.index(False) if False in held else len(held)
            forks = self.scheme.forks(self.cache, request, state.plan, n)
            i = self._first_held([key for _, key in forks]) if forks else None
            if i is None:
                break
            state.cuts = tuple(sorted({*state.cuts, forks[i][0]}))
            state.plan = self.scheme.plan(self.cache, request, state.cuts)
            held = self._held([seg.key for seg in state.plan.segments])
            if all(held):
                break
        return held

    def _lookup(self, keys: list[ContentKey]) -> list[bool]:
        """Which keys the cache holds, in one pass that stops at the first miss."""
        held: list[bool] = []
        for key in keys:
            held.append(self.cache.contains(key))
            if not held[-1]:
                break
        return held + [False] * (len(keys) - len(held))

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is not None:
            state.load = num_external_tokens > 0
            if state.load:
                state.hit = state.computed + num_external_tokens
                self.counts["hit_tokens"] += num_external_tokens
                if self.hybrid is not None:       # the request waits for it: load now, once
                    state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
                    self._async_ops += self._loads(request.request_id, state)
                    self._async_reqs.add(request.request_id)
                    if self.states:
                        at = self._state_at(request.request_id, state, state.hit)
                        self._async_states.append(at or vllm_hybrid.StateCopy(request.request_id, None, state.hit, -1))

    def build_connector_meta(self, scheduler_output) -> MMTierConnectorMetadata:
        meta = MMTierConnectorMetadata(loads=self._async_ops, state_loads=self._async_states)
        self._async_ops, self._async_states = [], []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            if state.load:
                meta.loads += self._loads(new.req_id, state)
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            saves = self._saves(new.req_id, state, max(done, state.hit))
            meta.saves += saves
            self._state_save(meta, new.req_id, state, saves, done)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            if req_id in cached.resumed_req_ids:           # preempted: blocks were rebuilt
                state.block_ids = []
            if cached.new_block_ids[i] is not None:
                tables = cached.new_block_ids[i]
                state.block_ids = [(state.block_ids[g] if g < len(state.block_ids) else []) + list(ids)
                                   for g, ids in enumerate(tables)]
            if state.load:                                 # resumed with a hit: load it again
                meta.loads += self._loads(req_id, state)
                self.counts["resumed_loads"] += 1
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            saves = self._saves(req_id, state, max(done, state.hit))
            meta.saves += saves
            self._state_save(meta, req_id, state, saves, done)
        return meta

    def _state_save(self, meta: MMTierConnectorMetadata, req_id: str, state: _ReqState,
                    saves: list[GroupCopy], done: int) -> None:
        """The state to save with this step's groups: where the step ends on a block boundary
        at the end of a group it saves (vLLM's state of that position is then in its block)."""
        if self.states and saves and saves[-1].end == done and done % self.block_size == 0:
            at = self._state_at(req_id, state, done)
            if at is not None and at.block >= 0:
                meta.state_saves.append(at)

    def _loads(self, req_id: str, state: _ReqState) -> list[GroupCopy]:
        """The copies that load a request's hit into its blocks (once per admission)."""
        state.load = False
        ops = self._copies(req_id, state, state.computed, state.hit)
        self.counts["load_tokens"] += sum(op.hi - op.lo for op in ops)
        return ops

    def _copies(self, req_id: str, state: _ReqState, lo: int, hi: int) -> list[GroupCopy]:
        out = []
        for seg in state.plan.segments:
            a, b = max(lo, seg.start), min(hi, seg.end)
            if a < b:
                out.append(self._copy(req_id, state, seg, a, b))
        return out

    def _saves(self, req_id: str, state: _ReqState, computed: int) -> list[GroupCopy]:
        out, segs = [], state.plan.segments
        while state.saved < len(segs) and segs[state.saved].end <= computed:
            seg = segs[state.saved]
            out.append(self._copy(req_id, state, seg, seg.start, seg.end))
            state.saved += 1
        return out

    def _copy(self, req_id: str, state: _ReqState, seg: Segment, lo: int, hi: int) -> GroupCopy:
        if self.hybrid is not None:       # each layer reads its own group's table
            per_group = vllm_hybrid.group_slots(state.block_ids, lo, hi, self.block_size)
            return GroupCopy(req_id, seg.key, seg.start, seg.end, lo, hi, per_group[0], (), per_group)
        slots = slots_for(state.block_ids[0], lo, hi, self.block_size)
        blocks = tuple(sorted({int(s) // self.block_size for s in slots}))
        return GroupCopy(req_id, seg.key, seg.start, seg.end, lo, hi, torch.from_numpy(slots), blocks)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator's ``request_finished``: a request that had a load keeps its
        blocks until the worker says the load no longer writes them (``finished_sending``)."""
        self._reqs.pop(request.request_id, None)
        if request.request_id in self._async_reqs:
            self._async_reqs.discard(request.request_id)
            return True, None
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cfg = self.cache.cfg
        # an fp8 KV cache is uint8 in vLLM: viewed as the pages' fp8 dtype (the same bytes)
        kv_caches = {name: vllm_copy.as_page_dtype(t, cfg.spec(self.scheme.text_modality).torch_dtype)
                     for name, t in kv_caches.items()
                     if self.hybrid is None or name in self.hybrid.layer_group}   # not recurrent layers
        if len(kv_caches) != cfg.num_layers:
            raise ConfigError(f"num_layers: vLLM has {len(kv_caches)} attention layers, the mmtier config "
                              f"{cfg.num_layers}", ("num_layers",))
        for name, tensor in kv_caches.items():       # the tensors themselves, not only the config
            if tensor.dtype != cfg.spec(self.scheme.text_modality).torch_dtype:
                raise ConfigError(f"dtype: vLLM's KV cache of {name} is {tensor.dtype}, the mmtier config's "
                                  f"pages {cfg.dtype}", ("dtype",))
            try:
                k, _ = vllm_copy.kv_views(tensor, cfg.head_dim)
            except ShapeError as exc:
                raise ConfigError(f"head_dim: {exc}", ("head_dim",)) from None
            if k.shape[-2] != cfg.num_kv_heads:
                raise ConfigError(f"num_kv_heads: vLLM's KV cache of {name} has {k.shape[-2]} KV heads, the "
                                  f"mmtier config {cfg.num_kv_heads}", ("num_kv_heads",))
        first = next(iter(kv_caches.values()), None)
        if first is not None and first.device.type == "cpu" and first.dim() == 4 and first.dtype in (
                torch.float32, torch.float16, torch.bfloat16):
            # vLLM's CPU backend lays blocks out per attention ISA: check the one it runs
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(first.dtype, first.shape[2], cfg.head_dim)
            if vllm_copy.check_cpu_layout(first, cfg.head_dim, isa) is False:
                # whole blocks still move exactly (as bytes); parts of blocks (a media item's
                # group) would not: a model with media is refused, a text model keeps whole blocks
                if self.shape is not None and self.shape.media:
                    raise ConfigError(f"vLLM's CPU attention ISA {isa!r} packs its KV blocks in a layout mmtier's "
                                      "connector does not read position by position (it reads 'vec': K "
                                      "[head_dim, block_size], V [block_size, head_dim] per head), and this "
                                      "model's media items are groups of parts of blocks", ("attention_isa",))
                log.warning("mmtier: vLLM's CPU attention ISA %r packs its KV blocks; text groups are whole "
                            "blocks and move exactly, but the pages hold vLLM's packed bytes", isa)
        self._layers = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Called at the start of every step, before vLLM updates its batch (where it may zero
        # new blocks or copy blocks): the saves still reading vLLM's blocks end first.
        self._wait_direct_saves()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Called before every forward. vLLM 0.32 calls start_load_kv *after* the forward on
        # steps without synchronous loads, so this is the place to wait for the saves that
        # still read vLLM's blocks: a block freed and handed to another request is written
        # by this very forward.
        super().bind_connector_metadata(connector_metadata)
        self._wait_direct_saves()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._wait_direct_saves()             # before a load writes any block
        meta = self._get_connector_metadata()
        if not self._layers:
            self.register_kv_caches({name: layer.kv_cache for name, layer in
                                     forward_context.no_compile_layers.items()
                                     if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)})
        if self.link is not None and meta.loads:
            # first on the reader thread: what this cache lacks (a scheduler in another process
            # located it, or it was evicted since) pulled in one lookup; none when all is here
            self._reader.submit(self.link.pull, [self._key(op.key) for op in meta.loads])
        if self.states and not self._state_views:      # the recurrent layers' (conv, ssm, ...) tensors
            self._state_views = [tuple(forward_context.no_compile_layers[name].kv_cache)
                                 for name in self.hybrid.state_layers]
        if self._async is not None:           # hybrid: loaded on the reader thread, the request waits
            if meta.loads or meta.state_loads:
                self._async.submit(meta.loads, [(t, self.hybrid.layer_group[name]) for name, t in self._layers.items()],
                                   self._key, meta.state_loads, self._state_views)
            return
        first = next(iter(self._layers.values()), None)
        self._loading = []
        for op in meta.loads:
            direct = self._direct_blocks(op, first)
            if direct is not None:         # the whole group into vLLM's blocks: one copy, no stage
                self._loading.append((op, None, self._reader.submit(self.cache.read_group, self._key(op.key),
                                                                    out=direct)))
                continue
            staged = self._stage_for(op, first, whole_group=True)
            out = (staged.k, staged.v) if staged is not None else None
            self._loading.append((op, staged, self._reader.submit(self.cache.read_group, self._key(op.key),
                                                                  out=out)))

    def _direct_blocks(self, op: GroupCopy, kv_layer: torch.Tensor | None) -> vllm_copy.EngineBlocks | None:
        """vLLM's own blocks of every layer as the destination of ``op``'s read, where the load is
        the whole group, its positions whole blocks of vLLM's and its pages those blocks
        (``read_group`` then writes them in place); ``None`` otherwise (a stage or the slot path)."""
        bs, spec = self.block_size, self.cache.cfg.spec(op.key.modality)
        if (kv_layer is None or spec.page_size != bs or op.lo != op.start or op.hi != op.end
                or op.start % bs or op.end % bs
                or any(t.is_inference() for t in self._layers.values())):   # the reader thread
            return None                                # writes outside vLLM's inference mode
        blocks = vllm_copy.aligned_blocks(op.slots, bs)
        if blocks is None:
            return None
        try:
            return vllm_copy.engine_blocks(list(self._layers.values()), self.cache.cfg.head_dim, blocks)
        except ShapeError:                 # layers of differing shapes: the stage path
            return None

    def _stage_for(self, op: GroupCopy, kv_layer: torch.Tensor | None, *, whole_group: bool) -> _Staged | None:
        """A stage laid out as vLLM's tensors for ``op``'s group, where its positions are whole
        blocks of vLLM's and its pages are those blocks (``None`` otherwise: the slot path).
        ``whole_group``: the stage holds all of the group (a load reads it whole), else
        positions ``[lo, hi)``."""
        if kv_layer is None:
            return None
        bs, spec = self.block_size, self.cache.cfg.spec(op.key.modality)
        lo = op.start if whole_group else op.lo
        hi = op.end if whole_group else op.hi
        if spec.page_size != bs or lo % bs or hi % bs or op.lo % bs or op.hi % bs:
            return None
        blocks = vllm_copy.aligned_blocks(op.slots, bs)
        if blocks is None:
            return None
        stage = self._stages.take(kv_layer, self.cache.cfg.num_layers, (hi - lo) // bs)
        k, v = vllm_copy.stage_kv(stage, self.cache.cfg.head_dim)
        return _Staged(op, k, v, blocks, stage)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._loading:
            return
        kv_layer = self._layers[layer_name]
        last = layer == len(self._layer_index) - 1
        for op, staged, fut in self._loading:
            try:
                k, v = fut.result(timeout=LOAD_TIMEOUT_S)
            except (MMTierError, TimeoutError) as exc:
                log.warning("mmtier: load of %r failed (%s); vLLM recomputes its blocks", op.key, exc)
                self._failed_blocks.update(op.block_ids)
                if last and staged is not None and fut.done():
                    self._stages.give(staged.stage)
                continue
            if isinstance(k, vllm_copy.EngineBlocks):  # read straight into vLLM's blocks
                continue
            if staged is not None:                   # blocks [lo, hi) of the group, as they lie
                first = (op.lo - op.start) // self.block_size
                src = staged.stage[layer].narrow(vllm_copy.block_axis(kv_layer), first, len(staged.blocks))
                vllm_copy.copy_blocks(src, None, kv_layer, staged.blocks)
                if last:
                    self._stages.give(staged.stage)
                continue
            a, b = op.lo - op.start, op.hi - op.start
            vllm_copy.scatter(kv_layer, op.slots.to(kv_layer.device), self.cache.cfg.head_dim,
                              k[layer, a:b].to(kv_layer.device, non_blocking=True),
                              v[layer, a:b].to(kv_layer.device, non_blocking=True))
        if last:
            self._loading = []

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        cfg = self.cache.cfg
        for op in meta.saves:
            staged = self._staged.get(op.key)
            if staged is None and self.hybrid is not None:   # each layer through its group's table
                shape = (cfg.num_layers, op.hi - op.lo, cfg.num_kv_heads, cfg.head_dim)
                staged = self._staged[op.key] = _Staged(op, kv_layer.new_empty(shape), kv_layer.new_empty(shape))
            if staged is None:
                staged = self._direct_save(op, kv_layer) or self._stage_for(op, kv_layer, whole_group=False)
                if staged is None:
                    shape = (cfg.num_layers, op.hi - op.lo, cfg.num_kv_heads, cfg.head_dim)
                    staged = _Staged(op, kv_layer.new_empty(shape), kv_layer.new_empty(shape))
                # on the CPU the writer thread copies it out of vLLM's blocks after the forward
                # (as a direct save reads them): not in the forward, before the first token
                staged.deferred = not staged.direct and kv_layer.device.type == "cpu"
                self._staged[op.key] = staged
            if op.group_slots is not None:
                slots = op.group_slots[self.hybrid.layer_group[layer_name]]
                if bool((slots < 0).any()):          # a sliding window let some go: the group
                    continue                         # stays incomplete, wait_for_save drops it
                vllm_copy.gather(kv_layer, slots.to(kv_layer.device), cfg.head_dim, staged.k[layer], staged.v[layer])
            elif staged.direct or staged.deferred:   # read from vLLM's blocks by the writer
                pass
            elif staged.blocks is not None:          # vLLM's blocks as they lie, run by run
                vllm_copy.copy_blocks(kv_layer, staged.blocks, staged.stage[layer], None)
            else:
                vllm_copy.gather(kv_layer, op.slots.to(kv_layer.device), cfg.head_dim,
                                 staged.k[layer], staged.v[layer])
            staged.layers.add(layer)

    def _direct_save(self, op: GroupCopy, kv_layer: torch.Tensor) -> _Staged | None:
        """A save of ``op``'s group straight from vLLM's blocks (one copy, by the writer thread),
        where the group is whole blocks of vLLM's on the CPU and its pages are those blocks;
        ``None`` otherwise (a stage or the slot path)."""
        bs, spec = self.block_size, self.cache.cfg.spec(op.key.modality)
        if (kv_layer.device.type != "cpu" or spec.page_size != bs or op.lo != op.start
                or op.hi != op.end or op.start % bs or op.end % bs):
            return None
        blocks = vllm_copy.aligned_blocks(op.slots, bs)
        if blocks is None:
            return None
        try:
            engine = vllm_copy.engine_blocks(list(self._layers.values()), self.cache.cfg.head_dim, blocks)
        except ShapeError:                 # layers of differing shapes: the stage path
            return None
        return _Staged(op, engine, engine, direct=True)

    def _wait_direct_saves(self) -> None:
        """Wait until no save reads vLLM's blocks any more (see the module docstring)."""
        pending, self._reading_blocks = self._reading_blocks, []
        for fut in pending:
            try:
                fut.result(timeout=LOAD_TIMEOUT_S)
            except TimeoutError:
                # the put is still running; the blocks must not be written under it
                self._reading_blocks.append(fut)
                raise
            except Exception as exc:  # noqa: BLE001 - a save is best effort: a later miss, said here
                log.warning("mmtier: a save from vLLM's blocks failed (%r); its groups stay unsaved", exc)

    def wait_for_save(self) -> None:
        """Hand this step's complete groups to the writer thread. Staged copies are the
        connector's own, so vLLM may reuse those blocks at once; direct and deferred saves (on
        the CPU) read vLLM's blocks until the next step's ``handle_preemptions`` or
        ``bind_connector_metadata``, which wait for them."""
        staged, self._staged = self._staged, {}
        layers = self.cache.cfg.num_layers
        done = [st for st in staged.values() if len(st.layers) == layers]
        if not done:
            return
        saves = self._get_connector_metadata().state_saves if self.states and self.has_connector_metadata() else []
        states = self._snapshot_states(saves, {st.op.key for st in done})
        event = None
        if any(not st.direct and st.k.is_cuda for st in done):   # gathers queued on vLLM's stream
            event = torch.cuda.Event()
            event.record()
        fut = self._writer.submit(self._store, done, event)
        self._saving.add(fut)
        fut.add_done_callback(self._saving.discard)
        if states:                 # after this step's groups, on the same thread
            later = self._writer.submit(self._store_states, states)
            self._saving.add(later)
            later.add_done_callback(self._saving.discard)
        if any(st.direct or st.deferred for st in done):
            self._reading_blocks.append(fut)

    def _snapshot_states(self, saves: list[vllm_hybrid.StateCopy], saved: set[ContentKey]
                         ) -> list[tuple[ContentKey, list[torch.Tensor]]]:
        """The states this step ended on, copied out of vLLM's blocks now (vLLM moves a request's
        state to another block at its next step and frees this one after)."""
        if not saves or not self._state_views:
            return []
        n = len(self._state_views[0])
        return [(op.key, [vllm_hybrid.state_rows(self._state_views, op.block, i) for i in range(n)])
                for op in saves if op.key in saved]

    def _store_states(self, states: list[tuple[ContentKey, list[torch.Tensor]]]) -> None:
        for key, rows in states:
            try:
                for modality, r in zip(self.states, rows):
                    self.cache.put_embedding(self._key(self.cache.state_key(key, modality)), r)
            except MMTierError as exc:            # best effort: a dropped save is a later miss
                log.warning("mmtier: save of the state after %r skipped: %s", key, exc)

    def _read_state(self, key: ContentKey, index: int) -> torch.Tensor:
        return self.cache.get_embedding(self._key(self.cache.state_key(key, self.states[index])))

    def _store(self, done: list[_Staged], event) -> None:
        if event is not None:
            event.synchronize()
        stored = []
        for st in done:
            try:
                key = self._key(st.op.key)
                if st.deferred:
                    self._copy_out(st)
                if self.cache.put(key, st.k, st.v):
                    stored.append(key)
            except MMTierError as exc:           # best effort: a dropped save is a later miss
                log.warning("mmtier: save of %r skipped: %s", st.op.key, exc)
            finally:
                if st.stage is not None:
                    self._stages.give(st.stage)
        if self.link is not None and stored:
            self.link.share(stored)              # to the node store and the registry, off this thread

    def _copy_out(self, st: _Staged) -> None:
        """A deferred save's copy out of vLLM's blocks, every layer (the writer thread, after
        the forward that wrote them; the next step waits for it before any block is written)."""
        head_dim = self.cache.cfg.head_dim
        with torch.inference_mode():                 # the slot path's k, v were made in the forward
            for name, layer in self._layer_index.items():
                kv_layer = self._layers[name]
                if st.blocks is not None:            # vLLM's blocks as they lie, run by run
                    vllm_copy.copy_blocks(kv_layer, st.blocks, st.stage[layer], None)
                else:
                    vllm_copy.gather(kv_layer, st.op.slots, head_dim, st.k[layer], st.v[layer])

    def wait_for_saves(self, timeout: float = LOAD_TIMEOUT_S) -> None:
        """Block until every save handed to the writer so far is stored (tests, shutdown)."""
        for fut in list(self._saving):
            fut.result(timeout=timeout)
        if self.link is not None:
            self.link.wait(timeout)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Hybrid engines: loads done (failed ones among them, which vLLM recomputes) and the
        finished requests whose blocks no load writes any more."""
        if self._async is None:
            return KVConnectorTransferResults()
        released, loaded, failed = self._async.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=released, finished_recving=loaded,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ------------------------------------------------------------------ metrics (vllm_metrics)
    def get_kv_connector_stats(self) -> MMTierKVStats | None:
        """What this process's cache counted since its last report (``None`` within a second
        of it, or when another connector of the cache just reported)."""
        data = self.report.take()
        return None if data is None else MMTierKVStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> MMTierKVStats:
        return MMTierKVStats(data=data) if data is not None else MMTierKVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> MMTierPromMetrics:
        return MMTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._reader is not None:
            self.wait_for_saves()
            self._reader.shutdown(wait=True)
            self._writer.shutdown(wait=True)
        if not self._released:             # the last connector of the cache closes it
            self._released = True
            release_shared(self.cache)
