"""vLLM encoder-cache connector: encoder outputs as mmtier ``embedding`` groups.

    ec_transfer_config = {"ec_connector": "MMTierECConnector",
                          "ec_connector_module_path": "mmtier.engines.vllm.ec",
                          "ec_role": "ec_both",
                          "ec_connector_extra_config": {"mmtier_config": "configs/x.yaml",
                                                        "mmtier_embed_modality": "vision_embed"}}

Each item's encoder output goes to the embedding pool of its medium (``embed_pools``: an image's
and a video's to ``vision_embed``, a clip's to ``audio_embed``), or every item to the one
``mmtier_embed_modality`` names. An item's key is the digest mmtier computes over the item's processed inputs
(``keys.inputs_digest`` of ``mm_features[i].data``: the pixels as the model sees them) under the
request's scope (``keys.embedding_scope``: the server-side tenant ``mmtier_tenant`` and the
request's ``cache_salt``, as the KV connector's keys; an item of a request without a salt is
under the server tenant alone), never vLLM's identifier, which a client may choose
(``multi_modal_uuids``): two images sent under one uuid never share an encoder output. The group
is content-only, so every request of that scope and every instance sharing the cache reuses it;
another salt (tenant) never does. The scheduler computes the keys and sends them to the worker
in the step's metadata, which loads and saves under those keys only. vLLM's
``has_cache_item`` passes the identifier alone; the scheduler answers it only for an identifier
of the request it is scheduling (``ensure_cache_available``, which vLLM calls just before, gives
the request; its items' keys are computed once per request), and ``False`` for one it has no
digest for (the encoder runs). ``update_state_after_alloc`` checks the item it then loads is the
one it answered for (else the request fails, never a wrong output) and lists the items to load
and to save with their keys; the worker reads them into vLLM's ``encoder_cache`` before the
model gathers embeddings and saves what the encoder computed under the key the scheduler sent
(an item with none is not saved). An item that fails to load (corrupt, evicted meanwhile) fails its
request through ``take_unavailable_requests``: vLLM re-runs the encoder when it is re-issued.

Across instances (``"mmtier_cluster": {...}``, see ``connector_cache``): the scheduler never waits on
the cluster. vLLM asks ``ensure_cache_available`` before it schedules a waiting request with
media: the items it needs that are not held here start one registry lookup (and a pull of each
item held elsewhere, one call per item) on the link's thread, and the answer is ``False``
("defer the request") while that runs, ``True`` once it is done; ``has_cache_item`` answers from
this process's cache alone (what the pull landed is in it). A failed pull is a miss: the encoder
runs. A saved item is written through to the node's store and published on the link's thread.

With the worker in a process of its own (vLLM's default ``mp`` executor, or ``ray``) the worker's
process owns the cache and serves a lookup channel (``lookup_channel``, named after the EC
config's engine id); the scheduler's process holds keys only and asks it whether an item is
held (one local round trip), and with a cluster only locates the items (the same deferral) for
the worker to pull before it loads.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from ...content import ContentKey
from ...errors import MMTierError
from ..connector_cache import open_shared, release_shared, report_for, tenant_from_extra
from .keys import embed_pools, embedding_key, embedding_scope
from .lookup_channel import LookupChannel
from .metrics import MMTierECPromMetrics, MMTierECStats
from .setup import SPLIT_BACKENDS
from .shape import engine_shape, engine_shard

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
MAX_LOCATED = 4096          # split scheduler: items the cluster holds, remembered (LRU) for has_cache_item


@dataclass
class _Wait:
    """A request's items looked for in the cluster: the lookup (and pulls) in flight."""

    future: Future
    keys: list[ContentKey]
    settled: bool = False


@dataclass
class MMTierECMetadata(ECConnectorMetadata):
    loads: dict[str, list[str]] = field(default_factory=dict)      # identifier -> request ids
    keys: dict[str, ContentKey] = field(default_factory=dict)      # identifier -> key (loads, saves)


@dataclass
class MMTierECWorkerMetadata(ECConnectorWorkerMetadata):
    failed_requests: set[str] = field(default_factory=set)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> MMTierECWorkerMetadata:
        assert isinstance(other, MMTierECWorkerMetadata)
        return MMTierECWorkerMetadata(self.failed_requests | other.failed_requests)


