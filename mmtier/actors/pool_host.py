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
from typing import Any

import numpy as np
import ray

from ..config import CacheConfig
from ..errors import ConfigError, HolderLostError, MMTierError
from .launch import POOL_PREFIX, _report_lost, pool_config, pool_name
from .metrics import ActorMetrics
from .pool_actor import PoolService
from .registry import Location
from .settings import ClusterSettings
from .transfer import export_to_object_store


def host_name(node: str, index: int = 0) -> str:
    """The actor name of an engine's embedded pool on ``node`` (``mmtier-pool:<node>:host<i>``):
    a pool's name, so the registry's sweep and rebuild and every client find it as one."""
    return pool_name(node, "host", index)


class RayTransport:
    """The embedded pool's Ray calls, counted by kind: ``config``, ``lookup``, ``fetch``,
    ``publish``, ``offload``, ``announce``. Waits are bounded by ``call_timeout_s``."""

    def __init__(self, settings: ClusterSettings):
        self.settings = settings
        self.calls: Counter[str] = Counter()
        self._handles: dict[str, Any] = {}
        self.registry = ray.get_actor(settings.registry_name, namespace=settings.namespace)

    def config(self) -> dict:
        self.calls["config"] += 1
        return ray.get(self.registry.config.remote(), timeout=self.settings.call_timeout_s)

    def announce(self, info: dict, inventory: list[dict]) -> None:
        """Fire and forget: this holder (re)started with this inventory."""
        self.calls["announce"] += 1
        self.registry.sync_holder.remote(info, inventory)

    def lookup_async(self, digests: list[str]):
        """One batched registry lookup, sent now; ``wait`` reads its answer."""
        self.calls["lookup"] += 1
        return self.registry.lookup.remote(digests)

    def wait(self, ref, n: int) -> list[Location | None]:
        """The lookup's answer; all misses when the registry did not answer in time (the
        turn recomputes what it lacks rather than fail)."""
        try:
            return ray.get(ref, timeout=self.settings.call_timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError,
                ray.exceptions.ActorUnavailableError):
            self.calls["lookup_failed"] += 1
            return [None] * n

    def fetch(self, holder: str, wire: dict[str, str]):
        """Start pulling a whole group from ``holder``: ``(meta ref, buffer ref)``; nothing waits."""
        self.calls["fetch"] += 1
        return self.handle(holder).export.options(num_returns=2).remote(wire)

    def land(self, refs) -> tuple[dict, np.ndarray]:
        """Wait for a fetch: ``(meta, page buffer)``, one ``ray.get`` of both returns (the
        buffer pulled to this node's object store and read there zero-copy)."""
        meta, buf = self.result(list(refs))
        return meta, buf

    def result(self, ref):
        """Wait for a call's answer within ``call_timeout_s``: an ``MMTierError`` raised remotely
        comes back as itself, a dead or silent actor as ``HolderLostError``."""
        try:
            return ray.get(ref, timeout=self.settings.call_timeout_s)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, MMTierError):
                raise exc.cause from None
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError) as exc:
            raise HolderLostError(f"a call failed ({type(exc).__name__})") from None

    def publish(self, holder: str, items: list[dict], removed: list[str], info: dict):
        """One call, nothing waits: groups this holder now holds and those it gave up. Returns
        the call's ref for a caller that wants the registry's acknowledgement (``result``)."""
        self.calls["publish"] += 1
        return self.registry.publish.remote(holder, items, removed, info)

    def offload(self, store: str, wire: dict[str, str], meta: dict, buf: np.ndarray):
        """Hand a group to the node store and wait for its answer (``offload_async``)."""
        return self.result(self.offload_async(store, wire, meta, buf))

    def offload_async(self, store: str, wire: dict[str, str], meta: dict, buf: np.ndarray):
        """Send a group to the node store, one call: the submission itself copies ``buf`` into
        the object store, so the caller may let go of it (and of its lease) on return."""
        self.calls["offload"] += 1
        return self.handle(store).import_group.remote(wire, meta, buf)

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

    ``device``: ``"cuda"`` (the actor's GPU) or ``"cpu"``. ``transport``: for tests that count
    calls some other way; the default is a ``RayTransport``."""

    def __init__(self, settings: ClusterSettings | None = None, *, device: str = "cpu",
                 transport: RayTransport | None = None):
        settings = settings or ClusterSettings()
        ctx = ray.get_runtime_context()
        name = ctx.get_actor_name()
        if not name or not name.startswith(POOL_PREFIX):
            raise ConfigError(f"a PoolHost must be an actor named with mmtier.actors.host_name(node) "
                              f"in namespace {settings.namespace!r}, not {name!r}")
        self.settings = settings
        self.transport = transport or RayTransport(settings)
        base = CacheConfig(**self.transport.config())
        super().__init__(pool_config(base, name, device, settings), name=name, node=ctx.get_node_id())
        self.metrics = ActorMetrics(name)
        self.on_lost = lambda digests: _report_lost(settings, name, digests)
        self.transport.announce(PoolService.ping(self), self.inventory())

        from .hosted import HostedCache

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
