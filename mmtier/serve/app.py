"""The Ray Serve application: an HTTP JSON API over a chat model and the cluster cache.

``serve run configs/serve.yaml`` (or ``mmtier serve --config configs/serve.yaml``) calls
``build_app(args)``, which

1. starts mmtier on the cluster when ``start_cache`` is set (idempotent: registry, a pool per
   GPU / CPU node, a store per node);
2. creates one ``TurnWorker`` per node, pinned there by a per-node resource
   (``routing.pin_targets``: ``node:<ip>`` in production, custom resources in tests): a named
   actor (``host_name(node)``) that runs the model (``engines.py``; the transformers chat model
   by default) and holds that node's pool itself;
3. puts ``TurnIngress`` in front: it authenticates (API key -> tenant, server side), parses
   and checks the request, decodes (PNG / JPEG / PCM16 WAV) and hashes the media, asks the
   ContentRegistry where the request's content-only groups live (one batched lookup per
   request, whatever the number of media items; keys from the engine's ``Frontend``, as its
   conversations compute them) and forwards the turn to the worker on that node
   (``routing.Router``: conversation, then content, then least loaded).

Routes: ``POST /v1/turn``, ``DELETE /v1/conversations/{id}``, ``GET /healthz``. The protocol
and its status codes are in ``protocol.py``. Nodes that join after deployment get a worker on
the next deploy (``serve deploy`` / ``mmtier serve``); until then they hold cache content only.
"""

from __future__ import annotations

import asyncio
import logging

from ..errors import ConfigError
from .config import ServeAppConfig
from .protocol import HTTPError, MediaItem, TurnRequest, api_key, parse_turn
from .routing import Router, pin_targets
from .worker import TurnWorker

log = logging.getLogger(__name__)

TURN_TIMEOUT_S = 300.0


