"""vLLM KV connector: vLLM's paged KV saved to and loaded from the worker's embedded mmtier cache.

    kv_transfer_config = {"kv_connector": "MMTierConnector",
                          "kv_connector_module_path": "mmtier.engines.vllm.connector",
                          "kv_role": "kv_both",
                          "kv_connector_extra_config": {"mmtier_host_bytes": "8GiB"}}

The cache's shape (layers, KV heads of this rank, head size, KV dtype, the block size as page
size, the model's media) is read from vLLM (``shape``); the extra config gives sizes only,
or a preset / inline shape that is then checked against the engine's (a ``ConfigError`` at
startup naming the field and both values) and against the KV tensors vLLM registers.

The connector is a thin class over two sides, as vLLM's own ``OffloadingConnector`` is: it
builds what both share (``setup.ConnectorSetup``: the cache, its link, the shape, the key
scheme), then the side for its role, and forwards each of vLLM's calls to it. The scheduler side
(``scheduler``) plans requests and says, each step, what to load and save
(``meta``); the worker side (``worker``) owns vLLM's KV tensors and the copies.

Scheduler side: a request's prompt becomes chained groups (``plan``); the hit is the
leading run of held groups in whole blocks, looked up in one pass; where the run stops inside
a text chunk, the part of it an earlier prompt stored (a conversation's last turn ended there)
is looked up too and the prompt planned again with a cut there (``scheduler``'s fork);
``build_connector_meta`` lists, per step, the groups to load (the hit) and to save (groups whose positions this step
completes). Worker side: ``start_load_kv`` reads the groups in a background thread;
``wait_for_layer_load`` copies that layer's part into vLLM's tensor; ``save_kv_layer`` copies
each saved group's part of that layer into a staging buffer; ``wait_for_save`` hands the
complete groups to a writer thread, which stores them. A group of whole vLLM blocks (a page of
the cache per block) is staged as vLLM lays its blocks out (``copy.new_stage``): runs of
consecutive blocks move as slices, and the cache copies the stage's block-split K and V into its
pages (and out of them) once; any other group moves slot by slot.

On the CPU such a group is saved with **one** copy instead (``direct`` saves): no stage; the
writer thread ``put``s straight from vLLM's blocks (``copy.engine_blocks``; the copy into
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

Prefill and decode on different engines (``pd``): ``kv_role`` ``kv_producer`` answers a request
that asks ``do_remote_decode`` with ``kv_transfer_params`` naming the prompt groups it saved;
``kv_consumer`` waits for the groups a request's params name to be visible (here or in the
cluster, ``mmtier_pd_wait_s``), loads them as any hit, and saves no prompt.

A request resumed after preemption is planned again by vLLM (its blocks were freed): its hit
is loaded into its new blocks like a new request's. Keys carry the tenant (``mmtier_tenant``,
then vLLM's ``cache_salt``) and the LoRA adapter (its name and path), so neither tenants nor
adapters ever share KV; media groups are keyed by the digest of the item's processed inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .meta import MMTierConnectorMetadata
from .metrics import MMTierKVStats, MMTierPromMetrics
from .scheduler import MMTierConnectorScheduler
from .setup import ConnectorSetup
from .worker import LOAD_TIMEOUT_S, MMTierConnectorWorker

if TYPE_CHECKING:
    from vllm.v1.request import Request


class MMTierConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. One class for both roles, as vLLM's factory expects: it holds
    the side of its role (``connector_scheduler`` or ``connector_worker``, the other ``None``)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        worker = role == KVConnectorRole.WORKER
        self.setup = setup = ConnectorSetup(vllm_config, self._kv_transfer_config, kv_cache_config, worker=worker)
        # what both sides share, read here too (tools and tests ask the connector)
        self.block_size, self.shard, self.split, self.shape = setup.block_size, setup.shard, setup.split, setup.shape
        self.hybrid, self.cache, self.link, self.report = setup.hybrid, setup.cache, setup.link, setup.report
        self.scheme, self.states = setup.scheme, setup.states
        self.connector_scheduler = None if worker else MMTierConnectorScheduler(setup)
        self.connector_worker = MMTierConnectorWorker(setup) if worker else None

    @property
    def scheduler(self) -> MMTierConnectorScheduler:
        assert self.connector_scheduler is not None, "a call of vLLM's scheduler on a worker's connector"
        return self.connector_scheduler

    @property
    def worker(self) -> MMTierConnectorWorker:
        assert self.connector_worker is not None, "a call of vLLM's worker on a scheduler's connector"
        return self.connector_worker

    @property
    def counts(self) -> dict[str, int]:
        """The scheduler side's counts: tokens it told vLLM it would load, tokens it asked the
        worker to load, loads of resumed requests."""
        return self.scheduler.counts

    # what the tests read of the sides' state, under the names they read it by
    def _plan(self, request: Request):
        return self.scheduler.plan(request)

    @property
    def _layers(self) -> dict[str, torch.Tensor]:
        return self.worker.layers

    @property
    def _reading_blocks(self) -> list:
        return self.worker.reading_blocks

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> MMTierConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator's ``request_finished``: a request that had a load keeps its
        blocks until the worker says the load no longer writes them (``finished_sending``)."""
        return self.scheduler.request_finished_all_groups(request, block_ids)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Called at the start of every step, before vLLM updates its batch (where it may zero
        # new blocks or copy blocks): the saves still reading vLLM's blocks end first, then
        # the groups of generated tokens are handed over (freed blocks among them are read now)
        self.worker.wait_direct_saves()
        if isinstance(kv_connector_metadata, MMTierConnectorMetadata):
            self.worker.flush(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Called before every forward. vLLM 0.32 calls start_load_kv *after* the forward on
        # steps without synchronous loads, so this is the place to wait for the saves that
        # still read vLLM's blocks: a block freed and handed to another request is written
        # by this very forward.
        super().bind_connector_metadata(connector_metadata)
        self.worker.wait_direct_saves()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self.worker.save_kv_layer(self._get_connector_metadata(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Hand this step's complete groups to the writer thread (``worker``)."""
        self.worker.wait_for_save(self._get_connector_metadata() if self.has_connector_metadata() else None)

    def wait_for_saves(self, timeout: float = LOAD_TIMEOUT_S) -> None:
        """Block until every save handed to the writer so far is stored (tests, shutdown)."""
        if self.connector_worker is not None:
            self.connector_worker.wait_for_saves(timeout)
        elif self.link is not None:
            self.link.wait(timeout)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Hybrid engines: loads done (failed ones among them, which vLLM recomputes) and the
        finished requests whose blocks no load writes any more."""
        return self.worker.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

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
        self.setup.close_channel()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        self.setup.release()             # the last connector of the cache closes it
