"""NodeStoreActor logic: a node's host and disk tiers, outside any pool process (plain class, no Ray).

Pools hand groups to their node's store (``ClusterCache.offload``) so that content outlives a
pool actor; the store answers partial attention over its pages in place (the CPU path, only
``q`` and ``(out, lse)`` travel) and exports a group as the same raw page-major buffer a pool
does, so a pool anywhere restores it with one object-store transfer.

Tiers: a ``HostTier`` (LRU over whole groups within a byte budget) and, when ``cfg.disk_dir``
is set, a ``DiskTier`` over ``store_dir`` (``disk_dir / "node-<label>" / "store"`` on a node
labelled ``mmtier.io/node``, else ``disk_dir / "store-<node id>"``) behind it, fed by a ``Mover``.
When the host tier needs room its least recently used groups are spilled to disk whole (the
host copy goes once the file is durable); a group larger than the host budget goes straight to
disk; a group is dropped only at the bottom (disk full, or a spill that failed). Attention and
export over a disk group stream its verified pages (no promotion); a copy that fails
verification is a miss: the group leaves the store, ``on_lost`` tells the registry and the
call raises ``CorruptDataError`` (the caller recomputes). A store recreated on the same node
adopts the groups in its directory (warm restart; keys checked with ``KeyMaker.is_authentic``,
foreign files left alone) and reports them in ``inventory`` (tier ``"disk"``). With
``cfg.write_behind`` each group taken into the host tier is also written to disk in the
background (``store_durable.StoreWriteBehind``), so a store killed outright (SIGKILL, node loss)
comes back with every group saved more than ``durable_lag_s`` before; a host group already on
disk costs no second write when it is spilled.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..attention.kernels import merge_attention_states, paged_attention, spec_scales
from ..attention.kernels.layout import build_paged_kv
from ..cache.transfer_sums import check_pages, expected_sums, with_sums
from ..config import CacheConfig, ModalitySpec
from ..content import ContentKey, KeyMaker
from ..errors import CapacityError, CorruptDataError, MMTierError, ShapeError, UnknownKeyError
from ..storage import DiskTier, Mover
from ..storage.host import HostTier
from .node_labels import node_folder
from .pool import group_item
from .store_durable import StoreWriteBehind

log = logging.getLogger(__name__)

WAIT_S = 120.0        # bound of a wait on one disk copy


def store_dir(cfg: CacheConfig, node: str, label: str | None = None) -> Path | None:
    """The store's disk directory on node ``node`` with stable name ``label`` (``node_labels``;
    ``None``: named by node id, as before labels); ``None`` when there is no disk tier."""
    if cfg.disk_dir is None:
        return None
    return node_folder(cfg.disk_dir, label) / "store" if label else Path(cfg.disk_dir) / f"store-{node}"


class NodeStoreService:
    """The logic of a NodeStoreActor: LRU over whole groups, host then disk, within byte budgets."""

    kind = "store"

    def __init__(self, cfg: CacheConfig, *, name: str, node: str, capacity_bytes: int,
                 label: str | None = None):
        self.cfg = cfg
        self.name = name
        self.node = node
        self.keys = KeyMaker(cfg.model, cfg.key_secret)
        self.host = HostTier(capacity_bytes, pin_memory=False)
        self._lock = threading.RLock()
        self._lru: OrderedDict[ContentKey, int] = OrderedDict()     # host: key -> num_tokens
        self._disk: OrderedDict[ContentKey, int] = OrderedDict()    # disk: key -> num_tokens
        self.counters = {"transfer_corrupt_reads": 0, "puts": 0, "exports": 0, "attentions": 0, "evictions": 0, "spills": 0,
                         "spill_failures": 0, "disk_reads": 0, "corrupt_reads": 0,
                         "adopted_from_disk": 0, "foreign_files": 0}
        self.on_lost: Callable[[list[str]], None] | None = None     # the actor tells the registry
        self.disk: DiskTier | None = None
        self.mover: Mover | None = None
        self.durable: StoreWriteBehind | None = None
        self._durable: set[ContentKey] = set()       # host groups whose file is on disk too
        directory = store_dir(cfg, node, label)
        if directory is not None:
            self.disk = DiskTier(directory, model=cfg.model, capacity_bytes=cfg.disk_bytes,
                                 free_floor_bytes=cfg.disk_free_floor_bytes)
            self.mover = Mover(self.host, self.disk, model=cfg.model,
                               max_inflight_bytes=cfg.max_inflight_bytes, name="mmtier-store-mover")
            self._adopt()
            if cfg.write_behind:
                self.durable = StoreWriteBehind(cfg, self.mover, self.counters)

    def _adopt(self) -> None:
        """Warm restart: index the verified groups already in the disk directory."""
        assert self.disk is not None
        for e in self.disk.inventory():
            key = e.key
            if key.modality not in self.cfg.modalities or not self.keys.is_authentic(key):
                self.counters["foreign_files"] += 1          # not ours: left alone, never served
                continue
            self._disk[key] = e.num_tokens
            self.counters["adopted_from_disk"] += 1

    def ping(self) -> dict[str, str]:
        return {"name": self.name, "node": self.node, "kind": self.kind}

    def _nbytes(self, key: ContentKey, n: int) -> int:
        spec = self.cfg.spec(key.modality)
        return spec.pages_for(n) * spec.page_bytes

    def inventory(self) -> list[dict]:
        with self._lock:
            return ([group_item(k, n, self._nbytes(k, n), "host") for k, n in self._lru.items()]
                    + [group_item(k, n, self._nbytes(k, n), "disk") for k, n in self._disk.items()])

    def holds(self, wires: Sequence[dict[str, str]]) -> list[bool]:
        with self._lock:
            keys = [ContentKey.from_wire(w) for w in wires]
            return [k in self._lru or k in self._disk for k in keys]

    def import_group(self, wire: dict[str, str], meta: dict, buf: np.ndarray) -> tuple[dict | None, list[str]]:
        """Take a group exported by a pool; makes room by spilling least recently used groups
        to disk (dropping them only at the bottom). ``(item or None when held, dropped addresses)``."""
        key = ContentKey.from_wire(wire)
        self.keys.verify(key)
        spec = self.cfg.spec(key.modality)
        n = int(meta["num_tokens"])
        n_pages = spec.pages_for(n)
        nbytes = n_pages * spec.page_bytes
        if buf.dtype != np.uint8 or buf.size != nbytes or n <= 0:
            raise ShapeError(f"{key.modality}: buffer of {buf.size} bytes for {n} tokens")
        if nbytes > self.host.capacity_bytes and self.disk is None:
            raise CapacityError(f"group of {nbytes} bytes exceeds the store")
        want = expected_sums(meta, n_pages, key.modality)
        try:                                 # the transfer is verified before anything is kept
            check_pages(buf.reshape(n_pages, spec.page_bytes), want, repr(key))
        except CorruptDataError:
            self.counters["transfer_corrupt_reads"] += 1
            raise
        with warnings.catch_warnings():    # read-only object-store buffer: only read from
            warnings.simplefilter("ignore", UserWarning)
            pages = torch.from_numpy(buf).view(spec.torch_dtype).view(n_pages, *spec.page_shape)
        evicted: list[str] = []
        with self._lock:
            self._reap()
            if key in self._lru:
                self._lru.move_to_end(key)
                return None, evicted
            if key in self._disk:
                self._disk.move_to_end(key)
                return None, evicted
            if nbytes > self.host.capacity_bytes:       # too large for host: straight to disk
                if not self._write_disk(key, spec, n, pages, evicted):
                    raise CapacityError(f"group of {nbytes} bytes fits neither the store's host "
                                        "nor its disk tier")
                self.counters["puts"] += 1
                return group_item(key, n, nbytes, "disk"), evicted
            while True:
                try:
                    self.host.put(key, spec, n, pages)
                    break
                except CapacityError:
                    if not self._lru:
                        raise
                    self._make_host_room(nbytes, evicted)
            self._lru[key] = n
            self.counters["puts"] += 1
            if self.durable is not None:
                self.durable.saved(key, spec, n, nbytes)
            return group_item(key, n, nbytes, "host"), evicted

    # ---- the cascade (lock held) ----
    def _reap(self) -> None:
        """Take the write-behind's finished copies: a host group's file is its durable copy; a
        file of a group dropped while it was written goes again."""
        if self.durable is None:
            return
        for key, written in self.durable.take_done():
            if written and key in self._lru:
                self._durable.add(key)
            elif written and key not in self._disk:
                self.disk.remove(key)

    def _on_disk_already(self, key: ContentKey) -> bool:
        """Whether a host group's write-behind copy is on disk (waiting for one in flight)."""
        if self.durable is None:
            return False
        written = key in self._durable or self.durable.settle(key)
        self._durable.discard(key)
        return written and self.disk.contains(key)

    def _make_host_room(self, nbytes: int, evicted: list[str]) -> None:
        """Move least recently used host groups down until ``nbytes`` are free (at least one)."""
        victims, freed = [], self.host.free_bytes
        for k, n in self._lru.items():
            if victims and freed >= nbytes:
                break
            victims.append((k, n))
            freed += self._nbytes(k, n)
        for k, n in victims:
            self._demote_host(k, n, evicted)

    def _demote_host(self, key: ContentKey, n: int, evicted: list[str]) -> None:
        """Spill a host group to disk whole; without a disk tier (or when that fails) drop it."""
        del self._lru[key]
        if self._on_disk_already(key):             # the write-behind wrote it: no second write
            self.host.remove(key)
            self._disk[key] = n
            self.counters["spills"] += 1
            return
        if self.disk is not None and self._write_disk(key, self.cfg.spec(key.modality), n, None, evicted):
            self.counters["spills"] += 1
            return
        self.host.remove(key)
        self.counters["evictions"] += 1
        evicted.append(key.address)

    def _write_disk(self, key: ContentKey, spec: ModalitySpec, n: int, pages: torch.Tensor | None,
                    evicted: list[str]) -> bool:
        """Write a group to disk (``pages=None``: from the host tier, whose copy goes once the
        file is durable), dropping least recently used disk groups while the budget refuses.
        ``True``: it is in ``_disk`` now. ``False``: it could not be written (host copy kept)."""
        assert self.mover is not None
        while True:
            try:
                fut = self.mover.spill(key, spec, n, pages, remove_from_host=pages is None)
                fut.result(timeout=WAIT_S)
            except CapacityError:                  # budget or full disk: drop at the bottom
                if not self._disk:
                    self.counters["spill_failures"] += 1
                    return False
                old, _ = self._disk.popitem(last=False)
                self.disk.remove(old)
                self.counters["evictions"] += 1
                evicted.append(old.address)
                continue
            except (MMTierError, OSError, concurrent.futures.TimeoutError) as exc:
                log.warning("store %s: spill of %r failed (%s)", self.name, key, exc)
                self.counters["spill_failures"] += 1
                return False
            self._disk[key] = n
            return True

    def _read(self, key: ContentKey) -> tuple[torch.Tensor, list[int], int, object]:
        """``(page-major view, page ids, num_tokens, host entry held or None)`` of a held group;
        a disk group's verified pages are streamed into a fresh buffer."""
        self.keys.verify(key)
        if key in self._lru:
            entry = self.host.hold(key)
            if entry is not None:
                self._lru.move_to_end(key)
                view, slots = entry.view()
                return view, slots.tolist(), entry.num_tokens, entry
        if key in self._disk:
            assert self.mover is not None
            spec = self.cfg.spec(key.modality)
            try:
                pages = self.mover.fetch(key, spec).result(timeout=WAIT_S)
            except (MMTierError, OSError):
                pages = None
            if pages is None:                    # missing or failed verification: a miss
                n = self._disk.pop(key)
                self.counters["corrupt_reads"] += 1
                self._lost([key.address])
                raise CorruptDataError(f"{key!r}: the store's disk copy is missing or failed "
                                       f"verification ({n} tokens; a miss, recompute)")
            self._disk.move_to_end(key)
            self.counters["disk_reads"] += 1
            return pages, list(range(pages.shape[0])), self._disk[key], None
        raise UnknownKeyError(f"{key!r} is not held by store {self.name}")

    def _lost(self, digests: list[str]) -> None:
        if self.on_lost is not None and digests:
            try:
                self.on_lost(digests)
            except Exception:  # the registry learns it at its next rebuild anyway
                log.exception("store %s: reporting lost groups failed", self.name)

    # ---- serving ----
    def export(self, wire: dict[str, str]) -> tuple[dict, np.ndarray]:
        key = ContentKey.from_wire(wire)
        with self._lock:
            view, ids, n, entry = self._read(key)
            try:
                data = view if entry is None else entry.gather()       # a host copy: verified
                self.counters["exports"] += 1
                return with_sums({"num_tokens": n}, data.contiguous().view(torch.uint8).reshape(-1).numpy(),
                                 self.cfg.spec(key.modality).page_bytes, entry.sums if entry is not None else None)
            finally:
                if entry is not None:
                    self.host.release(entry)

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
                view, ids, n, entry = self._read(ContentKey.from_wire(wire))
                try:
                    op = build_paged_kv(view, layer, [[(ids, int(start), n)]])
                    scales = spec_scales(self.cfg.spec(ContentKey.from_wire(wire).modality), view.device)
                    if scales is not None:
                        op = dataclasses.replace(op, scales=scales)
                    o, s = paged_attention(q.cpu(), indptr, pos, [op], causal=causal, scale=scale,
                                           backend="torch", out_dtype=torch.float32)
                finally:
                    if entry is not None:
                        self.host.release(entry)
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
                    if self._on_disk_already(key):
                        self.disk.remove(key)
                    out.append(key.address)
                elif self._disk.pop(key, None) is not None:
                    self.disk.remove(key)
                    out.append(key.address)
            return out

    def stats(self) -> dict:
        with self._lock:
            self._reap()
            out = {"groups": len(self._lru) + len(self._disk), "host_groups": len(self._lru),
                   "disk_groups": len(self._disk), **self.counters, **self.host.stats()}
            if self.disk is not None:
                out["disk"] = self.disk.stats()
            if self.durable is not None:
                out.update(self.durable.gauges())
            return out

    def tier_stats(self) -> dict:
        """Usage in ``CacheStats.to_dict()`` form: ``tiers["host"|"disk"][modality]`` and counters."""
        with self._lock:
            tiers: dict[str, dict[str, dict[str, int]]] = {"host": {}}
            held = [("host", self._lru, self.host.capacity_bytes)]
            if self.disk is not None:
                tiers["disk"] = {}
                held.append(("disk", self._disk, self.disk.capacity_bytes))
            for tier, groups, cap in held:
                for k, n in groups.items():
                    spec = self.cfg.spec(k.modality)
                    u = tiers[tier].setdefault(k.modality, {"groups": 0, "pages": 0, "bytes": 0,
                                                            "capacity_bytes": cap})
                    u["groups"] += 1
                    u["pages"] += spec.pages_for(n)
                    u["bytes"] += spec.pages_for(n) * spec.page_bytes
            return {"tiers": tiers, "counters": dict(self.counters), "by_modality": {}, "sequences": 0}

    def leak_report(self) -> dict[str, int]:
        with self._lock:
            pages = sum(self.cfg.spec(k.modality).pages_for(n)
                        for groups in (self._lru, self._disk) for k, n in groups.items())
            return {"sequences": 0, "handles": 0, "used_pages": pages, "cached_pages": pages}

    def close(self) -> None:
        if self.mover is not None:
            self.mover.close(timeout=WAIT_S)
        if self.disk is not None:
            self.disk.close()                      # files stay: a recreated store adopts them
        self.host.close()
