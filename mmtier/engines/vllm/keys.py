"""How a vLLM request's prompt and media become mmtier keys: the one place they are made.

vLLM's scheduler-side connectors call these (``MMTierConnector``: ``KeyScheme.plan``, the
chained segments of the prompt; ``MMTierECConnector``: ``embedding_key``, an item's encoder
output), and so does a router that asks the cluster where a request's groups live before it
picks a replica (``mmtier.serve.affinity_router``, over the ``EngineCoreRequest`` vLLM's own
renderer and input processor make of the request): a key made anywhere else would never match.
Nothing here imports vLLM; media are keyed by the digest of their processed inputs.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...cache import TieredKVCache
from ...config import CacheConfig
from ...content import ContentKey
from ...errors import ConfigError
from ..connector_cache import tenant_from_extra
from .plan import DEFAULT_MODALITIES, MediaItem, RequestPlan, fork_keys, plan_request


def media_of(request: Any) -> list[MediaItem]:
    """A vLLM request's media items (``mm_features``) as plain data, each with the digest of
    its processed inputs (computed here; ``None`` where the scheduler was not given them)."""
    return [MediaItem(f.mm_position.offset, f.mm_position.length, f.identifier, f.modality,
                      inputs_digest(f.data))
            for f in (request.mm_features or [])]


# digests of the items this process saw, by the item object (weakly: an entry goes with its item):
# vLLM's scheduler asks for a request's items several times (the KV connector's plans, the
# encoder-cache connector), and hashing a picture's inputs costs ~0.5 ms a time
# (single dict operations, atomic under the GIL: a weakref callback may run inside any of them)
_DIGESTS: dict[int, tuple[weakref.ref, bytes | None]] = {}


def inputs_digest(item: Any) -> bytes | None:
    """SHA-256 over an item's processed inputs (``MultiModalKwargsItem``: field name, dtype,
    shape and bytes of every tensor, in name order); ``None`` when any of them is missing.
    Computed once per item object (vLLM never changes a request's processed inputs)."""
    if item is None:
        return None
    held = _DIGESTS.get(id(item))
    if held is not None and held[0]() is item:
        return held[1]
    digest = _digest(item)
    try:
        ref = weakref.ref(item, lambda _, key=id(item): _forget(key))
    except TypeError:                    # an object without weak references: not remembered
        return digest
    _DIGESTS[id(item)] = (ref, digest)
    return digest


def _forget(key: int) -> None:
    held = _DIGESTS.get(key)
    if held is not None and held[0]() is None:
        _DIGESTS.pop(key, None)


def _digest(item: Any) -> bytes | None:
    h = hashlib.sha256(b"mmtier/vllm-mm-inputs\x00")

    def feed(x: Any) -> bool:
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            return True
        if isinstance(x, (list, tuple)):
            h.update(f"[{len(x)}".encode())
            return all(feed(y) for y in x)
        if isinstance(x, (int, float, str, bool)):
            h.update(repr(x).encode())
            return True
        return False

    for name in sorted(item.keys()):
        data = getattr(item[name], "data", None)
        h.update(name.encode() + b"\x00")
        if data is None or not feed(data):
            return None
    return h.digest()


def lora_scope(request: Any) -> str | None:
    """The LoRA adapter a request runs under, as part of its key scope (``None``: the base)."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    return f"lora:{lora.lora_name}:{getattr(lora, 'lora_path', '')}"


def request_scope(tenant: str | None, request: Any, *, lora: bool = True) -> str | None:
    """The scope of every key a vLLM request makes (KV groups, their recurrent states, encoder
    outputs): the server-side tenant (``mmtier_tenant``), then the request's ``cache_salt``,
    then (``lora``) its LoRA adapter; only the server tenant when the request has neither.
    The cache turns it into the key's salt with its secret (``content_key``: HMAC under
    ``key_secret``), so a client's ``cache_salt`` alone names no scope. Every key made for a
    request takes its scope from here (``tests/engines/test_request_scope.py`` checks)."""
    parts = [tenant or ""]
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt/{salt}")
    adapter = lora_scope(request) if lora else None
    if adapter:
        parts.append(adapter)
    return "/".join(parts) if len(parts) > 1 else tenant


@dataclass(frozen=True)
class KeyScheme:
    """How the connector keys a request's prompt, from its extra config: the server-side tenant
    (``mmtier_tenant``), the text modality, the chunk size in blocks and vLLM's modality names
    mapped to mmtier's. The one place keys are made from a vLLM request (``plan``): the
    connector's scheduler side and a router that asks where a request's groups live
    (``mmtier.serve.affinity_router``) both call it."""

    block_size: int
    tenant: str | None = None
    text_modality: str = "text"
    chunk_blocks: int = 16
    modality_map: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, block_size: int) -> KeyScheme:
        extra = extra or {}
        return cls(block_size, tenant_from_extra(extra), extra.get("mmtier_text_modality", "text"),
                   int(extra.get("mmtier_chunk_blocks", 16)), dict(extra.get("mmtier_modalities", {})))

    def scope(self, request: Any) -> str | None:
        """The key scope of the request's KV groups (``request_scope``, with its LoRA adapter)."""
        return request_scope(self.tenant, request)

    def plan(self, cache: TieredKVCache, request: Any, cuts: Sequence[int] = ()) -> RequestPlan:
        """The chained segments of a vLLM request (``prompt_token_ids``, ``mm_features``,
        ``cache_salt``, ``lora_request``: a scheduler's ``Request`` or an ``EngineCoreRequest``),
        its text also cut at ``cuts`` (``plan``: where an earlier prompt's part ended)."""
        return self.plan_tokens(cache, request, list(request.prompt_token_ids or []), cuts)

    def plan_tokens(self, cache: TieredKVCache, request: Any, token_ids: Sequence[int],
                    cuts: Sequence[int] = ()) -> RequestPlan:
        """The chained segments of ``token_ids`` under the request's media and scope: its prompt
        (``plan``), or its prompt and the tokens it generated (the connector's decode saves,
        which are then keyed as the next turn's prompt repeating them will be)."""
        return plan_request(cache, list(token_ids), media_of(request),
                            block_size=self.block_size, tenant=self.scope(request),
                            chunk_blocks=self.chunk_blocks, text_modality=self.text_modality,
                            modality_map=self.modality_map, cuts=cuts)

    def forks(self, cache: TieredKVCache, request: Any, plan: RequestPlan, index: int
              ) -> list[tuple[int, ContentKey]]:
        """``plan.fork_keys`` of the plan's segment ``index`` for this request."""
        return fork_keys(cache, plan, index, list(request.prompt_token_ids or []), block_size=self.block_size,
                         tenant=self.scope(request), text_modality=self.text_modality)


