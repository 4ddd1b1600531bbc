"""The worker side of mmtier's vLLM connector (``connector.MMTierConnector`` forwards vLLM's model
runner calls here): vLLM's KV tensors, checked against the cache (``register_kv_caches``), and
the copies between them and the cache that each step's metadata (``meta``, from the
scheduler side) asks for.

``start_load_kv`` reads the groups to load in a background thread; ``wait_for_layer_load``
copies that layer's part into vLLM's tensor; ``save_kv_layer`` copies each saved group's part of
that layer into a staging buffer; ``wait_for_save`` hands the complete groups to a writer
thread, which stores them (and shares them through the cluster link). A group of whole vLLM
blocks is staged as vLLM lays its blocks out (``copy``); on the CPU it is saved straight
from vLLM's blocks (``direct``) or copied out of them by the writer thread (``deferred``), and
the next step waits for those reads (``wait_direct_saves``) before any block is written. A group
that fails to load is reported (``get_block_ids_with_load_errors``) and vLLM recomputes it.
Hybrid engines load while the request waits (``hybrid.AsyncLoads``). See ``connector``'s
docstring for the whole data path.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from ...content import ContentKey
from ...errors import ConfigError, MMTierError, ShapeError
from . import copy as vllm_copy
from . import hybrid as vllm_hybrid
from .meta import GroupCopy, MMTierConnectorMetadata
from .setup import ConnectorSetup

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 60.0


@dataclass
class _Staged:
    """A group's copy on the worker (a save being staged, or a load read): with ``blocks`` (the
    group is whole vLLM blocks, its pages vLLM's blocks), ``stage`` is laid out as vLLM's tensors
    (``copy.new_stage``) and ``k, v`` are its block-split views; otherwise ``k, v`` are
    ``[layers, n, heads, head_dim]`` moved slot by slot."""

    op: GroupCopy
    k: torch.Tensor
    v: torch.Tensor
    blocks: list[int] | None = None          # vLLM's block ids of positions [lo, hi), in order
    stage: torch.Tensor | None = None
    layers: set[int] = field(default_factory=set)
    direct: bool = False                     # k and v are vLLM's own blocks (EngineBlocks)
    deferred: bool = False                   # copied out of vLLM's blocks by the writer thread


class MMTierConnectorWorker:
    """See the module docstring; ``setup``: what it shares with the scheduler side."""

    def __init__(self, setup: ConnectorSetup):
        self.setup = setup
        self.cache, self.link, self.block_size, self.shape = setup.cache, setup.link, setup.block_size, setup.shape
        self.hybrid, self.scheme, self.states = setup.hybrid, setup.scheme, setup.states
        self._key = setup.key
        self.layers: dict[str, torch.Tensor] = {}       # vLLM's KV tensors, by layer name
        self._layer_index: dict[str, int] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="mmtier-load")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mmtier-save")
        self._saving: set[Future] = set()
        self.reading_blocks: list[Future] = []  # direct saves still reading vLLM's blocks
        self._flushing: list[Future] = []       # this step's flushes: reading_blocks from its end
        # the generated tokens' groups this worker saved: groups, tokens, bytes, seconds the
        # writer spent storing them, seconds this thread spent handing them over (flush)
        self.decode_saves = {"groups": 0, "tokens": 0, "bytes": 0, "store_s": 0.0, "flush_s": 0.0}
        self._loading: list[tuple[GroupCopy, _Staged | None, Future]] = []
        self._staged: dict[ContentKey, _Staged] = {}
        self._stages = vllm_copy.StagePool()     # stages reused: a fresh one costs its first touch
        self._failed_blocks: set[int] = set()
        self._async = (vllm_hybrid.AsyncLoads(self._reader, lambda key: self.cache.read_group(key),
                                              self.cache.cfg.head_dim, self._read_state, self.hybrid)
                       if self.hybrid is not None else None)
        self._state_views: list[tuple[torch.Tensor, ...]] = []     # the recurrent layers' state tensors
        # request -> (end, rows): its state where a decode step last ended on a block boundary
        # (the writer thread's; _flush_states)
        self._marks: dict[str, tuple[int, list[torch.Tensor]]] = {}

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
        self.layers = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    def start_load_kv(self, meta: MMTierConnectorMetadata, forward_context) -> None:
        self.wait_direct_saves()              # before a load writes any block
        if not self.layers:
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
                self._async.submit(meta.loads, [(t, self.hybrid.layer_group[name]) for name, t in self.layers.items()],
                                   self._key, meta.state_loads, self._state_views)
            return
        first = next(iter(self.layers.values()), None)
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
                or any(t.is_inference() for t in self.layers.values())):   # the reader thread
            return None                                # writes outside vLLM's inference mode
        blocks = vllm_copy.aligned_blocks(op.slots, bs)
        if blocks is None:
            return None
        try:
            return vllm_copy.engine_blocks(list(self.layers.values()), self.cache.cfg.head_dim, blocks)
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
        kv_layer = self.layers[layer_name]
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

    def save_kv_layer(self, meta: MMTierConnectorMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
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
            engine = vllm_copy.engine_blocks(list(self.layers.values()), self.cache.cfg.head_dim, blocks)
        except ShapeError:                 # layers of differing shapes: the stage path
            return None
        return _Staged(op, engine, engine, direct=True)

    def flush(self, meta: MMTierConnectorMetadata) -> None:
        """Save ``meta.flushes`` (groups whose KV earlier steps wrote: a request's generated
        tokens) off the forward: on the CPU the writer thread reads them from vLLM's blocks,
        elsewhere they are copied to a stage here, on vLLM's stream. Called as the step starts,
        before vLLM writes any block; with ``flush_wait`` (some of those blocks go to another
        request this step) the reads end before this returns, else before the next step's."""
        if self.states and (meta.state_marks or meta.flush_states):
            self._flush_states(meta)
        if not meta.flushes or not self.layers:
            return
        t0 = time.perf_counter()
        cfg, first = self.cache.cfg, next(iter(self.layers.values()))
        staged = []
        for op in meta.flushes:
            st = None
            if op.group_slots is None:       # hybrid: each layer through its group's table (_copy_out)
                st = self._direct_save(op, first) or self._stage_for(op, first, whole_group=False)
            if st is None:
                shape = (cfg.num_layers, op.hi - op.lo, cfg.num_kv_heads, cfg.head_dim)
                st = _Staged(op, first.new_empty(shape), first.new_empty(shape))
            if not st.direct and first.device.type == "cpu":
                st.deferred = True
            elif not st.direct:
                try:
                    self._copy_out(st)
                except MMTierError as exc:   # best effort: a later miss
                    log.warning("mmtier: decode save of %r skipped: %s", op.key, exc)
                    continue
            staged.append(st)
        event = None
        if first.is_cuda:
            event = torch.cuda.Event()
            event.record()
        fut = self._writer.submit(self._store, staged, event)
        self._saving.add(fut)
        fut.add_done_callback(self._saving.discard)
        if meta.flush_wait:
            self.reading_blocks.append(fut)
            self.wait_direct_saves()
        else:
            self._flushing.append(fut)
        self.decode_saves["flush_s"] += time.perf_counter() - t0

    def _flush_states(self, meta: MMTierConnectorMetadata) -> None:
        """The recurrent states of ``meta.flush_states`` and ``meta.state_marks``, copied out of
        vLLM's blocks now (before this step moves or frees any), stored by the writer thread
        after this step's flushes; a mark is kept (in host memory) until its request's finish
        or preemption saves the part that ends there, or its next mark."""
        if not self._state_views:
            return
        n = len(self._state_views[0])

        def rows(op: vllm_hybrid.StateCopy) -> list[torch.Tensor]:
            return [vllm_hybrid.state_rows(self._state_views, self.hybrid.layer_blocks(op), i) for i in range(n)]

        marks = [(op.req_id, op.end, rows(op)) for op in meta.state_marks]
        states = [(op, rows(op) if op.whole else None) for op in meta.flush_states]
        event = None
        if self._state_views[0][0].is_cuda:
            event = torch.cuda.Event()
            event.record()
        fut = self._writer.submit(self._store_decode_states, marks, states, event)
        self._saving.add(fut)
        fut.add_done_callback(self._saving.discard)

    def _store_decode_states(self, marks: list, states: list, event) -> None:
        """The writer thread's half of ``_flush_states``: marks kept, states stored (a state op
        without rows takes its request's mark where it ends there; none else: a later miss)."""
        if event is not None:
            event.synchronize()
        for req_id, end, rows in marks:
            self._marks[req_id] = (end, [r.cpu() for r in rows])
        stored = []
        for op, rows in states:
            if rows is None:
                mark = self._marks.get(op.req_id)
                if mark is None or mark[0] != op.end:
                    log.debug("mmtier: no state after %d for %s's last decode group: not saved", op.end, op.req_id)
                    continue
                rows = mark[1]
            stored.append((op.key, rows))
        self._store_states(stored)

    def wait_direct_saves(self) -> None:
        """Wait until no save reads vLLM's blocks any more (see the module docstring)."""
        pending, self.reading_blocks = self.reading_blocks, []
        for fut in pending:
            try:
                fut.result(timeout=LOAD_TIMEOUT_S)
            except TimeoutError:
                # the put is still running; the blocks must not be written under it
                self.reading_blocks.append(fut)
                raise
            except Exception as exc:  # noqa: BLE001 - a save is best effort: a later miss, said here
                log.warning("mmtier: a save from vLLM's blocks failed (%r); its groups stay unsaved", exc)

    def wait_for_save(self, meta: MMTierConnectorMetadata | None) -> None:
        """Hand this step's complete groups to the writer thread. Staged copies are the
        connector's own, so vLLM may reuse those blocks at once; direct and deferred saves (on
        the CPU) read vLLM's blocks until the next step's ``handle_preemptions`` or
        ``bind_connector_metadata``, which wait for them."""
        self.reading_blocks += self._flushing     # the next step waits for this step's flushes
        self._flushing = []
        staged, self._staged = self._staged, {}
        layers = self.cache.cfg.num_layers
        done = [st for st in staged.values() if len(st.layers) == layers]
        if not done:
            return
        saves = meta.state_saves if self.states and meta is not None else []
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
            self.reading_blocks.append(fut)

    def _snapshot_states(self, saves: list[vllm_hybrid.StateCopy], saved: set[ContentKey]
                         ) -> list[tuple[ContentKey, list[torch.Tensor]]]:
        """The states this step ended on, copied out of vLLM's blocks now (vLLM moves a request's
        state to another block at its next step and frees this one after)."""
        if not saves or not self._state_views:
            return []
        n = len(self._state_views[0])
        return [(op.key, [vllm_hybrid.state_rows(self._state_views, self.hybrid.layer_blocks(op), i)
                          for i in range(n)])
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
                t0 = time.perf_counter()
                if st.deferred:
                    self._copy_out(st)
                if self.cache.put(key, st.k, st.v, generated=st.op.decode):
                    stored.append(key)
                    if st.op.decode:
                        n = st.op.hi - st.op.lo
                        self.decode_saves["groups"] += 1
                        self.decode_saves["tokens"] += n
                        self.decode_saves["bytes"] += n * self.cache.cfg.spec(key.modality).token_bytes
                if st.op.decode:
                    self.decode_saves["store_s"] += time.perf_counter() - t0
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
                kv_layer = self.layers[name]
                if st.op.group_slots is not None:    # hybrid: this layer's group's table
                    slots = st.op.group_slots[self.hybrid.layer_group[name]]
                    if bool((slots < 0).any()):
                        raise MMTierError(f"a sliding window let positions of [{st.op.lo}, {st.op.hi}) go")
                    vllm_copy.gather(kv_layer, slots.to(kv_layer.device), head_dim, st.k[layer], st.v[layer])
                elif st.blocks is not None:          # vLLM's blocks as they lie, run by run
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
        if self.states and finished_req_ids:     # marks dropped after their last flush, on its thread
            fut = self._writer.submit(lambda done=set(finished_req_ids): [self._marks.pop(r, None) for r in done])
            self._saving.add(fut)
            fut.add_done_callback(self._saving.discard)
        if self._async is None:
            return KVConnectorTransferResults()
        released, loaded, failed = self._async.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=released, finished_recving=loaded,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        self.wait_for_saves()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