class MMTierECConnector(ECConnectorBase):
    def __init__(self, vllm_config, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        extra = vllm_config.ec_transfer_config.ec_connector_extra_config or {}
        par = vllm_config.parallel_config
        worker = role == ECConnectorRole.WORKER
        # tensor / pipeline parallel: vLLM computes the whole encoder output on every worker,
        # so each worker's cache keeps it under the item's own key (a disk directory the
        # workers share holds one file of it) and the scheduler asks them all
        shard = engine_shard(vllm_config, worker=worker)
        self.split = par.distributed_executor_backend in SPLIT_BACKENDS or shard.count > 1
        # split: the worker's process owns the cache; the scheduler's makes keys and asks it
        # the shape is vLLM's (any shape the extra config gives is checked against it); the KV
        # connector of the same engine reads the same, so both share one cache
        self.cache, self.link = open_shared(extra, lookup=self.split and not worker,
                                            engine=engine_shape(vllm_config))
        self._released = False
        self.report = report_for(self.cache)
        self._channel = (LookupChannel("ec-" + (vllm_config.ec_transfer_config.engine_id or "engine"),
                                       par.data_parallel_rank, worker=worker, cache=self.cache,
                                       shards=shard.count, shard=shard.index)
                         if self.split else None)
        self.tenant = tenant_from_extra(extra)
        self.pools = embed_pools(self.cache.cfg, extra)
        self._loads: dict[str, list[str]] = {}
        self._keys: dict[str, ContentKey] = {}
        self._req_keys: dict[str, dict[str, ContentKey | None]] = {}   # request id -> its items' keys
        self._current: dict[str, ContentKey | None] = {}    # the request being scheduled
        self._answered: dict[str, ContentKey] = {}          # identifier -> key has_cache_item held
        self._failed: set[str] = set()             # worker: requests whose item failed to load
        self._unavailable: set[str] = set()        # scheduler: the same, reported back
        self._waits: dict[str, _Wait] = {}         # scheduler: request id -> its cluster lookup
        self._located: OrderedDict[ContentKey, None] = OrderedDict()   # split scheduler: held elsewhere

    def item_key(self, request: Any, feature: Any) -> ContentKey | None:
        """The key of a request's media item's encoder output (a ``MultiModalFeatureSpec``): the
        digest of its processed inputs under the request's scope; ``None`` when they are not at
        hand (nothing cached for it)."""
        pool = self.pools.get(feature.modality)
        if pool is None:                         # a medium with no pool of its own: not cached
            return None
        return embedding_key(self.cache, feature, modality=pool,
                             tenant=embedding_scope(self.tenant, request, feature))

    # ------------------------------------------------------------------ scheduler side
    def _request_keys(self, request: Request) -> dict[str, ContentKey | None]:
        """Identifier -> key of a request's items, hashed once per request; an identifier that
        names two different items in it (one uuid, two images) gets ``None``."""
        keys = self._req_keys.get(request.request_id)
        if keys is None:
            keys = {}
            for f in request.mm_features or []:
                key = self.item_key(request, f)
                keys[f.identifier] = key if keys.get(f.identifier, key) == key else None
            self._req_keys[request.request_id] = keys
        return keys

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Remember the request's items' keys for ``has_cache_item`` (vLLM asks it next, with an
        identifier alone), and with a cluster: ``False`` while the items not held here are being
        looked for (and pulled), so vLLM defers the request a step instead of waiting; ``True``
        when nothing needs looking for or the lookup is done (whatever it found)."""
        keys = self._current = self._request_keys(request)
        if self.link is None or not self.is_consumer:
            return True
        wait = self._waits.get(request.request_id)
        if wait is None:
            wanted = [keys[f.identifier] for f in request.mm_features
                      if f.mm_position.offset + f.mm_position.length > num_computed_tokens
                      and keys.get(f.identifier) is not None]
            missing = [k for k in dict.fromkeys(wanted) if k not in self._located and not self._held(k)]
            if not missing:
                return True
            future = self.link.found_async(missing) if self.split else self.link.pull_async(missing, leading=False)
            wait = self._waits[request.request_id] = _Wait(future, missing)
        if wait.settled:
            return True
        if not wait.future.done():
            return False
        wait.settled = True
        if self.split and wait.future.exception() is None:
            for key, found in zip(wait.keys, wait.future.result()):
                if found:
                    self._located[key] = None
                    self._located.move_to_end(key)
            while len(self._located) > MAX_LOCATED:
                self._located.popitem(last=False)
        return True

    def _held(self, key: ContentKey) -> bool:
        """Held by the cache that loads it: this process's, or the worker's (asked over the
        lookup channel) where the worker runs in a process of its own."""
        if self._channel is not None and self._channel.asks:
            return self._channel.leading_held([key]) == 1
        return self.cache.contains(key)

    def has_cache_item(self, identifier: str) -> bool:
        """Whether the item of the request being scheduled is held (here, by the worker, or
        located in the cluster by ``ensure_cache_available``): no cluster call."""
        self._answered.pop(identifier, None)
        key = self._current.get(identifier)
        if key is None:                        # no digest for it here: never the identifier alone
            return False
        held = key in self._located or self._held(key)
        if held:
            self._answered[identifier] = key
        return held

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        key = self._request_keys(request).get(identifier)
        answered = self._answered.pop(identifier, None)
        if answered is not None:               # vLLM loads it instead of running the encoder
            if answered != key:                # answered for other content: fail, never wrong
                self._unavailable.add(request.request_id)
            elif self.is_consumer:
                self._loads.setdefault(identifier, []).append(request.request_id)
                self._keys[identifier] = key
        elif key is not None:                  # the encoder runs: the worker saves it under key
            self._keys[identifier] = key

    def build_connector_meta(self, scheduler_output) -> MMTierECMetadata:
        meta = MMTierECMetadata(self._loads, self._keys)
        self._loads, self._keys = {}, {}
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._req_keys.pop(request.request_id, None)
        self._waits.pop(request.request_id, None)
        return False, None

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.ec_connector_worker_meta
        if isinstance(meta, MMTierECWorkerMetadata):
            self._unavailable |= meta.failed_requests

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    # ------------------------------------------------------------------ worker side
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        device = kwargs.get("device")
        if self.link is not None and meta.loads:     # what a scheduler elsewhere located, first
            self.link.pull([meta.keys[i] for i in meta.loads if i not in encoder_cache], leading=False)
        for identifier, req_ids in meta.loads.items():
            if identifier in encoder_cache:
                continue
            try:
                x = self.cache.get_embedding(meta.keys[identifier])
            except MMTierError as exc:
                log.warning("mmtier: encoder output %s failed to load (%s)", identifier, exc)
                self._failed.update(req_ids)
                continue
            encoder_cache[identifier] = x if device is None else x.to(device, non_blocking=True)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        meta = self._connector_metadata
        key = meta.keys.get(mm_hash) if isinstance(meta, MMTierECMetadata) else None
        if not self.is_producer or key is None:      # no digest of its inputs: not saved
            return
        x = encoder_cache[mm_hash]
        try:
            stored = self.cache.put_embedding(key, x.detach().reshape(-1, x.shape[-1]))
        except MMTierError as exc:                  # best effort: a dropped save is a later miss
            log.warning("mmtier: encoder output %s not saved: %s", mm_hash, exc)
            return
        if stored and self.link is not None:
            self.link.share([key])

    def build_connector_worker_meta(self) -> MMTierECWorkerMetadata | None:
        if not self._failed:
            return None
        meta, self._failed = MMTierECWorkerMetadata(self._failed), set()
        return meta

    # ------------------------------------------------------------------ metrics (vllm_metrics)
    def get_ec_connector_stats(self) -> MMTierECStats | None:
        data = self.report.take()
        return None if data is None else MMTierECStats(data=data)

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> MMTierECStats:
        return MMTierECStats(data=data) if data is not None else MMTierECStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> MMTierECPromMetrics:
        return MMTierECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if not self._released:             # the last connector of the cache closes it
            self._released = True
            release_shared(self.cache)
