"""Drives mmtier's SGLang HiCache backend the way SGLang does, created by SGLang's own backend
factory, over ``HostPool``: SGLang's MHA host pool page layouts (``pool_host/mha.py``) on CPU.

SGLang's real host pool (``MHATokenToKVPoolHost``) cannot be imported without torchvision,
which the engines environment does not install (it would pull another torch); ``HostPool``
reproduces its page layouts and page methods (``get_data_page``, ``get_dummy_flat_data_page``)
line for line.

Run as ``python -m tests.support.sglang_harness JSON`` it is a second SGLang instance in its own
process, not connected to Ray: it joins the mmtier cluster through ``mmtier_cluster``
(``RAY_ADDRESS``), asks ``batch_exists`` for the pages, loads them zero-copy into a fresh host
pool and prints what it found as one JSON line."""

from __future__ import annotations

import json
import sys

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

L, H, D, P = 2, 2, 16, 8
PAGES = 6


class HostPool:
    """SGLang's MHA host pool page layouts (``pool_host/mha.py``), on CPU."""

    def __init__(self, layout: str):
        self.layout, self.layer_num, self.page_size, self.head_num, self.head_dim = layout, L, P, H, D
        self.dtype, self.size = torch.float32, PAGES * P
        dims = {"layer_first": (2, L, self.size, H, D), "page_first": (2, self.size, L, H, D),
                "page_first_direct": (2, PAGES, L, P, H, D)}[layout]
        self.kv_buffer = torch.full(dims, float("nan"))

    def get_data_page(self, index, flat=True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index: index + P]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index: index + P]
        else:
            page = self.kv_buffer[:, index // P: index // P + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((2, L, P, H, D), dtype=self.dtype).flatten()

    def tokens(self, index):
        """[2, L, P, H, D] of the page starting at ``index``, whatever the layout."""
        page = self.get_data_page(index, flat=False)
        if self.layout == "page_first":
            return page.transpose(1, 2)
        return page[:, 0] if self.layout == "page_first_direct" else page


def backend_for(fields: dict, *, tenant: str = "acme", tp_rank: int = 0, **extra):
    extra = {"backend_name": "mmtier", "module_path": "mmtier.engines.sglang",
             "class_name": "MMTierHiCacheStorage", "interface_v1": 1, "mmtier_tenant": tenant,
             "mmtier_cache": fields, **extra}
    cfg = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=False, model_name="tiny", extra_config=extra)
    return StorageBackendFactory.create_backend("dynamic", cfg, None)


def page_indices(pages) -> torch.Tensor:
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    keys, pages = args["keys"], args["pages"]
    store = backend_for(args["fields"], mmtier_cluster=args["cluster"])
    pool = HostPool("page_first")
    store.register_mem_pool_host(pool)
    found = store.batch_exists(keys + ["missing"])
    loaded = store.batch_get_v1(keys, page_indices(pages))
    calls, pulled = dict(store.link.calls), store.link.counters["pulled"]
    other = backend_for(args["fields"], tenant="other", mmtier_cluster=args["cluster"])
    print(json.dumps({"found": found, "loaded": loaded, "other_tenant": other.batch_exists(keys),
                      "values": torch.stack([pool.tokens(p * P) for p in pages]).flatten().tolist(),
                      "calls": calls, "pulled": pulled}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
