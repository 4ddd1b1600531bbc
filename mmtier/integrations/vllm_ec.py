"""vLLM encoder-cache connector: encoder outputs as mmtier ``embedding`` groups.

    ec_transfer_config = {"ec_connector": "MMTierECConnector",
                          "ec_connector_module_path": "mmtier.integrations.vllm_ec",
                          "ec_role": "ec_both",
                          "ec_connector_extra_config": {"mmtier_config": "configs/x.yaml",
                                                        "mmtier_embed_modality": "vision_embed"}}

An item's key is SHA-256 of vLLM's identifier under the server-side tenant
(``mmtier_tenant``); the group is content-only, so every request and every instance sharing
the cache reuses it. The scheduler asks ``has_cache_item`` and lists the items to load; the
worker reads them into vLLM's ``encoder_cache`` before the model gathers embeddings and saves
what the encoder computed. An item that fails to load (corrupt, evicted meanwhile) fails its
request through ``take_unavailable_requests``: vLLM re-runs the encoder when it is re-issued.

Across instances (``"mmtier_cluster": {...}``, see ``engine_cache``): the scheduler never waits on
the cluster. vLLM asks ``ensure_cache_available`` before it schedules a waiting request with
media: the items it needs that are not held here start one registry lookup (and a pull of each
item held elsewhere, one call per item) on the link's thread, and the answer is ``False``
("defer the request") while that runs, ``True`` once it is done; ``has_cache_item`` answers from
this process's cache alone (what the pull landed is in it). A failed pull is a miss: the encoder
runs. A saved item is written through to the node's store and published on the link's thread.
With the worker in a process of its own (vLLM's ``ray`` or ``mp`` executor) the scheduler only
locates the items (the same deferral) and the worker pulls them before loading.
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

from ..content import ContentKey
from ..errors import ConfigError, MMTierError
from .engine_cache import open_shared, report_for, tenant_from_extra
from .vllm import SPLIT_BACKENDS
from .vllm_metrics import MMTierECPromMetrics, MMTierECStats

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
MAX_LOCATED = 4096          # split scheduler: items the cluster holds, remembered (LRU) for has_cache_item


@dataclass
class _Wait:
    """A request's items looked for in the cluster: the lookup (and pulls) in flight."""

    future: Future
    identifiers: list[str]
    settled: bool = False


@dataclass
class MMTierECMetadata(ECConnectorMetadata):
    loads: dict[str, list[str]] = field(default_factory=dict)      # identifier -> request ids


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
        self.cache, self.link = open_shared(extra)      # link None: this process's cache alone
        self.report = report_for(self.cache)
        self.split = vllm_config.parallel_config.distributed_executor_backend in SPLIT_BACKENDS
        self.tenant = tenant_from_extra(extra)
        self.modality = extra.get("mmtier_embed_modality", "vision_embed")
        if self.cache.cfg.spec(self.modality).kind != "embedding":
            raise ConfigError(f"{self.modality!r} must hold embedding payloads", ("mmtier_embed_modality",))
        self._loads: dict[str, list[str]] = {}
        self._failed: set[str] = set()             # worker: requests whose item failed to load
        self._unavailable: set[str] = set()        # scheduler: the same, reported back
        self._waits: dict[str, _Wait] = {}         # scheduler: request id -> its cluster lookup
        self._located: OrderedDict[str, None] = OrderedDict()   # split scheduler: held elsewhere

    def key(self, identifier: str) -> ContentKey:
        return self.cache.content_key(self.modality, b"vllm-ec\x00" + identifier.encode(), tenant=self.tenant)

    # ------------------------------------------------------------------ scheduler side
    def has_cache_item(self, identifier: str) -> bool:
        """Whether the item is held here (or, for a split scheduler, was located in the cluster
        by ``ensure_cache_available``): a local answer, no cluster call."""
        return self.cache.contains(self.key(identifier)) or identifier in self._located

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """``False`` while the request's items are being looked for (and pulled) in the cluster,
        so vLLM defers it a step instead of waiting; ``True`` when nothing needs looking for
        or the lookup is done (whatever it found). One lookup per request."""
        if self.link is None or not self.is_consumer:
            return True
        wait = self._waits.get(request.request_id)
        if wait is None:
            wanted = [f.identifier for f in request.mm_features
                      if f.mm_position.offset + f.mm_position.length > num_computed_tokens]
            keys = [self.key(i) for i in wanted]
            missing = [(i, k) for i, k, here in zip(wanted, keys, self.cache.holds(keys))
                       if not here and i not in self._located]
            if not missing:
                return True
            ids, keys = [i for i, _ in missing], [k for _, k in missing]
            future = self.link.found_async(keys) if self.split else self.link.pull_async(keys, leading=False)
            wait = self._waits[request.request_id] = _Wait(future, ids)
        if wait.settled:
            return True
        if not wait.future.done():
            return False
        wait.settled = True
        if self.split and wait.future.exception() is None:
            for identifier, found in zip(wait.identifiers, wait.future.result()):
                if found:
                    self._located[identifier] = None
                    self._located.move_to_end(identifier)
            while len(self._located) > MAX_LOCATED:
                self._located.popitem(last=False)
        return True

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._waits.pop(request.request_id, None)
        return False, None

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        if self.is_consumer and self.has_cache_item(identifier):
            self._loads.setdefault(identifier, []).append(request.request_id)

    def build_connector_meta(self, scheduler_output) -> MMTierECMetadata:
        meta, self._loads = MMTierECMetadata(self._loads), {}
        return meta

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
            self.link.pull([self.key(i) for i in meta.loads if i not in encoder_cache], leading=False)
        for identifier, req_ids in meta.loads.items():
            if identifier in encoder_cache:
                continue
            try:
                x = self.cache.get_embedding(self.key(identifier))
            except MMTierError as exc:
                log.warning("mmtier: encoder output %s failed to load (%s)", identifier, exc)
                self._failed.update(req_ids)
                continue
            encoder_cache[identifier] = x if device is None else x.to(device, non_blocking=True)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if not self.is_producer:
            return
        x = encoder_cache[mm_hash]
        key = self.key(mm_hash)
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
