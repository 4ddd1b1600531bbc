"""The Ray Serve application: the OpenAI chat completions API over a chat model and the cluster
cache.

``serve run configs/serve.yaml`` (or ``mmtier serve --config configs/serve.yaml``) calls
``build_app(args)``, which

1. starts mmtier on the cluster when ``start_cache`` is set (idempotent: registry, a store per
   node, CPU pools on nodes without GPUs; a GPU node's GPU is left to its worker);
2. creates one ``TurnWorker`` per node, pinned there by a per-node resource
   (``routing.pin_targets``: ``node:<ip>`` in production, custom resources in tests): a named
   actor (``host_name(node)``) that runs the model (``model_api.py``; the transformers chat model
   by default) and holds that node's pool itself, on the node's GPU when it has one
   (``num_gpus=1``, the pool on ``cuda``; ``workers.device``), else on the CPU;
3. puts ``ChatIngress`` in front: it authenticates (API key -> tenant, server side), parses
   and checks the request (``protocol.py``), decodes (PNG / JPEG / MP4 / PCM16 WAV) and hashes
   the media, asks the ContentRegistry where the request's content lives (its history's prefix
   groups and its media's content-only groups; one batched lookup per request, keys from the
   engine's ``Frontend``, as the engine computes them) and forwards the request to the worker
   on that node (``routing.Router``: content, then least loaded).

Routes: ``POST /v1/chat/completions`` (stateless: the request carries the conversation;
``stream: true`` answers as server-sent events), ``GET /v1/models``, ``GET /healthz``. Answers
and errors are OpenAI's shapes (``completions.py``, ``protocol.py``). Nodes that join after
deployment get a worker on the next deploy (``serve deploy`` / ``mmtier serve``); until then they
hold cache content only.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..errors import ConfigError
from .completions import chunks, completion, completion_id
from .config import ServeAppConfig
from .protocol import ChatRequest, HTTPError, MediaItem, TextItem, api_key, parse_chat
from .routing import Router, pin_targets
from .worker import TurnWorker

log = logging.getLogger(__name__)

TURN_TIMEOUT_S = 300.0


class ChatIngress:
    """HTTP entry: auth, parsing, media hashing, affinity routing (a plain class)."""

    def __init__(self, cfg_json: dict, workers: dict):
        import ray

        from ..cluster import connect
        from .engine_loader import load_frontend

        self.cfg = ServeAppConfig.parse(cfg_json)
        self.keys = self.cfg.key_table()
        self.model = self.cfg.served_model_name
        self.created = int(time.time())
        ns = self.cfg.settings().namespace
        self.workers = {node: ray.get_actor(name, namespace=ns) for node, name in workers.items()}   # node -> worker
        self.cluster = connect(self.cfg.settings())
        self.frontend = load_frontend(self.cfg.model)
        self.router = Router(sorted(self.workers))
        self._holders: dict[str, tuple[str, str] | None] = {}

    # ------------------------------------------------------------------ HTTP
    async def __call__(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            answer = await self._dispatch(request)
        except HTTPError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        except Exception:                                  # a server fault, not the client's
            log.exception("unhandled error")
            return JSONResponse(HTTPError(500, "internal", "internal server error").body(), status_code=500)
        if isinstance(answer, dict):
            return JSONResponse(answer)
        return StreamingResponse(answer, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _dispatch(self, request):
        path, method = request.url.path.rstrip("/") or "/", request.method
        if path == "/healthz":
            return {"status": "ok", "workers": len(self.workers)}
        if path == "/v1/models":
            if method != "GET":
                raise HTTPError(405, "method_not_allowed", "use GET /v1/models")
            self._tenant(request)
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                                "owned_by": "mmtier"}]}
        if path == "/v1/chat/completions":
            if method != "POST":
                raise HTTPError(405, "method_not_allowed", "use POST /v1/chat/completions")
            tenant = self._tenant(request)
            body = await self._body(request)          # media decoded off the event loop
            chat = await asyncio.to_thread(parse_chat, body, self.cfg.limits, self.model, self._media_tokens)
            return await self._complete(tenant, chat)
        raise HTTPError(404, "not_found", f"no route {method} {path}")

    def _media_tokens(self, item: MediaItem) -> int:
        return self.frontend.media_tokens(item.type, item.data)

    def _tenant(self, request) -> str:
        key = api_key(request.headers)
        tenant = self.keys.tenant(key)
        if tenant is None:
            raise HTTPError(401, "invalid_api_key", "missing or unknown API key (Authorization: Bearer "
                                                    "<key> or X-API-Key: <key>)")
        return tenant

    async def _body(self, request) -> bytes:
        limit = self.cfg.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, "too_large", f"request body of {declared} bytes is over the {limit}-byte limit")
        chunks_, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, "too_large", f"request body is over the {limit}-byte limit")
            chunks_.append(chunk)
        return b"".join(chunks_)

    # ------------------------------------------------------------------ requests
    async def _complete(self, tenant: str, chat: ChatRequest):
        history = [(_items(turn), answer) for turn, answer in chat.history]
        items = _items(chat.content)
        media = chat.media
        media_locs, prefix_locs = await self._locate(tenant, media, history, items)
        located = [loc for pair in media_locs for loc in pair] + prefix_locs
        scores = self.router.scores(located, self._holder)
        route = self.router.choose(scores)
        try:
            status, body = await self._call(route.node, tenant, history, items, chat.max_new_tokens)
        except HTTPError as exc:
            other = self.router.failover(route.node, scores) if exc.code == "worker_lost" else None
            if other is None:
                raise
            route = other                                  # stateless: nothing lost with the worker
            status, body = await self._call(route.node, tenant, history, items, chat.max_new_tokens)
        if status != 200:
            raise HTTPError(status, body["error"]["code"], body["error"]["message"])
        cache = body["cache"]
        cache["media"] = [
            {"type": m.type, "media_type": m.info.media_type, "sha256": m.sha256, "bytes": len(m.data),
             "cached": any(loc is not None for loc in item_locs),
             "nodes": sorted({h[0] for h in map(self._holder, _names(*item_locs)) if h})}
            for m, item_locs in zip(media, media_locs)]
        cache["hit"] = any(x["cached"] for x in cache["media"])
        cache["prefix_groups"] = {"sent": len(prefix_locs), "held": sum(loc is not None for loc in prefix_locs)}
        extra = {"tokens": body["tokens"], "node": body["node"], "worker": body["worker"],
                 "seconds": body["seconds"], "routing": {"rule": route.rule, "node": route.node,
                                                         "content_bytes_by_node": route.scores},
                 "cache": cache}
        cid = completion_id()
        if chat.stream:
            return chunks(cid, self.model, body, chat.max_new_tokens, chat.include_usage, extra)
        return completion(cid, self.model, body, chat.max_new_tokens, extra)

    async def _locate(self, tenant: str, media: list[MediaItem], history: list, items: list
                      ) -> tuple[list[tuple], list]:
        """Per media item: the registry's Locations of its content-only groups for this tenant
        (cross-attention K/V, encoder outputs; None where not held); and the Locations of the
        conversation's prefix groups (its history's spans), all in one registry call."""
        per_item, prefix = await asyncio.to_thread(self._keys, tenant, media, history, items)
        flat = [k for keys in per_item for k in keys] + prefix
        if not flat:
            return [], []
        locs = await self.cluster.locate_many_async(flat)                 # one call
        out, i = [], 0
        for keys in per_item:
            out.append(tuple(locs[i:i + len(keys)]))
            i += len(keys)
        return out, list(locs[i:])

    def _keys(self, tenant: str, media: list[MediaItem], history: list, items: list):
        per_item = [self.frontend.routing_keys(self.cluster, tenant, m.type, m.data) for m in media]
        return per_item, self.frontend.prefix_keys(self.cluster, tenant, history, items)

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

    async def _call(self, node: str, *args) -> tuple[int, dict]:
        self.router.inflight[node] += 1
        import ray

        try:
            return await asyncio.wait_for(self.workers[node].answer.remote(*args), TURN_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise HTTPError(503, "timeout", f"the worker on node {node} did not answer in time") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            raise HTTPError(503, "worker_lost", f"the worker on node {node} died (it restarts with an empty "
                                                "pool): send the request again") from None
        finally:
            self.router.inflight[node] -= 1


def _items(content) -> list[tuple[str, object]]:
    return [("text", i.text) if isinstance(i, TextItem) else (i.type, i.data) for i in content]


def _names(*locs) -> list[str]:
    return [name for loc in locs if loc is not None for name, _tier in loc.holders]


# ---------------------------------------------------------------------- the Serve edge
def build_app(args: dict | None = None):
    """The Serve application (``import_path: mmtier.serve.app:build_app``)."""
    import ray
    from ray import serve

    from ..cluster import start
    from ..cluster.engine_pool import host_name
    from .engine_loader import app_cache_config

    cfg = ServeAppConfig.parse(args)
    cfg.key_table()                                     # fail at deploy time, not per request
    cache_cfg = app_cache_config(cfg)                   # refuses the public default key secret
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
        # a named actor that holds its node's pool (the model and its cache in one process, on
        # the node's GPU when it has one); restarted with an empty pool if it dies (its groups
        # leave the registry at once)
        gpu = w.device == "auto" and t.gpus >= 1
        workers[t.node] = worker.options(
            name=host_name(t.node), namespace=settings.namespace, get_if_exists=True, lifetime="detached",
            max_restarts=-1, max_concurrency=w.max_ongoing_requests + settings.pool_concurrency,
            num_cpus=w.num_cpus, num_gpus=1 if gpu else 0, resources={t.resource: cfg.affinity.pin_amount},
        ).remote(cfg_json, i, t.node, "cuda" if gpu else "cpu")
    ray.get([h.ping.remote() for h in workers.values()], timeout=settings.start_timeout_s)
    names = {node: host_name(node) for node in workers}
    ingress = serve.deployment(ChatIngress).options(
        name="mmtier-ingress", num_replicas=ing.num_replicas, max_ongoing_requests=ing.max_ongoing_requests,
        ray_actor_options={"num_cpus": ing.num_cpus})
    return ingress.bind(cfg_json, names)
