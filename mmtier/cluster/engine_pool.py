"""``PoolHost``: the process that runs the model holds its device's pool.

An engine actor (a user's model actor, an engine worker) derives from ``PoolHost`` and is named
with ``host_name(node)``. It then *is* that device's pool holder on the cluster:

- it embeds a ``TieredKVCache`` for its device (the cluster's config, fetched once from the
  registry, so keys agree everywhere; the same per-pool config as a ``PagePoolActor``: no host
  tier, its own disk tier when the config has one), registers it with the ContentRegistry under
  its actor name and reports its inventory;
- other holders and clients reach it through its own actor methods, which are the pool's
  (``PoolService``: ``inventory``, ``holds``, ``export``, ``import_group``, ``attach`` /
  ``attend`` for partial attention, ``ping``, ``stats``...): exports go through the object store
  with no copy but the store's own (``transfer``);
- the model in the same process uses ``self.local`` (a ``HostedCache``): ``append``,
  ``attention``, ``attention_state`` over local groups make no Ray call; cluster traffic happens
  at turn boundaries only (``HostedCache.begin_turn`` / ``end_turn``).

Every Ray call of the embedded path goes through a ``RayTransport``, which counts them by kind
(``calls``): the count a test or an operator reads to see that a decode step makes none.

A ``PagePoolActor`` remains for memory with no model in front of it.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import ray

from ..config import CacheConfig
from ..errors import ConfigError, HolderLostError, MMTierError
from .actors import POOL_PREFIX, pool_config, pool_name, report_lost
from .metrics import ActorMetrics
from .node_labels import label_of_node
from .pool import PoolService
from .registry import Location
from .registry_shards import Pending, RegistryShards
from .settings import ClusterSettings
from .transfer import export_to_object_store


def host_name(node: str, index: int = 0) -> str:
    """The actor name of an engine's embedded pool on ``node`` (``mmtier-pool:<node>:host<i>``):
    a pool's name, so the registry's sweep and rebuild and every client find it as one."""
    return pool_name(node, "host", index)


class RayTransport:
    """The embedded pool's Ray calls, counted by kind: ``config``, ``lookup``, ``fetch``,
    ``publish``, ``offload``, ``announce``, and for groups attended where they live
    ``attach``, ``attend``, ``release``. Waits are bounded by ``call_timeout_s``."""

    def __init__(self, settings: ClusterSettings):
        self.settings = settings
        self.calls: Counter[str] = Counter()
        self._handles: dict[str, Any] = {}
        self.registry = RegistryShards(settings)
        # one thread that waits for fetched buffers to be local: Ray pulls an object to a node
        # only once someone there waits for it, so this starts the transfer at the fetch
        self._puller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmtier-pull")
        # one thread that submits, in order, the calls nobody waits for (publishes, releases):
        # a submission serializes its arguments, about a millisecond the turn no longer spends
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmtier-send")
        self._last_sent: Future | None = None

    def config(self) -> dict:
        self.calls["config"] += 1
        return self.registry.config().get(self.settings.call_timeout_s)

    def announce(self, info: dict, inventory: list[dict]) -> None:
        """Fire and forget: this holder (re)started with this inventory."""
        self.calls["announce"] += 1
        self.registry.sync_holder(info, inventory)

    def lookup_async(self, addresses: list[str]):
        """One batched registry lookup, sent now (after what the sender thread still has to
        send, so it never overtakes a publish); ``wait`` reads its answer."""
        self.calls["lookup"] += 1
        self._sent()
        return self.registry.lookup(addresses)

    def wait(self, ref, n: int) -> list[Location | None]:
        """The lookup's answer; all misses when the registry did not answer in time (the
        turn recomputes what it lacks rather than fail)."""
        locs = ref.get(self.settings.call_timeout_s)    # a shard down or silent: misses
        if ref.failed:
            self.calls["lookup_failed"] += 1
        return locs if len(locs) == n else [None] * n

    def forget(self, addresses: list[str]) -> None:
        """A holder did not have what a (cached) lookup said it had: ask the registry next time."""
        self.registry.forget(addresses)

    def fetch(self, holder: str, wire: dict[str, str]):
        """Start pulling a whole group from ``holder``: ``(meta ref, buffer ref)``; nothing waits.
        The bytes start moving to this node as soon as the export is in ``holder``'s object
        store (``pull``), so they travel while the turn computes."""
        self.calls["fetch"] += 1
        refs = self.handle(holder).export.options(num_returns=2).remote(wire)
        self.pull(refs[1:])
        return refs

    def pull(self, refs: list) -> None:
        """Have Ray bring these objects to this node now, in the background (a wait for them
        to be local, bounded by the call timeout, on the pull thread). Its outcome is not read
        here: ``land`` reads the objects and sees any failure itself."""
        self._puller.submit(ray.wait, list(refs), num_returns=len(refs), fetch_local=True,
                            timeout=self.settings.call_timeout_s)

    def land(self, refs, holder: str | None = None) -> tuple[dict, np.ndarray]:
        """Wait for a fetch from ``holder``: ``(meta, page buffer)``, one ``ray.get`` of both
        returns (the buffer pulled to this node's object store and read there zero-copy)."""
        meta, buf = self.result(list(refs), holder)
        return meta, buf

    def result(self, ref, holder: str | None = None):
        """Wait for a call's answer within ``call_timeout_s``: an ``MMTierError`` raised remotely
        comes back as itself, a dead or silent actor (``holder``, when named) as
        ``HolderLostError``, and its handle is forgotten: a holder restarted under the same
        name (a store or engine killed and started again) is looked up afresh."""
        try:
            if isinstance(ref, Pending):                 # a registry call (one per shard)
                return ref.get(self.settings.call_timeout_s)
            return ray.get(ref, timeout=self.settings.call_timeout_s)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, MMTierError):
                raise exc.cause from None
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError) as exc:
            if holder is not None:
                self._handles.pop(holder, None)
            raise HolderLostError(f"{holder or 'a call'} failed ({type(exc).__name__})") from None

    def publish(self, holder: str, items: list[dict], removed: list[str], info: dict):
        """One call, nothing waits: groups this holder now holds and those it gave up. Returns
        the call's ref for a caller that wants the registry's acknowledgement (``result``)."""
        self.calls["publish"] += 1
        self._sent()
        return self.registry.publish(holder, items, removed, info)

    def publish_later(self, holder: str, items: list[dict], removed: list[str], info: dict) -> None:
        """``publish``, submitted on the sender thread after every call handed to it before
        (a turn's publish, off the turn's path; the caller hands the lists over and does not
        change them)."""
        self.calls["publish"] += 1
        self._last_sent = self._sender.submit(self.registry.publish, holder, items, removed, info)

    def offload(self, store: str, wire: dict[str, str], meta: dict, buf: np.ndarray):
        """Hand a group to the node store and wait for its answer (``offload_async``)."""
        return self.result(self.offload_async(store, wire, meta, buf))

    def offload_async(self, store: str, wire: dict[str, str], meta: dict, buf: np.ndarray):
        """Send a group to the node store, one call: the submission itself copies ``buf`` into
        the object store, so the caller may let go of it (and of its lease) on return."""
        self.calls["offload"] += 1
        return self.handle(store).import_group.remote(wire, meta, buf)

    # ---- groups attended where they live (the "remote" plan)
    def attach(self, holder: str, proxy, tenant: str, wire: dict[str, str]):
        """Reference a group at ``holder`` from this pool's proxy sequence there (created when
        ``proxy`` is None): ``(proxy handle, start in it, tokens, evicted)``; waits."""
        self.calls["attach"] += 1
        return self.result(self.handle(holder).attach.remote(proxy, tenant, wire), holder)

    def attend(self, holder: str, parts: list, layer: int, q, q_pos, causal: bool, scale):
        """Partial attention at ``holder`` over its parts, sent now; ``attended`` reads it."""
        self.calls["attend"] += 1
        return self.handle(holder).attend.remote(parts, layer, q, q_pos, causal, scale)

    def attended(self, ref, holder: str):
        return self.result(ref, holder)

    def release(self, holder: str, proxies: list) -> None:
        """Fire and forget: drop this pool's proxy sequences at ``holder`` (sender thread)."""
        self.calls["release"] += 1
        self._last_sent = self._sender.submit(self.handle(holder).release.remote, proxies)

    def _sent(self) -> None:
        """Wait (bounded) until the sender thread has submitted everything handed to it (done
        long before in a quiet actor: it runs between turns), so no registry call sent now
        overtakes one handed to it."""
        last, self._last_sent = self._last_sent, None
        if last is not None:
            try:
                last.result(timeout=self.settings.call_timeout_s)
            except FutureTimeout:
                self.calls["send_late"] += 1

    def handle(self, name: str):
        h = self._handles.get(name)
        if h is None:
            try:
                h = self._handles[name] = ray.get_actor(name, namespace=self.settings.namespace)
            except ValueError:
                raise HolderLostError(f"{name} is gone") from None
        return h


