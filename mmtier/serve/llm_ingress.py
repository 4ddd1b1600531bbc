"""mmtier's ingress for Ray Serve LLM: Ray's ``OpenAiIngress`` with API keys, tenants and the
request checks of ``llm_requests``, plugged in the supported way, ``build_openai_app``'s
``ingress_cls_config``::

    args:
      ingress_cls_config:
        ingress_cls: mmtier.serve.llm_ingress:MMTierIngress
        ingress_extra_kwargs: {api_keys_env: MMTIER_API_KEYS}      # serve.llm_tenants.IngressArgs
      llm_configs: [...]

Every route needs an API key (``Authorization: Bearer <key>`` or ``X-API-Key``) that the
server's key table maps to a tenant; a missing or unknown key is a 401. On
``/v1/chat/completions`` and ``/v1/completions`` the ingress reads the body itself (so bad
JSON, missing fields, bad media and unknown models are OpenAI-shaped 4xx, never a 500), refuses
a client's ``cache_salt``, sets the tenant's own (``llm_tenants.TenantSalts``) and each media
part's ``uuid`` from it (``llm_requests.tenant_media_ids``), and forwards the
request to the model's ``LLMServer`` without the caller's key. Answers, streams (SSE) and
``usage`` (with ``prompt_tokens_details.cached_tokens`` where the engine has
``enable_prompt_tokens_details``) are Ray's and vLLM's. Imports Ray Serve LLM (so vLLM): load
it where they are installed."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, Request
from pydantic import ValidationError
from ray.llm._internal.common.utils.lora_utils import get_base_model_id
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
from ray.serve.llm.ingress import OpenAiIngress
from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest
from starlette.responses import JSONResponse, Response

from ..errors import ConfigError
from .llm_requests import (
    RequestError,
    check_messages,
    parse_body,
    refuse_client_salt,
    tenant_media_ids,
    validation_error,
)
from .llm_tenants import IngressArgs
from .protocol import api_key

CHAT, COMPLETIONS = "chat", "completions"           # LLMServer's methods (ingress.CallMethod)
KEY_HEADERS = (b"authorization", b"x-api-key")


class MMTierIngress(OpenAiIngress):
    def __init__(self, llm_deployments: dict, model_cards: dict, *, lora_paths: dict | None = None,
                 **extra_kwargs: Any):
        args = IngressArgs.parse(extra_kwargs)
        super().__init__(llm_deployments, model_cards, lora_paths=lora_paths)
        self._keys = args.key_table()
        self._salts = args.salts()
        self._limits = args.limits()
        unknown = sorted(set(args.media) - set(model_cards))
        if unknown:
            raise ConfigError(f"media names models that are not served: {unknown}", ("media",))
        self._accepts = {m: frozenset(args.media.get(m, ())) for m in model_cards}

    # ------------------------------------------------------------------ routes
    async def models(self, request: Request) -> Response:
        return await self._answer(request, lambda: self._models())

    async def model_data(self, model: str, request: Request) -> Response:
        return await self._answer(request, lambda: self._model_data(model))

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, COMPLETIONS)

    async def embeddings(self, request: Request) -> Response:
        return await self._not_served(request, "/v1/embeddings")

    async def transcriptions(self, request: Request) -> Response:
        return await self._not_served(request, "/v1/audio/transcriptions")

    async def score(self, request: Request) -> Response:
        return await self._not_served(request, "/v1/score")

    async def tokenize(self, request: Request) -> Response:
        return await self._not_served(request, "/tokenize")

    async def detokenize(self, request: Request) -> Response:
        return await self._not_served(request, "/detokenize")

    # ------------------------------------------------------------------ the work
    def tenant(self, request: Request) -> str:
        """The caller's tenant from its API key; a 401 without a known one."""
        tenant = self._keys.tenant(api_key(request.headers))
        if tenant is None:
            raise RequestError(401, "missing or unknown API key (send Authorization: Bearer <key>)",
                               code="invalid_api_key")
        return tenant

    async def _generate(self, request: Request, model_cls: type, method: str) -> Response:
        try:
            tenant = self.tenant(request)
            body = parse_body(await request.body(), self._limits)
            model = self._served_model(body)
            refuse_client_salt(body)
            if method == CHAT:
                check_messages(body, model, self._accepts[get_base_model_id(model)], self._limits)
            body["cache_salt"] = salt = self._salts.salt(tenant)
            if method == CHAT:
                tenant_media_ids(body, salt)          # vLLM's own encoder cache: per tenant too
            try:
                parsed = model_cls.model_validate(body)
            except ValidationError as exc:
                raise validation_error(exc) from None
            return await self._process_llm_request(parsed, call_method=method, raw_request=_without_key(request))
        except RequestError as exc:
            return _error(exc)
        except (OpenAIHTTPException, HTTPException) as exc:     # the engine's own 4xx answers
            return _error(_from_http(exc))

    def _served_model(self, body: dict) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise RequestError(400, "model: a model id is required", param="model",
                               code="missing_required_parameter")
        if get_base_model_id(model) not in self._model_cards:
            raise RequestError(404, f"the model {model!r} does not exist (served: {sorted(self._model_cards)})",
                               param="model", code="model_not_found")
        return model

    async def _models(self) -> Response:
        return JSONResponse((await OpenAiIngress.models(self)).model_dump())

    async def _model_data(self, model: str) -> Response:
        card = await self.model(model)
        if card is None:
            raise RequestError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")
        return JSONResponse(card.model_dump())

    async def _answer(self, request: Request, make) -> Response:
        try:
            self.tenant(request)
            return await make()
        except RequestError as exc:
            return _error(exc)

    async def _not_served(self, request: Request, route: str) -> Response:
        try:
            self.tenant(request)
            raise RequestError(404, f"{route} is not served here (chat completions and completions are)",
                               code="unsupported_route")
        except RequestError as exc:
            return _error(exc)


def _without_key(request: Request) -> Request:
    """The request as forwarded to the model's server: without the caller's API key."""
    headers = [(k, v) for k, v in request.scope.get("headers", []) if k.lower() not in KEY_HEADERS]
    return Request({**request.scope, "headers": headers}, request.receive)


def _from_http(exc: Exception) -> RequestError:
    status = int(getattr(exc, "status_code", 500))
    message = getattr(exc, "message", None) or getattr(exc, "detail", None) or str(exc)
    return RequestError(status, str(message), code="model_not_found" if status == 404 else None)


def _error(exc: RequestError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
