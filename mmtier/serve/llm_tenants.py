"""Who a request is and which cache scope it gets, on mmtier's OpenAI ingress: the arguments
``ingress_cls_config.ingress_extra_kwargs`` binds (``IngressArgs``), the API-key table (keys ->
tenants, held as SHA-256 digests: ``serve.config.KeyTable``) and each tenant's ``cache_salt``.

A tenant's salt is ``HMAC-SHA256(key secret, "mmtier/cache_salt/v1/" + tenant)`` in hex: the
ingress sets it as vLLM's per-request ``cache_salt``, which vLLM mixes into its block hashes and
mmtier's connectors into every key's scope (``engines/vllm/connector.py``), so one tenant's content
never hits for another, and nobody without the secret can compute another tenant's salt. The
secret is the cache's (``MMTIER_KEY_SECRET``, or the variable ``key_secret_env`` names); the
public default only where ``allow_default_key_secret`` says so (a local try-out)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
)

from ..config import DEFAULT_KEY_SECRET, KEY_SECRET_ENV
from ..errors import ConfigError
from .config import KeyTable
from .llm_requests import RequestLimits

SALT_DOMAIN = b"mmtier/cache_salt/v1/"
Name = Annotated[str, StringConstraints(min_length=1)]      # a key or a tenant: never empty
MODALITIES = ("image", "audio", "video")


class IngressArgs(BaseModel):
    """``ingress_extra_kwargs`` of ``MMTierIngress``."""

    model_config = ConfigDict(extra="forbid")

    api_keys: dict[Name, Name] = Field(default_factory=dict, description="API key -> tenant (local try-outs).")
    api_key_sha256: dict[Name, Name] = Field(default_factory=dict, description="hex SHA-256 of an API key -> tenant.")
    api_keys_env: str | None = Field(None, description="Environment variable holding a JSON object {api key: tenant}.")
    key_secret_env: str = Field(KEY_SECRET_ENV, description="Environment variable holding the key secret.")
    allow_default_key_secret: bool = Field(False, description="Local / development only: the public default secret.")
    media: dict[str, list[str]] = Field(default_factory=dict, description=(
        "model id -> the media it takes besides text (image, audio, video); a model not named takes "
        "text only (Ray Serve LLM's model card cannot tell: it learns the model's config in the replica)."))
    max_body_bytes: int = Field(32 << 20, gt=0)
    max_image_pixels: int = Field(4096 * 4096, gt=0)
    max_audio_seconds: float = Field(600.0, gt=0)
    max_video_seconds: float = Field(60.0, gt=0, description="Longest video, as its MP4 header declares it.")
    max_video_frames: int = Field(1800, gt=0, description="Most frames in a video file (all are decoded to check it).")
    max_video_pixels: int = Field(1920 * 1080, gt=0, description="Largest video frame, width x height.")

    @field_validator("media")
    @classmethod
    def _media(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for model, kinds in value.items():
            bad = sorted(set(kinds) - set(MODALITIES))
            if bad:
                raise ValueError(f"media of {model}: unknown {bad}; choose from {list(MODALITIES)}")
        return value

    @classmethod
    def parse(cls, kwargs: dict) -> IngressArgs:
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
            raise ConfigError("invalid ingress_extra_kwargs: " + "; ".join(lines),
                              tuple(".".join(map(str, e["loc"])) for e in exc.errors())) from None

    def limits(self) -> RequestLimits:
        return RequestLimits(self.max_body_bytes, self.max_image_pixels, self.max_audio_seconds,
                             self.max_video_seconds, self.max_video_frames, self.max_video_pixels)

    def key_table(self) -> KeyTable:
        digests = {k.lower(): t for k, t in self.api_key_sha256.items()}
        digests.update({_sha256(k): t for k, t in self.api_keys.items()})
        if self.api_keys_env:
            digests.update({_sha256(k): t for k, t in _env_keys(self.api_keys_env).items()})
        if not digests:
            raise ConfigError("no API keys: set api_keys, api_key_sha256 or api_keys_env", ("api_keys",))
        return KeyTable(digests)

    def salts(self) -> TenantSalts:
        secret = os.environ.get(self.key_secret_env)
        if not secret:
            if not self.allow_default_key_secret:
                raise ConfigError(f"the ingress needs the key secret: set {self.key_secret_env} (the same on every "
                                  "node), or allow_default_key_secret: true for a local try-out",
                                  ("key_secret_env",))
            secret = DEFAULT_KEY_SECRET
        return TenantSalts(secret.encode())


class TenantSalts:
    """Tenant -> vLLM ``cache_salt``, derived under the server's secret."""

    def __init__(self, secret: bytes):
        self._secret = secret

    def salt(self, tenant: str) -> str:
        return hmac.new(self._secret, SALT_DOMAIN + tenant.encode(), hashlib.sha256).hexdigest()


def _sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _env_keys(name: str) -> dict[str, str]:
    raw = os.environ.get(name)
    if raw is None:
        raise ConfigError(f"api_keys_env: environment variable {name} is not set", ("api_keys_env",))
    try:
        keys = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"api_keys_env: {name} is not JSON ({exc.msg})", ("api_keys_env",)) from None
    if not isinstance(keys, dict) or not all(isinstance(k, str) and k and isinstance(t, str) and t
                                             for k, t in keys.items()):
        raise ConfigError(f"api_keys_env: {name} must be a JSON object {{\"key\": \"tenant\"}}", ("api_keys_env",))
    return keys