class PoolHost(PoolService):
    """Base class of an engine actor that holds its device's pool (see the module doc).

    ``device``: ``"cuda"`` (the actor's GPU) or ``"cpu"``. ``device_bytes``: this engine's
    arena, when it is not the cluster config's (an engine sizes it from what its model leaves
    free). ``transport``: for tests that count calls some other way; the default is a
    ``RayTransport``."""

    def __init__(self, settings: ClusterSettings | None = None, *, device: str = "cpu",
                 device_bytes: int | None = None, transport: RayTransport | None = None):
        settings = settings or ClusterSettings()
        ctx = ray.get_runtime_context()
        name = ctx.get_actor_name()
        if not name or not name.startswith(POOL_PREFIX):
            raise ConfigError(f"a PoolHost must be an actor named with mmtier.cluster.host_name(node) "
                              f"in namespace {settings.namespace!r}, not {name!r}")
        self.settings = settings
        self.transport = transport or RayTransport(settings)
        label = label_of_node(ctx.get_node_id(), ray.nodes())     # refused if another live node has it
        cfg = pool_config(CacheConfig(**self.transport.config()), name, device, settings, label)
        if device_bytes is not None:
            cfg = CacheConfig(**{**cfg.model_dump(), "device_bytes": device_bytes})
        super().__init__(cfg, name=name, node=ctx.get_node_id())
        self.metrics = ActorMetrics(name)
        self.on_lost = lambda digests: report_lost(settings, name, digests)
        self.transport.announce(PoolService.ping(self), self.inventory())

        from .engine_cache import HostedCache

        self.local = HostedCache(self)

    # ---- the pool's actor methods, with the Ray edge of transfers ----
    def ping(self) -> dict[str, str]:
        if self.metrics.due():
            self.metrics.publish(self.stats())
        return super().ping()

    def export(self, wire: dict[str, str]) -> tuple[dict, np.ndarray]:
        return export_to_object_store(self, wire)

    def stats(self) -> dict:
        d = super().stats()
        d["host"] = self.local.turn_stats()
        return d