def tower_lora(feature: Any) -> bool:
    """Whether vLLM runs the item's encoder under the request's LoRA adapter: vLLM then names
    the item ``"<adapter>:<mm_hash>"`` (``enable_tower_connector_lora``), else by ``mm_hash``."""
    mm_hash = getattr(feature, "mm_hash", None)
    return mm_hash is not None and feature.identifier != mm_hash


def embedding_scope(tenant: str | None, request: Any, feature: Any) -> str | None:
    """The scope of a request's item's encoder output: ``request_scope`` (the server tenant and
    the request's ``cache_salt``), with the LoRA adapter only where it runs in the encoder."""
    return request_scope(tenant, request, lora=tower_lora(feature))


def embedding_key(cache: TieredKVCache, feature: Any, *, modality: str, tenant: str | None
                  ) -> ContentKey | None:
    """The key of a media item's encoder output (a ``MultiModalFeatureSpec``): the digest of its
    processed inputs under ``tenant`` (the request's ``embedding_scope``), content-only (no
    prefix: every request of that scope shares it); ``None`` when the inputs are not at hand.
    The connector and a router locating the item both call it."""
    digest = inputs_digest(feature.data)
    if digest is None:
        return None
    return cache.content_key(modality, b"vllm-ec\x00" + digest, tenant=tenant)


def embed_pools(cfg: CacheConfig, extra: dict[str, Any]) -> dict[str, str]:
    """vLLM's modality names -> the mmtier pool holding their encoder outputs: every medium in
    ``mmtier_embed_modality`` where the extra config names one, else each in the ``<kv>_embed``
    pool of the KV modality it maps to (``"image"`` and ``"video"`` -> ``vision_embed``,
    ``"audio"`` -> ``audio_embed``; ``mmtier_modalities`` overrides the map) where the cache has
    it. A named pool that is not an embedding pool, or a cache with none, is a ``ConfigError``."""
    one = extra.get("mmtier_embed_modality")
    if one is not None:
        if one not in cfg.modalities or cfg.spec(one).kind != "embedding":
            raise ConfigError(f"{one!r} must hold embedding payloads", ("mmtier_embed_modality",))
        return dict.fromkeys(DEFAULT_MODALITIES, one)
    kv_of = {**DEFAULT_MODALITIES, **dict(extra.get("mmtier_modalities", {}))}
    pools = {medium: f"{kv}_embed" for medium, kv in kv_of.items()
             if f"{kv}_embed" in cfg.modalities and cfg.spec(f"{kv}_embed").kind == "embedding"}
    if not pools:
        raise ConfigError("the mmtier cache has no encoder-output pool: give one of kind 'embedding' named "
                          "'<modality>_embed' (vision_embed, audio_embed) or name it in mmtier_embed_modality",
                          ("mmtier_embed_modality",))
    return pools
