"""A Ray Serve request router that sends a request to the replica whose node holds its groups.

    LLMConfig(..., deployment_config={"request_router_config": {
        "request_router_class": "mmtier.serve.affinity_router:MMTierAffinityRouter",
        "request_router_kwargs": {"llm_config": <this LLMConfig's dump>, "timeout_s": 0.25}}})

Beside Ray Serve LLM's ``PrefixCacheAffinityRouter`` (which guesses from the prompt's text which
replica saw it), this one asks mmtier: the engines' connectors write what they save through to
their node's store and publish it in the ContentRegistry, so the registry knows which node
holds each image's encoder output and each prompt segment's KV. Per request: its keys, made as
the connectors make them (``request_keys.RequestKeyer``, on its own thread), then **one**
batched registry lookup of all of them (media first), followed through the chunks an earlier
turn ended inside as the connector's scheduler follows them (``held_chain``: a conversation's
previous prompt or answer, decode saves included; two more lookups per fork), then
``best_node``: the node holding most of the request's media, ties broken by the longest leading
run of prompt tokens it holds. A
replica on that node is ranked first; Serve's default choice (power of two choices over all
replicas) comes after it, so a full replica still yields. Nothing held, a keying or lookup
failure, or no answer within ``timeout_s`` (keys and lookup together): the default choice alone.
A replica elsewhere still reads the groups through the cluster (its connectors pull them);
affinity saves those pulls. ``stats`` counts the outcomes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from ..cluster.registry import Location
from .request_keys import RequestKeyer, RequestKeys, held_chain

log = logging.getLogger(__name__)
HOLDERS_TTL_S = 5.0        # how long the registry's holder -> node map is trusted
MAX_PENDING = 4096         # answers kept for requests not yet routed


def best_node(keys: RequestKeys, found: Sequence[Location | None], node_of: Mapping[str, str]
              ) -> str | None:
    """The node that holds most of ``keys.media``, then the longest leading run of
    ``keys.prefix`` (in tokens); ``None`` when no node holds any of them. ``found``: the
    registry's answer for ``keys.addresses()``, in that order; ``node_of``: holder -> node
    (holders it does not name are skipped)."""
    media, prefix = found[:len(keys.media)], found[len(keys.media):]
    score: dict[str, list[int]] = {}
    for loc in media:
        for node in _nodes(loc, node_of):
            score.setdefault(node, [0, 0])[0] += 1
    live = None                                   # nodes holding every segment so far
    for (_, tokens), loc in zip(keys.prefix, prefix, strict=True):
        here = _nodes(loc, node_of) if live is None else live & _nodes(loc, node_of)
        if not here:
            break
        for node in here:
            score.setdefault(node, [0, 0])[1] += tokens
        live = here
    if not score:
        return None
    return max(sorted(score), key=lambda n: tuple(score[n]))


def _nodes(loc: Location | None, node_of: Mapping[str, str]) -> set[str]:
    if loc is None:
        return set()
    return {node_of[h] for h, _ in loc.holders if h in node_of}


class MMTierAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's default router (power of two choices, FIFO, locality and multiplexing: its own
    state, its own bases) with mmtier's preference ranked before its choice. See the module
    docstring."""

    def initialize_state(self, llm_config: dict | None = None, timeout_s: float = 0.25, **_: Any) -> None:
        if llm_config is None:
            raise TypeError("MMTierAffinityRouter needs request_router_kwargs={'llm_config': ...}")
        self._timeout_s = float(timeout_s)
        self._keyer = RequestKeyer(llm_config)
        self._node_of: dict[str, str] = {}
        self._node_of_at = 0.0
        self._answers: dict[str, tuple[asyncio.Future, float]] = {}   # request id -> (its node, asked at)
        self.stats: Counter[str] = Counter()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        fallback = await super().choose_replicas(candidate_replicas, pending_request)
        if pending_request is None or not fallback or not pending_request.args:
            return fallback
        node = await self._preferred_node(pending_request)
        preferred = [r for r in candidate_replicas if node is not None and r.node_id == node]
        if not preferred:
            return fallback
        return [preferred, *fallback]

    async def _preferred_node(self, pr: PendingRequest) -> str | None:
        rid = pr.metadata.internal_request_id
        entry = self._answers.get(rid)
        if entry is None:                  # once per request, however often Serve asks again
            if len(self._answers) > MAX_PENDING:      # requests Serve never reported routed
                self._answers = {k: v for k, v in self._answers.items() if not v[0].done()}
            entry = self._answers[rid] = (asyncio.ensure_future(self._locate(pr.args[0])), time.monotonic())
        answer, started = entry
        left = self._timeout_s - (time.monotonic() - started)
        try:
            node = await asyncio.wait_for(asyncio.shield(answer), max(left, 0.0))
        except (TimeoutError, asyncio.TimeoutError):
            self.stats["timeout"] += 1
            return None
        except Exception as exc:           # a request the renderer refuses, a registry gone
            self.stats["failed"] += 1
            log.debug("mmtier affinity: no preference (%s)", exc)
            return None
        self.stats["affinity" if node is not None else "nothing_held"] += 1
        return node

    async def _locate(self, request: Any) -> str | None:
        keys = await asyncio.wrap_future(self._keyer.submit(request))
        if not keys.addresses():
            return None
        registry = self._keyer.transport.registry
        keys, found = await held_chain(keys, registry.lookup)     # through earlier turns' forks
        holders = {h for loc in found if loc is not None for h, _ in loc.holders}
        if holders - self._node_of.keys() or time.monotonic() - self._node_of_at > HOLDERS_TTL_S:
            self._node_of = {h.name: h.node for h in await registry.holders()}
            self._node_of_at = time.monotonic()
        return best_node(keys, found, self._node_of)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        entry = self._answers.pop(pending_request.metadata.internal_request_id, None)
        if entry is not None and not entry[0].done():
            entry[0].cancel()


ROUTER_CLASS = "mmtier.serve.affinity_router:MMTierAffinityRouter"
KEYED_FIELDS = ("model_loading_config", "engine_kwargs", "accelerator_config", "accelerator_type")


def router_config(llm_config: Mapping[str, Any], *, timeout_s: float = 0.25) -> dict[str, Any]:
    """The ``request_router_config`` of an ``LLMConfig`` (given as its fields, a mapping) that
    routes by what mmtier holds: its kwargs carry the fields the keyer renders requests with."""
    keyed = {k: llm_config[k] for k in KEYED_FIELDS if llm_config.get(k) is not None}
    return {"request_router_class": ROUTER_CLASS,
            "request_router_kwargs": {"llm_config": keyed, "timeout_s": timeout_s}}
