"""``EngineLink``: an engine process's embedded cache joined to the cluster, from a process
that is not an actor of its own.

An engine's process (vLLM's EngineCore, an SGLang scheduler) embeds a ``TieredKVCache`` but is
no Ray actor it controls: it cannot answer exports, so other processes could not pull from it,
and what only it held would die with it. It shares through its node's store instead:

- **share** (after a save, off the forward path: the connector's writer thread hands its batch
  over and goes on): each new group is written through to this node's ``NodeStoreActor``, one
  call per group (the pages leased and exported as a view where they are one run on the CPU;
  the submission copies them once into the object store), and the store's new holdings go to
  the registry in **one** publish per batch. The local copy stays; the store, not the engine,
  is the holder of record, so the groups outlive the engine process.
- **pull** (on a local miss, at admission): the keys not held here go to the registry in
  **one** batched lookup; the leading run of keys held somewhere is fetched whole, one call per
  group, all sent at once (a holder on this node first, a pool before a store), and imported
  into the local cache, where they are ordinary local groups: hits. Any failure (registry or
  holder gone, a timeout, a corrupt copy, no room) ends the run there: a miss, counted, never
  wrong KV;
- **locate**: the same lookup without the fetches, for a scheduler whose worker holds another
  cache (vLLM's Ray executor): the worker pulls at load.

Pulls and shares run on the link's own threads, one each: pulls one at a time (a pull queued
behind another sees what that one landed and fetches only the rest), shares one batch at a
time. Every Ray call goes through a ``RayTransport`` (counted by kind in ``calls``), every wait
is bounded by ``settings.call_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import ray

from ..cache import GroupPages, TieredKVCache
from ..config import DEFAULT_KEY_SECRET, CacheConfig
from ..content import ContentKey
from ..errors import ConfigError, HolderLostError, MMTierError, UnknownModalityError
from . import client_placement as placement
from .actors import store_name
from .engine_pool import RayTransport
from .registry import Location
from .settings import ClusterSettings

log = logging.getLogger(__name__)

# The node an engine process runs on, where its Ray connection cannot tell: a process that joins
# Ray itself attaches to the head's raylet when several share a host (``ray.cluster_utils``),
# so whoever starts the engine on a node sets it (``mmtier.serve.llm_callback``).
NODE_ENV = "MMTIER_NODE_ID"
LEASE_S = 60.0            # bound of one export's read of the local pages (the submission's copy)


def check_compatible(local: CacheConfig, cluster: CacheConfig) -> None:
    """An engine's cache shares keys and pages with the cluster only under the same model, key
    secret and payload layout of each of its modalities; ``ConfigError`` names what differs
    (the sizes, device and tiers are the engine's own)."""
    if local.model != cluster.model:
        raise ConfigError(f"the engine's model {local.model!r} is not the cluster's {cluster.model!r}",
                          ("model",))
    if local.key_secret != cluster.key_secret:
        raise ConfigError("the engine's key secret is not the cluster's (leave key_secret unset in "
                          "the engine's config: it takes the cluster's)", ("key_secret",))
    for name in local.modalities:
        try:
            theirs = cluster.spec(name).layout_fields()
        except UnknownModalityError:
            raise ConfigError(f"modality {name!r} is not in the cluster's config",
                              (f"modalities.{name}",)) from None
        if local.spec(name).layout_fields() != theirs:
            raise ConfigError(f"modality {name!r}: the engine's payload layout is not the cluster's",
                              (f"modalities.{name}",))


def join(cfg: CacheConfig, settings: ClusterSettings, address: str | None = None
         ) -> tuple[CacheConfig, RayTransport]:
    """Join the running mmtier cluster: ``(cfg with the cluster's key secret, transport)``.

    The key secret is the cluster's (its registry's config, set server side by ``mmtier
    start``), as for every pool: an engine config that leaves the default takes it; one that
    sets another refuses to start. The model and each modality's layout must be the cluster's
    (``check_compatible``)."""
    connect_ray(settings, address)
    try:
        transport = RayTransport(settings)
    except ValueError:
        raise ConfigError(f"no mmtier registry {settings.registry_name!r} in namespace "
                          f"{settings.namespace!r}: run `mmtier start` first",
                          ("mmtier_cluster.namespace",)) from None
    cluster = CacheConfig(**transport.config())
    if cfg.key_secret == DEFAULT_KEY_SECRET:
        cfg = CacheConfig(**{**cfg.model_dump(), "key_secret": cluster.key_secret})
    check_compatible(cfg, cluster)
    return cfg, transport


def connect_ray(settings: ClusterSettings, address: str | None) -> None:
    """Join the running Ray cluster unless this process already has (``address``, else
    ``RAY_ADDRESS``, else ``"auto"``: the cluster started on this machine)."""
    if ray.is_initialized():
        return
    where = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=where, namespace=settings.namespace, log_to_driver=False)
    except ConnectionError as exc:
        raise ConfigError(f"mmtier_cluster: no Ray cluster at {where!r} ({exc})", ("mmtier_cluster.address",)) from None


