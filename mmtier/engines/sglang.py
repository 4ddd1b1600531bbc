"""SGLang HiCache storage backend: HiCache's L3 pages as mmtier groups.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "mmtier",
            "module_path": "mmtier.engines.sglang", "class_name": "MMTierHiCacheStorage",
            "mmtier_config": "configs/x.yaml", "interface_v1": 1}'

One SGLang page (``page_size`` tokens, every layer, K and V) is one group of the configured
text modality; its key is SHA-256 of SGLang's page hash (which already chains the prefix)
under the server-side tenant and the tensor-parallel rank, so ranks holding different heads
never share. A request's ``cache_salt`` (and ``extra_key``) is already in that page hash:
SGLang seeds its storage hash chains with them (``mem_cache.utils.storage_namespace_seed``);
its storage API passes nothing else per request. Pages move through the flat page API
(``get`` / ``set`` and batches, a page in the host pool's own layout) or zero-copy
(``batch_get_v1`` / ``batch_set_v1``), which reads from and writes into the registered host
pool's pages in place. A page that fails verification is a miss (``None`` / ``False``), never
wrong KV.

Across instances (``"mmtier_cluster": {...}`` in the extra config, see ``connector_cache``):
``exists`` / ``batch_exists`` (SGLang asks them from its prefetch thread) look the pages not
held here up in **one** registry call and pull the leading run held elsewhere into the local
cache (one call per page group), so the ``batch_get`` that follows finds them here; a failed
pull is a miss. Pages a ``set`` / ``batch_set`` stored are written through to the node's store
and published, one publish per batch, on the link's own thread.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from ..content import ContentKey
from ..errors import ConfigError, MMTierError, ShapeError
from .connector_cache import open_shared, tenant_from_extra

log = logging.getLogger(__name__)
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class MMTierHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        extra = storage_config.extra_config or {}
        if storage_config.is_mla_model:
            raise ConfigError("mmtier's HiCache backend stores MHA pages; MLA is not supported", ("is_mla_model",))
        self.cache, self.link = open_shared(extra)      # link None: this process's cache alone
        self.tenant = tenant_from_extra(extra)
        self.modality = extra.get("mmtier_text_modality", "text")
        if self.cache.cfg.spec(self.modality).kind != "kv":
            raise ConfigError(f"{self.modality!r} must hold kv payloads", ("mmtier_text_modality",))
        self.rank = {"tp_rank": storage_config.tp_rank, "tp_size": storage_config.tp_size,
                     "pp_rank": storage_config.pp_rank, "pp_size": storage_config.pp_size}
        self.mem_pool_host = None

    def register_mem_pool_host(self, mem_pool_host) -> None:
        cfg = self.cache.cfg
        if mem_pool_host.layout not in LAYOUTS:
            raise ConfigError(f"host pool layout {mem_pool_host.layout!r}: mmtier reads {LAYOUTS}",
                              ("hicache_mem_layout",))
        got = (mem_pool_host.layer_num, mem_pool_host.head_num, mem_pool_host.head_dim, mem_pool_host.dtype)
        want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.spec(self.modality).torch_dtype)
        if got != want:
            raise ConfigError(f"host pool (layers, heads, head_dim, dtype) {got} != mmtier's {want}",
                              ("num_layers", "num_kv_heads", "head_dim", "dtype"))
        self.mem_pool_host = mem_pool_host

    def key(self, sglang_key: str) -> ContentKey:
        return self.cache.content_key(self.modality, b"sglang\x00" + sglang_key.encode(),
                                      tenant=self.tenant, params=self.rank)

    # ------------------------------------------------------------------ page layouts
    def _page_kv(self, page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[layers, page_size, heads, head_dim]`` views of one page in the host layout."""
        pool = self._pool()
        L, P, H, D = pool.layer_num, pool.page_size, pool.head_num, pool.head_dim
        flat_shape = {"layer_first": (2, L, P, H, D), "page_first": (2, P, L, H, D),
                      "page_first_direct": (2, 1, L, P, H, D)}[pool.layout]
        if page.dim() == 1:              # a flat page: a view, never a silent copy
            if page.numel() != 2 * L * P * H * D:
                raise ShapeError(f"a page holds {2 * L * P * H * D} values, got {page.numel()}")
            page = page.view(flat_shape)
        if tuple(page.shape) != flat_shape:
            raise ShapeError(f"a {pool.layout} page is {flat_shape}, got {tuple(page.shape)}")
        if pool.layout == "page_first":
            page = page.transpose(1, 2)
        elif pool.layout == "page_first_direct":
            page = page[:, 0]
        return page[0], page[1]

    def _pool(self):
        if self.mem_pool_host is None:
            raise ConfigError("no host pool registered (SGLang calls register_mem_pool_host first)",
                              ("mem_pool_host",))
        return self.mem_pool_host

    def _store(self, sglang_keys: list[str], pages) -> list[bool]:
        """Store each page; the ones new here go to the cluster in one batch (with a link)."""
        done, new = [], []
        for sglang_key, page in zip(sglang_keys, pages, strict=True):
            try:
                k, v = self._page_kv(page)
                key = self.key(sglang_key)
                if self.cache.put(key, k, v):
                    new.append(key)
                done.append(True)
            except MMTierError as exc:
                log.warning("mmtier: page %s not stored: %s", sglang_key, exc)
                done.append(False)
        if self.link is not None and new:
            self.link.share(new)
        return done

    def _load(self, sglang_key: str, page: torch.Tensor) -> bool:
        """Fill ``page`` (a flat buffer or a host-pool view) in place; ``False`` on a miss."""
        try:
            k, v = self.cache.read_group(self.key(sglang_key))
        except MMTierError:
            return False
        dst_k, dst_v = self._page_kv(page)
        if dst_k.shape != k.shape:
            return False
        dst_k.copy_(k)
        dst_v.copy_(v)
        return True

    # ------------------------------------------------------------------ the flat page API
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        page = target_location if target_location is not None else self._pool().get_dummy_flat_data_page()
        return page if self._load(key, page) else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
                  ) -> list[torch.Tensor | None]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self._store([key], [value])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self._store(keys, values))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading keys are held (one pass, stopping at the first miss); with a link,
        the rest are looked up in one registry call and the leading run held elsewhere pulled."""
        for i, key in enumerate(keys):
            if not self.cache.contains(self.key(key)):
                if self.link is None:
                    return i
                return i + self.link.pull([self.key(k) for k in keys[i:]])
        return len(keys)

    # ------------------------------------------------------------------ zero copy
    def _host_pages(self, keys: list[str], host_indices: torch.Tensor) -> list[torch.Tensor]:
        pool = self._pool()
        if host_indices.numel() != len(keys) * pool.page_size:
            raise ShapeError(f"{len(keys)} keys need {len(keys) * pool.page_size} host indices, "
                             f"got {host_indices.numel()}")
        starts = host_indices[:: pool.page_size].tolist()
        return [pool.get_data_page(int(s), flat=False) for s in starts]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        return [self._load(k, page) for k, page in zip(keys, self._host_pages(keys, host_indices), strict=True)]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        return self._store(keys, self._host_pages(keys, host_indices))

    def clear(self) -> None:
        """SGLang's "flush the L3": nothing to do, mmtier's groups are content-addressed."""

    def get_stats(self):
        return self.cache.stats()
