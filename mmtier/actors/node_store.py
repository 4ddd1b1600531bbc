"""NodeStoreActor logic: a node's shared host tier, outside any pool process (plain class, no Ray).

Pools hand groups to their node's store (``ClusterCache.offload``) so that content outlives a
pool actor; the store answers partial attention over its pages in place (the CPU path, only
``q`` and ``(out, lse)`` travel) and exports a group as the same raw page-major buffer a pool
does, so a pool anywhere restores it with one object-store transfer.

Seam: the tier is ``mmtier.storage.HostTier`` (``contains / put / get / remove / close``). The
node's disk tier (``DiskTier`` over ``cfg.disk_dir``) joins behind the same five calls when the
cache's tier cascade lands; the actor interface below does not change.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from ..config import CacheConfig
from ..content import ContentKey, KeyMaker
from ..errors import CapacityError, ShapeError, UnknownKeyError
from ..kernels import merge_attention_states, paged_attention
from ..kernels.layout import build_paged_kv
from ..storage.host import HostTier
from .pool_actor import group_item


class NodeStoreService:
    """The logic of a NodeStoreActor: LRU over whole groups within a byte budget."""

    kind = "store"

    def __init__(self, cfg: CacheConfig, *, name: str, node: str, capacity_bytes: int):
        self.cfg = cfg
        self.name = name
        self.node = node
        self.keys = KeyMaker(cfg.model, cfg.key_secret)
        self.host = HostTier(capacity_bytes, pin_memory=False)
        self._lock = threading.RLock()
        self._lru: OrderedDict[ContentKey, int] = OrderedDict()     # key -> num_tokens
        self.counters = {"puts": 0, "exports": 0, "attentions": 0, "evictions": 0}

    def ping(self) -> dict[str, str]:
        return {"name": self.name, "node": self.node, "kind": self.kind}

    def inventory(self) -> list[dict]:
        with self._lock:
            return [group_item(k, n, self.cfg.spec(k.modality).pages_for(n) * self.cfg.spec(k.modality).page_bytes,
                               "host") for k, n in self._lru.items()]

    def holds(self, wires: Sequence[dict[str, str]]) -> list[bool]:
        with self._lock:
            return [ContentKey.from_wire(w) in self._lru for w in wires]

    def import_group(self, wire: dict[str, str], meta: dict, buf: np.ndarray) -> tuple[dict | None, list[str]]:
        """Take a group exported by a pool; evicts least recently used groups for room."""
        key = ContentKey.from_wire(wire)
        self.keys.verify(key)
        spec = self.cfg.spec(key.modality)
        n = int(meta["num_tokens"])
        n_pages = spec.pages_for(n)
        if buf.dtype != np.uint8 or buf.size != n_pages * spec.page_bytes or n <= 0:
            raise ShapeError(f"{key.modality}: buffer of {buf.size} bytes for {n} tokens")
        if n_pages * spec.page_bytes > self.host.capacity_bytes:
            raise CapacityError(f"group of {n_pages * spec.page_bytes} bytes exceeds the store")
        with warnings.catch_warnings():    # read-only object-store buffer: only read from
            warnings.simplefilter("ignore", UserWarning)
            pages = torch.from_numpy(buf).view(spec.torch_dtype).view(n_pages, *spec.page_shape)
        evicted: list[str] = []
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return None, evicted
            while True:
                try:
                    self.host.put(key, spec, n, pages)
                    break
                except CapacityError:
                    if not self._lru:
                        raise
                    old, _ = self._lru.popitem(last=False)
                    self.host.remove(old)
                    self.counters["evictions"] += 1
                    evicted.append(old.hex)
            self._lru[key] = n
            self.counters["puts"] += 1
            return group_item(key, n, n_pages * spec.page_bytes, "host"), evicted

    def export(self, wire: dict[str, str]) -> tuple[dict, np.ndarray]:
        key = ContentKey.from_wire(wire)
        with self._lock:
            entry = self._entry(key)
            data = entry.gather()
            self.counters["exports"] += 1
            return {"num_tokens": entry.num_tokens}, data.contiguous().view(torch.uint8).reshape(-1).numpy()

    def attend(self, parts: Sequence[tuple[dict[str, str], int]], layer: int, q: torch.Tensor,
               q_pos: torch.Tensor, causal: bool = True, scale: float | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention over held groups placed at absolute starts ``parts[(wire, start)]``."""
        if not parts:
            raise ShapeError("attend needs at least one part")
        pos = q_pos.to(torch.int32).cpu()
        indptr = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        outs, lses = [], []
        with self._lock:
            for wire, start in parts:
                entry = self._entry(ContentKey.from_wire(wire))
                view, slots = entry.view()
                op = build_paged_kv(view, layer, [[(slots.tolist(), int(start), entry.num_tokens)]])
                o, s = paged_attention(q.cpu(), indptr, pos, [op], causal=causal, scale=scale,
                                       backend="torch", out_dtype=torch.float32)
                outs.append(o)
                lses.append(s)
            self.counters["attentions"] += 1
        if len(outs) == 1:
            return outs[0], lses[0]
        return merge_attention_states(outs, lses, backend="torch", out_dtype=torch.float32)

    def drop(self, wires: Sequence[dict[str, str]]) -> list[str]:
        with self._lock:
            out = []
            for w in wires:
                key = ContentKey.from_wire(w)
                if self._lru.pop(key, None) is not None:
                    self.host.remove(key)
                    out.append(key.hex)
            return out

    def stats(self) -> dict:
        with self._lock:
            return {"groups": len(self._lru), **self.counters, **self.host.stats()}

    def tier_stats(self) -> dict:
        """Usage in ``CacheStats.to_dict()`` form: ``tiers["host"][modality]`` and counters."""
        with self._lock:
            per: dict[str, dict[str, int]] = {}
            for k, n in self._lru.items():
                spec = self.cfg.spec(k.modality)
                u = per.setdefault(k.modality, {"groups": 0, "pages": 0, "bytes": 0,
                                                "capacity_bytes": self.host.capacity_bytes})
                u["groups"] += 1
                u["pages"] += spec.pages_for(n)
                u["bytes"] += spec.pages_for(n) * spec.page_bytes
            return {"tiers": {"host": per}, "counters": dict(self.counters), "by_modality": {},
                    "sequences": 0}

    def leak_report(self) -> dict[str, int]:
        with self._lock:
            return {"sequences": 0, "handles": 0, "used_pages": sum(
                self.cfg.spec(k.modality).pages_for(n) for k, n in self._lru.items()),
                "cached_pages": sum(self.cfg.spec(k.modality).pages_for(n) for k, n in self._lru.items())}

    def close(self) -> None:
        self.host.close()

    def _entry(self, key: ContentKey):
        self.keys.verify(key)
        entry = self.host.get(key) if key in self._lru else None
        if entry is None:
            raise UnknownKeyError(f"{key!r} is not held by store {self.name}")
        self._lru.move_to_end(key)
        return entry
