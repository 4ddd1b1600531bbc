"""mmtier's side of ``benchmarks/peers/peer_lmcache.py``: the same operations as
``peer_lmcache_worker.py`` runs on LMCache, on the same bytes, plus the raw copies each cache-level
operation must make. Every method returns seconds (and ``equal``: the bytes read back compared
bitwise with the source) for one round."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.file_faults import damage, drop_cache
from benchmarks.peers.peer_lmcache_worker import group_kv
from mmtier import CacheConfig, TieredKVCache
from mmtier.content import KeyMaker
from mmtier.native import rows as native_rows
from mmtier.pages.copies import pages_into_kv
from mmtier.storage import DiskTier, HostTier
from mmtier.storage.page_digests import copy_out_verified
from mmtier.tiers.places import token_dest

MODEL = "llama-3-8b-shaped"
RAW_PATH = "native" if native_rows.available() else "torch"


def layout_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The raw copies' layout change by the fastest plain means here: the same C row copy the
    cache uses (no test, no digest) where it is built, else torch's strided copy."""
    if not native_rows.copy_view(dst, src):
        dst.copy_(src)


def to_pages(k: torch.Tensor, v: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[pages, layers, 2, page_size, heads, head_dim]`` of a group's K and V (page-major)."""
    L, n, H, D = k.shape
    p = n // page_size
    out = torch.empty(p, L, 2, page_size, H, D, dtype=k.dtype)
    out[:, :, 0] = k.view(L, p, page_size, H, D).transpose(0, 1)
    out[:, :, 1] = v.view(L, p, page_size, H, D).transpose(0, 1)
    return out


class MMTierSide:
    def __init__(self, groups: int, layers: int, heads: int, head_dim: int, chunk: int, seed: int,
                 workdir: str, page_size: int = 16, device_groups: int = 2, host_groups: int = 2,
                 put_placement: str | None = None):
        self.n, self.C, self.P = groups, chunk, page_size
        self.dir = Path(workdir)
        self.kv = [group_kv(seed, i, layers, chunk, heads, head_dim) for i in range(groups)]
        self.group_bytes = 2 * self.kv[0][0].numel() * 2
        self.cfg_args = dict(model=MODEL, num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                             dtype="bfloat16", modalities={"text": {"page_size": page_size}}, device="cpu",
                             key_secret="peer-lmcache-bench")
        self.cfg = CacheConfig(**self.cfg_args, device_bytes=1 << 20)
        self.spec = self.cfg.spec("text")
        self.ppg = self.spec.pages_for(chunk)                # pages per group
        self.pages = [to_pages(k, v, page_size) for k, v in self.kv]
        self.keys = KeyMaker(MODEL, "peer-lmcache-bench")
        self.tier_keys = [self.keys.derive(modality="text", layout=self.spec.layout_fields(),
                                           media=hashlib.sha256(b"g%d" % i).digest(), tenant_salt=b"b" * 32)
                          for i in range(groups)]
        self.host = HostTier(int(groups * self.group_bytes * 1.05))
        self.out_pages = torch.empty(groups * self.ppg, *self.spec.page_shape, dtype=torch.bfloat16)
        self.disk_dir = self.dir / "mmtier-disk"
        shutil.rmtree(self.disk_dir, ignore_errors=True)
        self.disk = DiskTier(self.disk_dir, model=MODEL, capacity_bytes=100 << 30)
        slack = min(1 << 20, self.group_bytes // 2)   # room for no extra group (small groups in tests)
        # the cache over host memory: the device pool holds ``device_groups``; each put past them
        # finds it full and, under ``put_placement`` (None: CacheConfig's default, "auto": the pool
        # is in host memory, so a demotion would buy nothing), writes around it into the host tier
        # in one copy ("demote": pushes the oldest group down first, two copies). Room for every
        # group of a round.
        placement = {} if put_placement is None else {"put_placement": put_placement}
        self.cache_host = TieredKVCache(CacheConfig(**self.cfg_args, device_bytes=device_groups * self.group_bytes
                                                    + slack, host_bytes=int(groups * self.group_bytes * 1.02),
                                                    **placement))
        # the cache over disk: a small host tier, spilling to disk as it fills
        self.cache_disk_dir = self.dir / "mmtier-cache-disk"
        shutil.rmtree(self.cache_disk_dir, ignore_errors=True)
        self.cache_disk = TieredKVCache(CacheConfig(
            **self.cfg_args, device_bytes=device_groups * self.group_bytes + slack,
            host_bytes=host_groups * self.group_bytes + slack, disk_dir=str(self.cache_disk_dir),
            disk_bytes=64 << 30))         # never the limit here (each round adds ``groups`` new ones)
        self.round = 0
        self.demotions = 0
        self.around = 0
        self.host_keys: list = []
        self.disk_keys: list = []
        # raw copies' buffers (made and touched once)
        self.raw_pages = torch.empty(self.ppg, *self.spec.page_shape, dtype=torch.bfloat16)
        self.raw_pages.zero_()
        # a host buffer per group, as the tier's slots: a copy never lands in a cache-hot buffer
        self.raw_host = torch.zeros(groups, *self.raw_pages.shape, dtype=torch.bfloat16)
        self.raw_k = torch.zeros_like(self.kv[0][0])
        self.raw_v = torch.zeros_like(self.kv[0][1])
        self.get_k = torch.zeros_like(self.kv[0][0])      # cache_get_host's, made once as raw_k/v
        self.get_v = torch.zeros_like(self.kv[0][1])

    # ------------------------------------------------------------------ storage level
    def tier_host_put(self) -> dict:
        for key in self.tier_keys:
            self.host.remove(key)
        t0 = time.perf_counter()
        for key, pages in zip(self.tier_keys, self.pages):
            self.host.put(key, self.spec, self.C, pages)
        return {"s": time.perf_counter() - t0}

    def tier_host_get(self) -> dict:
        self.out_pages.fill_(float("nan"))
        t0 = time.perf_counter()
        for i, key in enumerate(self.tier_keys):
            self.host.get(key).copy_to(self.out_pages, range(i * self.ppg, (i + 1) * self.ppg))
        dt = time.perf_counter() - t0
        return {"s": dt, "equal": self._pages_equal()}

    def tier_disk_put(self) -> dict:
        for key in self.tier_keys:
            self.disk.remove(key)
        os.sync()
        t0 = time.perf_counter()
        self.disk.put_many([(key, self.spec, self.C, pages) for key, pages in zip(self.tier_keys, self.pages)])
        return {"s": time.perf_counter() - t0}

    def tier_disk_cold_read(self) -> dict:
        how = drop_cache([str(p) for p in self.disk_dir.glob("*.arrow")])
        self.out_pages.fill_(float("nan"))
        t0 = time.perf_counter()
        ok = self.disk.get_many(self.tier_keys, self.spec, MODEL, self.out_pages, [self.ppg] * self.n)
        dt = time.perf_counter() - t0
        return {"s": dt, "equal": all(ok) and self._pages_equal(), "drop": how}

    def tier_disk_cold_read_one(self) -> dict:
        """The storage layer's own read of one group at a time, cold (``DiskTier.get`` of each
        of the tier's files into token-major K and V, one pair reused: its best case), what
        ``cache_cold_read_simple``'s ``read_group(key)`` of a disk group is held to."""
        how = drop_cache([str(p) for p in self.disk_dir.glob("*.arrow")])
        ok, dt = True, 0.0
        for i, key in enumerate(self.tier_keys):
            self.raw_k.fill_(float("nan"))
            self.raw_v.fill_(float("nan"))
            t0 = time.perf_counter()
            got = self.disk.get(key, self.spec, MODEL, out=token_dest(self.spec, self.ppg, self.raw_k, self.raw_v))
            dt += time.perf_counter() - t0
            ok = ok and got is not None and torch.equal(self.raw_k, self.kv[i][0]) and torch.equal(self.raw_v, self.kv[i][1])
        return {"s": dt, "groups": self.n, "equal": ok, "drop": how}

    def _pages_equal(self) -> bool:
        return all(torch.equal(self.out_pages[i * self.ppg:(i + 1) * self.ppg], p) for i, p in enumerate(self.pages))

    # ------------------------------------------------------------------ cache level
    def _new_keys(self, cache: TieredKVCache) -> list:
        self.round += 1
        return [cache.content_key("text", b"round%d-group%d" % (self.round, i)) for i in range(self.n)]

    def cache_put_host(self) -> dict:
        keys = self._new_keys(self.cache_host)
        counters = self.cache_host.stats().counters
        before = counters.get("spills_to_host", 0), counters.get("puts_written_around", 0)
        t0 = time.perf_counter()
        for key, (k, v) in zip(keys, self.kv):
            self.cache_host.put(key, k, v)
        dt = time.perf_counter() - t0
        counters = self.cache_host.stats().counters
        demoted = counters.get("spills_to_host", 0) - before[0]
        around = counters.get("puts_written_around", 0) - before[1]
        tiers = {key: tier for key, tier, _ in self.cache_host.inventory()}
        self.host_keys = [(i, key) for i, key in enumerate(keys) if tiers.get(key) == "host"]
        self.demotions, self.around = demoted, around
        return {"s": dt, "demotions": demoted, "written_around": around}

    def cache_get_host(self) -> dict:
        out_k, out_v = self.get_k, self.get_v
        ok = True
        dt = 0.0
        for i, key in self.host_keys:
            out_k.fill_(float("nan"))
            out_v.fill_(float("nan"))
            t0 = time.perf_counter()
            self.cache_host.read_group(key, out=(out_k, out_v))
            dt += time.perf_counter() - t0
            ok = ok and torch.equal(out_k, self.kv[i][0]) and torch.equal(out_v, self.kv[i][1])
        return {"s": dt, "groups": len(self.host_keys), "equal": ok}

    def cache_get_host_simple(self) -> dict:
        """``cache_get_host`` through the call a user writes first: ``read_group(key)``, one group
        at a time, no ``out=`` (the cache allocates the result)."""
        ok = True
        dt = 0.0
        for i, key in self.host_keys:
            t0 = time.perf_counter()
            k, v = self.cache_host.read_group(key)
            dt += time.perf_counter() - t0
            ok = ok and torch.equal(k, self.kv[i][0]) and torch.equal(v, self.kv[i][1])
            del k, v
        return {"s": dt, "groups": len(self.host_keys), "equal": ok}

    def cache_put_disk(self) -> dict:
        keys = self._new_keys(self.cache_disk)
        disk = self.cache_disk.lower.disk
        before = disk.stats()["write_bytes"]
        os.sync()
        t0 = time.perf_counter()
        for key, (k, v) in zip(keys, self.kv):
            self.cache_disk.put(key, k, v)
        self.cache_disk.flush()                  # every spill durable (mmtier always fsyncs)
        dt = time.perf_counter() - t0
        tiers = {key: tier for key, tier, _ in self.cache_disk.inventory()}
        self.disk_keys = [(i, key) for i, key in enumerate(keys) if tiers.get(key) == "disk"]
        return {"s": dt, "disk_bytes": disk.stats()["write_bytes"] - before}

    def cache_cold_read(self) -> dict:
        how = drop_cache([str(p) for p in self.cache_disk_dir.glob("*.arrow")])
        outs = [(torch.full_like(self.kv[i][0], float("nan")), torch.full_like(self.kv[i][1], float("nan")))
                for i, _ in self.disk_keys]
        t0 = time.perf_counter()
        self.cache_disk.read_groups([key for _, key in self.disk_keys], out=outs)
        dt = time.perf_counter() - t0
        ok = all(torch.equal(o[0], self.kv[i][0]) and torch.equal(o[1], self.kv[i][1])
                 for (i, _), o in zip(self.disk_keys, outs))
        return {"s": dt, "groups": len(self.disk_keys), "equal": ok, "drop": how}

    def cache_cold_read_simple(self) -> dict:
        """``cache_cold_read`` through the call a user writes first: ``read_group(key)`` of each
        disk group in turn, no ``out=``."""
        how = drop_cache([str(p) for p in self.cache_disk_dir.glob("*.arrow")])
        got = []
        t0 = time.perf_counter()
        for _, key in self.disk_keys:
            got.append(self.cache_disk.read_group(key))
        dt = time.perf_counter() - t0
        ok = all(torch.equal(o[0], self.kv[i][0]) and torch.equal(o[1], self.kv[i][1])
                 for (i, _), o in zip(self.disk_keys, got))
        return {"s": dt, "groups": len(self.disk_keys), "equal": ok, "drop": how}

    # ------------------------------------------------------------------ the raw copies
    def raw_put_copies(self) -> dict:
        """What a put must copy per group, by the plainest means: K and V into page-major pages
        (slices, the layout change); for a put written around the pool, into a host buffer of
        the group's own (as the put lands in a host slot of its own, never a cache-hot one);
        for a put that pushes another group down, into one page buffer (the pool's pages) and
        one copy of a group's pages into host memory."""
        L, n, H, D = self.kv[0][0].shape
        p = n // self.P
        first_around = self.n - self.around      # the round's last puts are the ones that went around
        t0 = time.perf_counter()
        for i, (k, v) in enumerate(self.kv):
            dst = self.raw_host[i] if i >= first_around else self.raw_pages
            layout_copy(dst[:, :, 0], k.view(L, p, self.P, H, D).transpose(0, 1))
            layout_copy(dst[:, :, 1], v.view(L, p, self.P, H, D).transpose(0, 1))
            if i < self.demotions:                  # as many demotions as the put made (libc memcpy)
                np.copyto(self.raw_host[i].view(-1).view(torch.uint8).numpy(),
                          self.raw_pages.view(-1).view(torch.uint8).numpy())
        return {"s": time.perf_counter() - t0}

    def raw_get_copy(self) -> dict:
        """What ``read_group`` must copy per host group: its pages into ``[layers, n, heads,
        head_dim]`` K and V (the layout change), once; into the same kind of buffers as
        ``cache_get_host``'s, poisoned the same way before each group (untimed), so that both
        write to memory in the same state."""
        L, n, H, D = self.kv[0][0].shape
        p = n // self.P
        dt = 0.0
        for i, _ in self.host_keys:         # a different group's pages each time (none cache-hot)
            pages = self.pages[i]
            self.raw_k.fill_(float("nan"))
            self.raw_v.fill_(float("nan"))
            t0 = time.perf_counter()
            layout_copy(self.raw_k.view(L, p, self.P, H, D), pages[:, :, 0].transpose(0, 1))
            layout_copy(self.raw_v.view(L, p, self.P, H, D), pages[:, :, 1].transpose(0, 1))
            dt += time.perf_counter() - t0
        return {"s": dt}

    def checksums(self) -> dict:
        """What the verified host tier adds: ``s``, the xxh3 of every page of every group in a
        pass of its own (python's xxhash: what a check costs where the native helper is not
        built); ``s_plain`` / ``s_verified``, every host-tier group (``tier_host_put``'s) copied
        out into K and V by the plain row copy and by the verified copy that checks each page's
        digest as it moves it (``copy_out_verified``), both into poisoned buffers."""
        from mmtier.storage.arrow_format import page_sums

        plain = verified = 0.0
        for key, (k, v) in zip(self.tier_keys, self.kv):
            entry = self.host.get(key)
            if entry is None:
                continue
            for how in ("plain", "verified"):
                self.raw_k.fill_(float("nan"))
                self.raw_v.fill_(float("nan"))
                t0 = time.perf_counter()
                if how == "plain" or not copy_out_verified(entry, self.raw_k, self.raw_v):
                    pages_into_kv(entry.runs(), self.raw_k, self.raw_v)
                dt = time.perf_counter() - t0
                if not (torch.equal(self.raw_k, k) and torch.equal(self.raw_v, v)):
                    raise AssertionError(f"host copy out ({how}) differs from the source")
                if how == "plain":
                    plain += dt
                else:
                    verified += dt

        rows = [p.reshape(p.shape[0], -1).view(torch.uint8).numpy() for p in self.pages]
        t0 = time.perf_counter()
        page_sums(rows)
        return {"s": time.perf_counter() - t0, "s_plain": plain, "s_verified": verified}

    # ------------------------------------------------------------------ reliability probes
    def probes(self) -> dict:
        d = self.dir / "mmtier-probe"
        out: dict[str, object] = {}
        n = min(4, self.n)
        keys = self.tier_keys[:n]
        for probe in ("flip", "truncate"):
            shutil.rmtree(d, ignore_errors=True)
            with DiskTier(d, model=MODEL, capacity_bytes=10 << 30) as disk:
                for key, pages in zip(keys, self.pages):
                    disk.put(key, self.spec, self.C, pages)
                path = d / disk.info(keys[0]).files[0]
                damage(path, probe)
                drop_cache([str(path)])
                got = disk.get(keys[0], self.spec, MODEL)
                st = disk.stats()
                out[f"mmtier_{probe}"] = ("miss, quarantined and counted" if got is None and st["corrupt_reads"] == 1
                                          and st["quarantined"] == 1 else
                                          "miss" if got is None else
                                          "equal data" if torch.equal(got, self.pages[0]) else "wrong data")
        shutil.rmtree(d, ignore_errors=True)
        with DiskTier(d, model=MODEL, capacity_bytes=10 << 30) as disk:
            for key, pages in zip(keys, self.pages):
                disk.put(key, self.spec, self.C, pages)
        with DiskTier(d, model=MODEL, capacity_bytes=10 << 30) as disk:
            got = [disk.get(key, self.spec, MODEL) for key in keys]
            out["mmtier_restart_found"] = sum(g is not None and torch.equal(g, p) for g, p in zip(got, self.pages))
            out["mmtier_restart_of"] = n
        shutil.rmtree(d, ignore_errors=True)
        budget = n * (self.group_bytes + (1 << 16))
        with DiskTier(d, model=MODEL, capacity_bytes=budget) as disk:
            for key, pages in zip(keys, self.pages):
                disk.put(key, self.spec, self.C, pages)
            for key in keys:
                disk.remove(key)
            other = self.tier_keys[n:2 * n] if self.n >= 2 * n else [
                self.keys.derive(modality="text", layout=self.spec.layout_fields(),
                                 media=hashlib.sha256(b"o%d" % i).digest(), tenant_salt=b"b" * 32) for i in range(n)]
            stored = 0
            for key, pages in zip(other, self.pages):
                disk.put(key, self.spec, self.C, pages)
                stored += disk.contains(key)
            out["mmtier_budget_after_remove_stored"] = stored
            out["mmtier_budget_after_remove_of"] = n
        shutil.rmtree(d, ignore_errors=True)
        return out

    def close(self) -> None:
        self.cache_host.close()
        self.cache_disk.close()
        self.disk.close()
        self.host.close()