class TurnIngress:
    """HTTP entry: auth, parsing, media hashing, affinity routing (a plain class)."""

    def __init__(self, cfg_json: dict, workers: dict):
        from ..actors import connect
        from .engines import load_frontend

        self.cfg = ServeAppConfig.parse(cfg_json)
        self.keys = self.cfg.key_table()
        import ray

        ns = ServeAppConfig.parse(cfg_json).settings().namespace
        self.workers = {node: ray.get_actor(name, namespace=ns) for node, name in workers.items()}   # node -> worker
        self.index = {i: node for i, node in enumerate(sorted(self.workers))}
        self.node_index = {node: i for i, node in self.index.items()}
        self.cluster = connect(self.cfg.settings())
        self.frontend = load_frontend(self.cfg.model)
        self.router = Router(sorted(self.workers))
        self._holders: dict[str, tuple[str, str] | None] = {}

    # ------------------------------------------------------------------ HTTP
    async def __call__(self, request):
        from starlette.responses import JSONResponse

        try:
            status, body = await self._dispatch(request)
        except HTTPError as exc:
            status, body = exc.status, exc.body()
        except Exception:                                  # a server fault, not the client's
            log.exception("unhandled error")
            status, body = 500, HTTPError(500, "internal", "internal server error").body()
        return JSONResponse(body, status_code=status)

    async def _dispatch(self, request) -> tuple[int, dict]:
        path, method = request.url.path.rstrip("/") or "/", request.method
        if path == "/healthz":
            return 200, {"status": "ok", "workers": len(self.workers)}
        if path == "/v1/turn":
            if method != "POST":
                raise HTTPError(405, "method_not_allowed", "use POST /v1/turn")
            tenant = self._tenant(request)
            body = await self._body(request)          # media decoded off the event loop
            turn = await asyncio.to_thread(parse_turn, body, self.cfg.limits, self._media_tokens)
            return await self._turn(tenant, turn)
        if path.startswith("/v1/conversations/"):
            if method != "DELETE":
                raise HTTPError(405, "method_not_allowed", "use DELETE /v1/conversations/{id}")
            tenant = self._tenant(request)
            conv = path.removeprefix("/v1/conversations/")
            node = self._conversation_node(conv)
            return await self._call(node, "close_conversation", tenant, conv)
        raise HTTPError(404, "not_found", f"no route {method} {path}")

    def _media_tokens(self, item: MediaItem) -> int:
        return self.frontend.media_tokens(item.type, item.data)

    def _tenant(self, request) -> str:
        key = api_key(request.headers)
        tenant = self.keys.tenant(key)
        if tenant is None:
            raise HTTPError(401, "unauthorized", "missing or unknown API key (Authorization: Bearer "
                                                 "<key> or X-API-Key: <key>)")
        return tenant

    async def _body(self, request) -> bytes:
        limit = self.cfg.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, "too_large", f"request body of {declared} bytes is over the {limit}-byte limit")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, "too_large", f"request body is over the {limit}-byte limit")
            chunks.append(chunk)
        return b"".join(chunks)

    # ------------------------------------------------------------------ turns
    async def _turn(self, tenant: str, turn: TurnRequest) -> tuple[int, dict]:
        media = turn.media
        locs = await self._locate(tenant, media)
        conv_node = self._conversation_node(turn.conversation_id) if turn.conversation_id else None
        scores = self.router.scores((loc for pair in locs for loc in pair), self._holder)
        route = self.router.choose(scores, conv_node)
        items = [(i.type, i.data) if isinstance(i, MediaItem) else ("text", i.text) for i in turn.content]
        try:
            status, body = await self._call(route.node, "turn", tenant, turn.conversation_id, items,
                                            turn.max_new_tokens)
        except HTTPError as exc:
            other = self.router.failover(route.node, scores) if exc.kind == "worker_lost" and \
                turn.conversation_id is None else None
            if other is None:
                raise
            route = other                                  # a new conversation: nothing lost
            status, body = await self._call(route.node, "turn", tenant, None, items, turn.max_new_tokens)
        if status == 200:
            body["routing"] = {"rule": route.rule, "node": route.node,
                               "content_bytes_by_node": route.scores}
            body["cache"]["media"] = [
                {"type": m.type, "media_type": m.info.media_type, "sha256": m.sha256, "bytes": len(m.data),
                 "cached": any(loc is not None for loc in item_locs),
                 "nodes": sorted({h[0] for h in map(self._holder, _names(*item_locs)) if h})}
                for m, item_locs in zip(media, locs)]
            body["cache"]["hit"] = any(x["cached"] for x in body["cache"]["media"])
        return status, body

    async def _locate(self, tenant: str, media) -> list[tuple]:
        """Per media item: the registry's Locations of its content-only groups for this tenant
        (cross-attention K/V, encoder outputs; None where not held)."""
        if not media:
            return []
        per_item = [self.frontend.routing_keys(self.cluster, tenant, m.type, m.data) for m in media]
        locs = await self.cluster.locate_many_async([k for keys in per_item for k in keys])  # one call
        out, i = [], 0
        for keys in per_item:
            out.append(tuple(locs[i:i + len(keys)]))
            i += len(keys)
        return out

    def _holder(self, name: str) -> tuple[str, str] | None:
        if name not in self._holders:                     # a holder we have not seen: look again
            self.cluster.refresh()
            for node in self.workers:
                for p in self.cluster.pools(node):
                    self._holders[p] = (node, "pool")
                for s in self.cluster.stores(node):
                    self._holders[s] = (node, "store")
            self._holders.setdefault(name, None)          # not on a worker node: never scores
        return self._holders[name]

    def _conversation_node(self, conv: str) -> str:
        head, _, _ = conv.partition(".")
        node = self.index.get(int(head[1:])) if head[:1] == "w" and head[1:].isdigit() else None
        if node is None:
            raise HTTPError(404, "unknown_conversation", f"no open conversation {conv!r}")
        return node

    async def _call(self, node: str, method: str, *args) -> tuple[int, dict]:
        self.router.inflight[node] += 1
        import ray

        try:
            return await asyncio.wait_for(getattr(self.workers[node], method).remote(*args), TURN_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise HTTPError(503, "timeout", f"the worker on node {node} did not answer in time") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            raise HTTPError(503, "worker_lost", f"the worker on node {node} died (it restarts with an empty "
                                                "pool; its conversations are gone): start again") from None
        finally:
            self.router.inflight[node] -= 1


def _names(*locs) -> list[str]:
    return [name for loc in locs if loc is not None for name, _tier in loc.holders]


# ---------------------------------------------------------------------- the Serve edge
def build_app(args: dict | None = None):
    """The Serve application (``import_path: mmtier.serve.app:build_app``)."""
    import ray
    from ray import serve

    from ..actors import start
    from ..actors.pool_host import host_name

    cfg = ServeAppConfig.parse(args)
    cfg.key_table()                                     # fail at deploy time, not per request
    cache_cfg = cfg.cache_config()                      # refuses the public default key secret
    cfg_json = cfg.model_dump(mode="json")
    if not ray.is_initialized():
        ray.init(address="auto", namespace=cfg.settings().namespace)
    if cfg.start_cache:
        start(cache_cfg, cfg.settings())
    targets = pin_targets(ray.nodes(), cfg.affinity.pin_resource_prefix)
    if not targets:
        raise ConfigError("no node to pin a worker to: with affinity.pin_resource_prefix set, give "
                          "each node a custom resource with that prefix", ("affinity.pin_resource_prefix",))
    w, ing = cfg.workers, cfg.ingress
    settings = cfg.settings()
    worker = ray.remote(TurnWorker)
    workers = {}
    for i, t in enumerate(sorted(targets, key=lambda t: t.node)):
        # a named actor that holds its node's pool (the model and its cache in one process);
        # restarted with an empty pool if it dies (its groups leave the registry at once)
        workers[t.node] = worker.options(
            name=host_name(t.node), namespace=settings.namespace, get_if_exists=True, lifetime="detached",
            max_restarts=-1, max_concurrency=w.max_ongoing_requests + settings.pool_concurrency,
            num_cpus=w.num_cpus, resources={t.resource: cfg.affinity.pin_amount},
        ).remote(cfg_json, i, t.node)
    ray.get([h.ping.remote() for h in workers.values()], timeout=settings.start_timeout_s)
    names = {node: host_name(node) for node in workers}
    ingress = serve.deployment(TurnIngress).options(
        name="mmtier-ingress", num_replicas=ing.num_replicas, max_ongoing_requests=ing.max_ongoing_requests,
        ray_actor_options={"num_cpus": ing.num_cpus})
    return ingress.bind(cfg_json, names)
