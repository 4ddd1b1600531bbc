"""The mmtier keys of a Ray Serve LLM request, made before it reaches an engine.

A router that asks the cluster where a request's groups live needs the keys the engine's
connectors will make: the digest of each image's *processed* inputs and the chained keys of the
prompt's token ids (after the chat template, with each image's placeholders expanded), under the
server-side tenant and the request's ``cache_salt``. ``RequestKeyer`` renders the request as
the engine will: vLLM's own renderer and input processor, built from the deployment's
``LLMConfig`` through Ray Serve LLM's own ``_get_vllm_engine_config`` (the function its
``LLMServer`` starts the engine with; only vLLM's multimodal processor cache is off here, so
every item keeps its inputs), and keys the resulting ``EngineCoreRequest`` with the connectors'
own functions (``vllm.keys``). The keys carry the cluster's secret: the keyer joins the mmtier
cluster named in the connectors' ``mmtier_cluster`` and makes keys with a lookup-only cache.

Rendering runs on the keyer's own thread and event loop (``submit``), never on the router's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..content import ContentKey
from ..engines.connector_cache import (
    cluster_from_extra,
    config_from_extra,
    lookup_only,
    shared_cache,
    tenant_from_extra,
)
from ..engines.vllm.keys import KeyScheme
from ..engines.vllm.names import names_ec_connector, names_kv_connector
from ..engines.vllm.plan import MAX_FORKS, RequestPlan
from ..errors import ConfigError, MMTierError


class KeyingError(MMTierError):
    """The request could not be rendered into keys (vLLM's renderer refused it)."""


@dataclass(frozen=True)
class RequestKeys:
    """A request's media (each item's encoder-output key, in prompt order) and its prompt's
    chained KV segments (``(key, tokens)`` in position order; a prefix hits up to the first
    segment nobody holds). ``chain``: how to follow the prompt past a chunk an earlier turn
    ended inside (``PromptChain``; ``None`` where keys were given, not made from a request)."""

    media: tuple[ContentKey, ...]
    prefix: tuple[tuple[ContentKey, int], ...]
    chain: PromptChain | None = field(default=None, compare=False, repr=False)

    def addresses(self) -> list[str]:
        """Every key's address (digest and placement), media first: the one batched registry lookup."""
        return [k.address for k in self.media] + [k.address for k, _ in self.prefix]


@dataclass(frozen=True)
class PromptChain:
    """A keyed request's prompt as the connector's scheduler plans it, with the cuts it forked
    at: the parts of a text chunk an earlier prompt (or answer: decode saves) stored (``forks``)
    and the keys of the prompt cut at one of them (``cut``), as ``scheduler._fork`` does."""

    scheme: KeyScheme
    cache: Any
    request: Any
    plan: RequestPlan
    cuts: tuple[int, ...] = ()

    def forks(self, index: int) -> list[tuple[int, ContentKey]]:
        """``(end, key)`` of the parts of prefix segment ``index``, longest first."""
        return self.scheme.forks(self.cache, self.request, self.plan, index)

    def cut(self, media: tuple[ContentKey, ...], at: int) -> RequestKeys:
        """The request's keys with the prompt also cut at ``at``."""
        cuts = tuple(sorted({*self.cuts, at}))
        chain = dataclasses.replace(self, plan=self.scheme.plan(self.cache, self.request, cuts), cuts=cuts)
        return chain.keys(media)

    def keys(self, media: tuple[ContentKey, ...]) -> RequestKeys:
        return RequestKeys(media, tuple((s.key, s.end - s.start) for s in self.plan.segments), self)


async def held_chain(keys: RequestKeys, lookup: Callable[[list[str]], Awaitable[list[Any]]],
                     max_forks: int = MAX_FORKS) -> tuple[RequestKeys, list[Any]]:
    """``keys`` followed as far as the cluster holds the prompt's chain, and the registry's
    answer for them: where the leading run stops inside a text chunk, the longest part of it
    some holder has (a conversation's previous turn, its prompt or its answer, ended there)
    cuts the prompt there and the run goes on after it. ``lookup``: addresses -> the registry's
    ``Location`` (or ``None``) of each. Two lookups per fork, at most ``max_forks`` forks."""
    found = await lookup(keys.addresses())
    for _ in range(max_forks):
        prefix = found[len(keys.media):]
        n = next((i for i, loc in enumerate(prefix) if loc is None), None)
        if n is None or keys.chain is None:
            break
        forks = keys.chain.forks(n)
        if not forks:
            break
        parts = await lookup([k.address for _, k in forks])
        i = next((j for j, loc in enumerate(parts) if loc is not None), None)
        if i is None:
            break
        keys = keys.chain.cut(keys.media, forks[i][0])
        found = await lookup(keys.addresses())
    return keys, found


def connector_extras(engine_kwargs: dict[str, Any]) -> tuple[dict, dict | None]:
    """The KV connector's extra config (it must be mmtier's, joined to a cluster) and the
    encoder-cache connector's (``None`` where the deployment has none)."""
    kv = engine_kwargs.get("kv_transfer_config") or {}
    ec = engine_kwargs.get("ec_transfer_config") or {}
    if not names_kv_connector(kv):
        raise ConfigError("affinity routing needs mmtier's KV connector (kv_connector: MMTierConnector)",
                          ("engine_kwargs.kv_transfer_config",))
    kv_extra = dict(kv.get("kv_connector_extra_config") or {})
    if cluster_from_extra(kv_extra) is None:
        raise ConfigError("affinity routing needs the engines joined to the mmtier cluster "
                          "(mmtier_cluster in the connector's extra config)", ("mmtier_cluster",))
    ec_extra = dict(ec.get("ec_connector_extra_config") or {}) if names_ec_connector(ec) else None
    return kv_extra, ec_extra


class RequestKeyer:
    """See the module docstring. ``llm_config``: the deployment's ``LLMConfig`` (or its dump)."""

    def __init__(self, llm_config: Any):
        from ray.serve.llm import LLMConfig

        cfg = llm_config if isinstance(llm_config, LLMConfig) else LLMConfig(**llm_config)
        self.kv_extra, self.ec_extra = connector_extras(cfg.engine_kwargs)
        # vLLM's processor cache would hand a repeated item over without its inputs
        self.llm_config = cfg.model_copy(update={"engine_kwargs": {**cfg.engine_kwargs, "mm_processor_cache_gb": 0}})
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mmtier-keyer", daemon=True)
        self._thread.start()
        self.ready: Future = asyncio.run_coroutine_threadsafe(self._build(), self._loop)

    async def _build(self) -> None:
        from ray.llm._internal.serve.engines.vllm.vllm_engine import (
            FrontendArgs,
            _get_vllm_engine_config,
        )
        from vllm.entrypoints.launchers.cli_args import resolve_default_chat_template_kwargs
        from vllm.renderers import renderer_from_config
        from vllm.renderers.chat_utils import load_chat_template
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.v1.engine.input_processor import InputProcessor

        from ..cluster.link import join
        from ..engines.vllm.keys import KeyScheme, embed_pools

        # the arguments LLMServer.start builds, and the renderer vLLM's init_app_state makes of them
        engine_args, vllm_config = _get_vllm_engine_config(self.llm_config)
        frontend = FrontendArgs(**self.llm_config.get_engine_config().frontend_kwargs)
        args = argparse.Namespace(**(vars(frontend) | vars(engine_args)))
        renderer = renderer_from_config(vllm_config)
        self._renderer = OnlineRenderer(
            model_config=vllm_config.model_config, renderer=renderer, request_logger=None,
            chat_template=load_chat_template(args.chat_template),
            chat_template_content_format=args.chat_template_content_format,
            trust_request_chat_template=args.trust_request_chat_template,
            trust_request_mm_kwargs=args.trust_request_mm_kwargs,
            enable_auto_tools=args.enable_auto_tool_choice,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            tool_parser=args.tool_call_parser, tool_strict_level=args.tool_strict_level,
            reasoning_parser=vllm_config.structured_outputs_config.reasoning_parser,
            default_chat_template_kwargs=resolve_default_chat_template_kwargs(args))
        self._inputs = InputProcessor(vllm_config, renderer)
        cfg, self.transport = join(config_from_extra(self.kv_extra), *cluster_from_extra(self.kv_extra))
        self._kv_cache = shared_cache(lookup_only(cfg))
        self.scheme = KeyScheme.from_extra(self.kv_extra, vllm_config.cache_config.block_size)
        self._ec_cache = None
        if self.ec_extra is not None:
            ec_cfg = config_from_extra(self.ec_extra).model_copy(update={"key_secret": cfg.key_secret})
            self._ec_cache = shared_cache(lookup_only(ec_cfg))
            self._ec_pools = embed_pools(ec_cfg, self.ec_extra)
            self._ec_tenant = tenant_from_extra(self.ec_extra)

    def submit(self, request: Any) -> Future:
        """Start keying ``request`` (a ``ChatCompletionRequest`` or ``CompletionRequest``) on the
        keyer's thread: a future of its ``RequestKeys``."""
        return asyncio.run_coroutine_threadsafe(self._keys(request), self._loop)

    async def _keys(self, request: Any) -> RequestKeys:
        from vllm.sampling_params import SamplingParams

        from ..engines.vllm.keys import embedding_key, embedding_scope

        if not self.ready.done():
            await asyncio.wrap_future(self.ready)
        self.ready.result()
        if getattr(request, "messages", None) is not None:
            out = await self._renderer.render_chat(request.model_copy(deep=True))
        elif getattr(request, "prompt", None) is not None:
            out = await self._renderer.render_completion(request.model_copy(deep=True))
        else:
            raise KeyingError(f"{type(request).__name__} has neither messages nor a prompt")
        if not isinstance(out, tuple):
            raise KeyingError(f"vLLM's renderer refused the request: {getattr(out, 'error', out)}")
        inputs = out[-1]
        if len(inputs) != 1:
            raise KeyingError(f"{len(inputs)} prompts in one request: routed by the first engine's choice")
        core = self._inputs.process_inputs(f"mmtier-route-{next(self._ids)}", inputs[0],
                                           SamplingParams(max_tokens=1), ("generate",))
        plan = self.scheme.plan(self._kv_cache, core)
        media: list[ContentKey] = []
        if self._ec_cache is not None:
            for f in core.mm_features or []:
                pool = self._ec_pools.get(f.modality)
                key = pool and embedding_key(self._ec_cache, f, modality=pool,
                                             tenant=embedding_scope(self._ec_tenant, core, f))
                if key is not None:
                    media.append(key)
        return PromptChain(self.scheme, self._kv_cache, core, plan).keys(tuple(dict.fromkeys(media)))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
