"""A model-less engine on a test cluster, and groups to save and find with it (the restart tests'
shared parts: tests/cluster/test_node_restart.py, tests/cluster/test_node_labels.py)."""

from __future__ import annotations

import os
import time

import torch

from mmtier import CacheConfig, TieredKVCache
from mmtier.cluster import ClusterSettings
from mmtier.cluster.engine_pool import PoolHost
from mmtier.cluster.pool import PoolService
from mmtier.content import ContentKey


class Probe(PoolHost):
    """A model-less engine: its embedded pool and a turn's lookups and fetches, nothing else."""

    def __init__(self, settings_json: dict):
        super().__init__(ClusterSettings(**settings_json), device="cpu")

    def pid(self) -> int:
        return os.getpid()

    def save(self, items: list[tuple[dict, torch.Tensor, torch.Tensor]]) -> int:
        """Put groups into this engine's pool and publish them (a turn's end)."""
        n = sum(bool(self.local.put(ContentKey.from_wire(w), k, v)) for w, k, v in items)
        self.local.end_turn()
        return n

    def durable_writes(self) -> int:
        return self.cache.stats().counters.get("durable_writes", 0)

    def find(self, wires: list[dict]) -> tuple[list[bytes | None], dict[str, str], dict[str, int]]:
        """One turn over these groups: each one's page bytes as found (``None``: a miss), the
        turn's plan, and its counters. What was fetched is dropped again after, so the next
        turn asks the cluster once more."""
        keys = [ContentKey.from_wire(w) for w in wires]
        self.local.begin_turn(keys)
        found = []
        for key in keys:
            if self.local.contains(key):
                found.append(PoolService.export(self, key.to_wire())[1].tobytes())
            else:
                found.append(None)
        self.local.end_turn()
        plan, stats = dict(self.local.plan), self.local.turn_stats()
        self.local.drop(keys)
        self.local.end_turn()
        return found, plan, stats


def groups(cfg: CacheConfig, tag: str, sizes: tuple[int, ...]
           ) -> list[tuple[ContentKey, torch.Tensor, torch.Tensor, bytes]]:
    """Fresh random vision groups (whole pages), each with the page bytes a cache holds for it."""
    out = []
    with TieredKVCache(cfg.model_copy(update={"disk_dir": None})) as maker:
        for i, n in enumerate(sizes):
            key = maker.content_key("vision", f"{tag}-{i}-{time.time_ns()}".encode(), tenant="acme")
            shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
            k, v = torch.randn(shape), torch.randn(shape)
            assert maker.put(key, k, v)
            out.append((key, k, v, maker.export_pages(key).to_wire()[1].tobytes()))
    return out


def exported(cfg: CacheConfig, key: ContentKey, k: torch.Tensor, v: torch.Tensor):
    """A group as a pool exports it: ``(meta, page-major uint8 buffer)``."""
    with TieredKVCache(cfg.model_copy(update={"disk_dir": None})) as c:
        c.put(key, k, v)
        return c.export_pages(key).to_wire()


def named(name: str, namespace: str) -> bool:
    """Whether Ray still knows an actor by ``name`` (a dead detached actor's name goes with it)."""
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True
