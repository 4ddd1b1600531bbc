"""vLLM encoder-cache connector: encoder outputs as mmtier ``embedding`` groups.

    ec_transfer_config = {"ec_connector": "MMTierECConnector",
                          "ec_connector_module_path": "mmtier.integrations.vllm_ec",
                          "ec_role": "ec_both",
                          "ec_connector_extra_config": {"mmtier_config": "configs/x.yaml",
                                                        "mmtier_embed_modality": "vision_embed"}}

An item's key is the digest mmtier computes over the item's processed inputs
(``vllm.inputs_digest`` of ``mm_features[i].data``: the pixels as the model sees them) under the
server-side tenant (``mmtier_tenant``), never vLLM's identifier, which a client may choose
(``multi_modal_uuids``): two images sent under one uuid never share an encoder output. The group
is content-only, so every request and every instance sharing the cache reuses it. vLLM's
``has_cache_item`` passes the identifier alone; the scheduler answers it only for an identifier
of the request it is scheduling (``ensure_cache_available``, which vLLM calls just before, gives
the request; its items' keys are computed once per request), and ``False`` for one it has no
digest for (the encoder runs). ``update_state_after_alloc`` checks the item it then loads is the
one it answered for (else the request fails, never a wrong output) and lists the items to load
and to save with their keys; the worker reads them into vLLM's ``encoder_cache`` before the
model gathers embeddings and saves what the encoder computed under the key the scheduler sent
(an item with none is not saved). An item that fails to load (corrupt, evicted meanwhile) fails its
request through ``take_unavailable_requests``: vLLM re-runs the encoder when it is re-issued.

Across instances (``"mmtier_cluster": {...}``, see ``engine_cache``): ``has_cache_item`` asks the
registry for an item not held here (one lookup) and, held elsewhere, pulls it whole (one call)
before answering, so the scheduler's wait is bounded by one round trip and one transfer (a
failure is a miss: the encoder runs); a saved item is written through to the node's store and
published on the link's thread. With the worker in a process of its own (vLLM's ``ray`` or
``mp`` executor) the scheduler only locates the item and the worker pulls it before loading.
"""

from __future__ import annotations

import logging
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
from .engine_cache import open_shared, tenant_from_extra
from .vllm import SPLIT_BACKENDS, inputs_digest

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


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
        self.cache, self.link = open_shared(extra)      # link None: this process's cache alone
        self.split = vllm_config.parallel_config.distributed_executor_backend in SPLIT_BACKENDS
        self.tenant = tenant_from_extra(extra)
        self.modality = extra.get("mmtier_embed_modality", "vision_embed")
        if self.cache.cfg.spec(self.modality).kind != "embedding":
            raise ConfigError(f"{self.modality!r} must hold embedding payloads", ("mmtier_embed_modality",))
        self._loads: dict[str, list[str]] = {}
        self._keys: dict[str, ContentKey] = {}
        self._req_keys: dict[str, dict[str, ContentKey | None]] = {}   # request id -> its items' keys
        self._current: dict[str, ContentKey | None] = {}    # the request being scheduled
        self._answered: dict[str, ContentKey] = {}          # identifier -> key has_cache_item held
        self._failed: set[str] = set()             # worker: requests whose item failed to load
        self._unavailable: set[str] = set()        # scheduler: the same, reported back

    def item_key(self, feature: Any) -> ContentKey | None:
        """The key of a media item's encoder output (a ``MultiModalFeatureSpec``): the digest of
        its processed inputs; ``None`` when they are not at hand (nothing cached for it)."""
        digest = inputs_digest(feature.data)
        if digest is None:
            return None
        return self.cache.content_key(self.modality, b"vllm-ec\x00" + digest, tenant=self.tenant)

    # ------------------------------------------------------------------ scheduler side
    def _request_keys(self, request: Request) -> dict[str, ContentKey | None]:
        """Identifier -> key of a request's items, hashed once per request; an identifier that
        names two different items in it (one uuid, two images) gets ``None``."""
        keys = self._req_keys.get(request.request_id)
        if keys is None:
            keys = {}
            for f in request.mm_features or []:
                key = self.item_key(f)
                keys[f.identifier] = key if keys.get(f.identifier, key) == key else None
            self._req_keys[request.request_id] = keys
        return keys

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        self._current = self._request_keys(request)
        return True

    def has_cache_item(self, identifier: str) -> bool:
        self._answered.pop(identifier, None)
        key = self._current.get(identifier)
        if key is None:                        # no digest for it here: never the identifier alone
            return False
        held = self.cache.contains(key)
        if not held and self.link is not None:
            held = (self.link.locate if self.split else self.link.pull)([key]) == 1
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