class EngineLink:
    """See the module docstring. ``counters``: ``shared``, ``share_failed``, ``pulled``,
    ``pull_failed``, ``timeouts``, ``lookups``, ``lookup_misses`` (keys nobody held)."""

    def __init__(self, cache: TieredKVCache, transport: RayTransport):
        """``cache``: opened with the config ``join`` returned, over its ``transport``."""
        self.cache = cache
        self.transport = transport
        self.settings = transport.settings
        self.node = os.environ.get(NODE_ENV) or ray.get_runtime_context().get_node_id()
        self.store = store_name(self.node)
        try:
            self.transport.handle(self.store)
        except HolderLostError:
            raise ConfigError(f"this node has no mmtier store ({self.store}): run `mmtier start` "
                              "again after nodes join", ("mmtier_cluster",)) from None
        self.counters: Counter[str] = Counter()
        self._pulls = ThreadPoolExecutor(1, thread_name_prefix="mmtier-pull")
        self._shares = ThreadPoolExecutor(1, thread_name_prefix="mmtier-share")
        self._lock = threading.Lock()
        self._inflight: set[Future] = set()

    @property
    def calls(self) -> Counter[str]:
        return self.transport.calls

    # ------------------------------------------------------------------ the miss path
    def pull_async(self, keys: Sequence[ContentKey], *, leading: bool = True) -> Future:
        """Start making the leading run of ``keys`` local (a prefix chain: a key is of use only
        after all before it), on the link's pull thread: one registry lookup for those not held
        here, one fetch per group held elsewhere. The future's result: how many leading keys are
        held here now. ``leading=False``: keys independent of each other (encoder outputs),
        each pulled if held anywhere; the result is how many are held here now."""
        return self._submit(self._pulls, self._pull, list(keys), leading)

    def locate_async(self, keys: Sequence[ContentKey]) -> Future:
        """How many leading ``keys`` are held here or anywhere in the cluster (one registry
        lookup for those not held here; nothing is fetched), on the link's pull thread."""
        return self._submit(self._pulls, self._locate, list(keys))

    def found_async(self, keys: Sequence[ContentKey]) -> Future:
        """Which of ``keys`` (independent of each other) are held here or anywhere in the
        cluster: a list of bools (one registry lookup for those not held here; nothing is
        fetched), on the link's pull thread."""
        return self._submit(self._pulls, self._found, list(keys))

    def pull(self, keys: Sequence[ContentKey], *, leading: bool = True) -> int:
        """``pull_async`` and wait for it (a caller on a background thread: SGLang's prefetch,
        vLLM's loads); a pull that outlasts the wait lands later and is a miss now."""
        return self._result(self.pull_async(keys, leading=leading))

    def locate(self, keys: Sequence[ContentKey]) -> int:
        """``locate_async`` and wait for it."""
        return self._result(self.locate_async(keys))

    def _result(self, fut: Future) -> int:
        try:
            return fut.result(timeout=self.settings.call_timeout_s * 2)
        except TimeoutError:
            self.counters["timeouts"] += 1
            return 0

    def _lookup(self, keys: list[ContentKey], leading: bool = True
                ) -> tuple[list[bool], dict[ContentKey, Location]]:
        """``(held here, where the others after the first local miss live)``: one registry
        lookup; with ``leading`` the located run stops at the first key nobody holds."""
        held = self.cache.holds(keys)
        lead = next((i for i, h in enumerate(held) if not h), len(keys))
        missing = [k for k, h in zip(keys[lead:], held[lead:]) if not h]
        where: dict[ContentKey, Location] = {}
        if not missing:
            return held, where
        self.counters["lookups"] += 1
        for key, loc in zip(missing, self.transport.wait(self.transport.lookup_async([k.address for k in missing]),
                                                         len(missing))):
            if loc is None or not loc.holders:
                self.counters["lookup_misses"] += 1
                if leading:
                    break
                continue
            where[key] = loc
        return held, where

    def _locate(self, keys: list[ContentKey]) -> int:
        held, where = self._lookup(keys)
        return next((i for i, k in enumerate(keys) if not held[i] and k not in where), len(keys))

    def _found(self, keys: list[ContentKey]) -> list[bool]:
        held, where = self._lookup(keys, leading=False)
        return [h or k in where for h, k in zip(held, keys)]

    def _pull(self, keys: list[ContentKey], leading: bool) -> int:
        held, where = self._lookup(keys, leading)
        fetches = {}
        for key, loc in where.items():
            holder = placement.nearest_by_name([h for h, _tier in loc.holders], self.node)
            try:
                fetches[key] = holder, self.transport.fetch(holder, key.to_wire())
            except HolderLostError:
                self.counters["pull_failed"] += 1
                if leading:
                    break
        for i, key in enumerate(keys):
            if held[i]:
                continue
            pending = fetches.get(key)
            held[i] = pending is not None and self._land(key, *pending)
            if leading and not held[i]:
                return i
        return sum(held)

    def _land(self, key: ContentKey, holder: str, refs) -> bool:
        try:
            meta, buf = self.transport.land(refs, holder)     # a dead holder's handle is forgotten
            self.cache.import_pages(key, GroupPages.from_wire(meta, buf))
        except (MMTierError, ray.exceptions.RayError) as exc:
            log.warning("mmtier: pull of %r failed (%s: %s); a miss", key, type(exc).__name__, exc)
            self.transport.forget([key.address])     # a cached location it contradicted: dropped
            self.counters["pull_failed"] += 1
            return False
        self.counters["pulled"] += 1
        return True

    # ------------------------------------------------------------------ the save path
    def share(self, keys: Sequence[ContentKey]) -> Future:
        """Write these (new, local) groups through to the node store and publish them, on the
        link's thread; the future's result is how many the store took."""
        return self._submit(self._shares, self._share, list(keys))

    def _share(self, keys: list[ContentKey]) -> int:
        sent = []
        for key in keys:
            try:
                lease = self.cache.lease(key, LEASE_S)
            except MMTierError:                        # evicted meanwhile: nothing to share
                self.counters["share_failed"] += 1
                continue
            try:
                meta, buf = self.cache.export_pages(key, copy=False).to_wire()
                sent.append((key, self.transport.offload_async(self.store, key.to_wire(), meta, buf)))
                del buf                                # copied by the submission
            except (MMTierError, ray.exceptions.RayError) as exc:
                log.warning("mmtier: sharing %r failed (%s)", key, exc)
                self.counters["share_failed"] += 1
            finally:
                self.cache.release_lease(lease)
        items, removed = [], []
        for key, ref in sent:
            try:
                item, evicted = self.transport.result(ref, self.store)   # a restarted store: found again
            except (MMTierError, ray.exceptions.RayError) as exc:
                log.warning("mmtier: the node store did not take %r (%s)", key, exc)
                self.counters["share_failed"] += 1
                continue
            removed += evicted
            if item is not None:
                items.append(item)
        if items or removed:
            info = {"name": self.store, "node": self.node, "kind": "store"}
            try:
                self.transport.result(self.transport.publish(self.store, items, removed, info))
            except (MMTierError, ray.exceptions.RayError) as exc:
                # the store holds them; the registry learns of them at its next rebuild
                log.warning("mmtier: publishing %d groups failed (%s)", len(items), exc)
                self.counters["share_failed"] += len(items)
                return 0
        self.counters["shared"] += len(items)
        return len(items)

    # ------------------------------------------------------------------ waits and close
    def wait(self, timeout: float | None = None) -> None:
        """Block until every pull and share started so far is done (tests, shutdown)."""
        with self._lock:
            pending = list(self._inflight)
        _done, not_done = wait(pending, timeout=timeout or self.settings.call_timeout_s * 4)
        if not_done:
            raise TimeoutError(f"{len(not_done)} cluster transfers still running")

    def close(self) -> None:
        """Finish what is in flight (bounded), then stop the threads."""
        try:
            self.wait()
        except TimeoutError as exc:
            log.warning("mmtier: closing the cluster link with transfers still running (%s)", exc)
        self._pulls.shutdown(wait=False, cancel_futures=True)
        self._shares.shutdown(wait=False, cancel_futures=True)

    def _submit(self, pool: ThreadPoolExecutor, fn, *args) -> Future:
        fut = pool.submit(fn, *args)
        with self._lock:
            self._inflight.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: Future) -> None:
        with self._lock:
            self._inflight.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("mmtier: a cluster transfer failed unexpectedly", exc_info=fut.exception())
