"""``ServeAppConfig``: the ``args`` of the Serve application (``configs/serve.yaml``).

Validated by pydantic (``extra="forbid"``: a misspelt field is an error that names it). Secrets
need not sit in the file: API keys can come from an environment variable (``api_keys_env``, a
JSON object ``{"key": "tenant"}``) or as SHA-256 digests of the keys (``api_key_sha256``); the
cache's key secret from ``key_secret_env`` (required: the public default secret is refused unless
``cache.allow_default_key_secret`` says the run is local / development).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..cluster.settings import ClusterSettings
from ..errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelArgs(_Strict):
    """Which model the workers run. ``hf`` (the default): the transformers chat model of
    ``mmtier.chat.model`` (a Qwen2-VL-architecture VLM, and Whisper for audio): small
    random-weight models built from ``configs/demo-qwen2-vl.json`` and
    ``configs/demo-whisper.json`` unless ``path`` / ``audio_path`` name local directories of
    real weights. (``reference``, mmtier's own seeded model, is retired: it is a test fixture
    now.)"""

    kind: Literal["hf"] = Field("hf", description="'hf': the transformers chat model.")
    seed: int = Field(0, description="Seed of the random weights (when no path is given).")
    path: str | None = Field(
        None, description="Local directory of the VLM's weights (config.json and *.safetensors / *.bin, "
                          "as save_pretrained writes them); loaded with local_files_only=True, never "
                          "downloaded. Must exist on every node (workers, ingress). None: random weights.")
    audio_path: str | None = Field(
        None, description="Local directory of the Whisper model that transcribes audio items; set "
                          "with path (both real, or both random).")

    @field_validator("path", "audio_path")
    @classmethod
    def _local_dir(cls, value: str | None) -> str | None:
        return None if value is None else local_weights_dir(value)

    @model_validator(mode="after")
    def _kind_fits(self) -> ModelArgs:
        if (self.path is None) != (self.audio_path is None):
            raise ValueError("path and audio_path go together (the VLM's and Whisper's weights), or "
                             "neither (random weights)")
        return self


def local_weights_dir(value: str) -> str:
    """``value`` as an absolute directory that holds a model (``config.json`` and weight files);
    ``ValueError`` otherwise: the app never downloads, a hub id is not a directory."""
    path = Path(value).expanduser()
    if not path.is_dir():
        hint = " (it looks like a hub id: download it yourself, then name the directory)" \
            if not path.is_absolute() and value.count("/") == 1 and not value.startswith(".") else ""
        raise ValueError(f"{value!r} is not a local directory{hint}; the app loads weights with "
                         "local_files_only=True and never downloads")
    if not (path / "config.json").is_file():
        raise ValueError(f"{value!r} has no config.json (not a save_pretrained directory)")
    if not any(p.suffix in (".safetensors", ".bin") for p in path.iterdir()):
        raise ValueError(f"{value!r} has no weight files (*.safetensors or *.bin); they would need a download")
    return str(path.resolve())


class CacheArgs(_Strict):
    """The budgets of the cluster's cache; its layout (layers, heads, modalities) is the model's."""

    device_bytes: int | None = Field(
        64 << 20, gt=0, description="Page arena of each pool, bytes; null on GPUs: a share of the free "
                                    "memory NVML reports (CacheConfig.device_fraction).")
    host_bytes: int = Field(0, ge=0, description="Host tier of each node store, bytes (0: ClusterSettings.store_bytes).")
    device: str = Field("cpu", description="'cpu' or 'cuda' (GPU pools take their arena from NVML when on a GPU node).")
    eviction_policy: str = Field("adaptive_slru", description="Eviction policy of each pool.")
    key_secret_env: str | None = Field(
        None, description="Environment variable holding the cache's key secret (salts tenants, "
                          "authenticates keys), e.g. MMTIER_KEY_SECRET; required unless "
                          "allow_default_key_secret.")
    allow_default_key_secret: bool = Field(
        False, description="Local / development runs only: accept the public default key secret "
                           "when key_secret_env is unset or names an unset variable (anyone "
                           "could derive tenant salts).")
    shares: dict[str, float] | None = Field(None, description="Arena share per modality (default: the model's).")


class Limits(_Strict):
    max_request_bytes: int = Field(16 << 20, gt=0, description="Largest HTTP body accepted (413 above).")
    max_media_bytes: int = Field(1 << 20, gt=0, description="Largest decoded media item (413 above).")
    max_image_pixels: int = Field(
        4 << 20, gt=0, description="Largest image, width x height as its header declares, checked "
                                   "before decoding (413 above; a decompression bomb never decodes).")
    max_audio_seconds: float = Field(30.0, gt=0, description="Longest audio clip (413 above; Whisper hears 30 s).")
    max_video_seconds: float = Field(
        60.0, gt=0, description="Longest video, frames / frame rate as its MP4 header declares them (413 above).")
    max_video_frames: int = Field(
        1800, gt=0, description="Most frames in a video (all of them are decoded to check it; the model "
                                "samples a few a second; 413 above).")
    max_video_pixels: int = Field(
        1 << 20, gt=0, description="Largest video frame, width x height as the header declares it, checked "
                                   "before decoding (413 above).")
    max_text_bytes: int = Field(
        4096, gt=0, description="Largest text item, UTF-8 bytes (= tokens of the chat model's byte-level "
                                "vocabulary; a chunk's attention grows with its square; 413 above).")
    max_request_tokens: int = Field(
        8192, gt=0, description="Most tokens of one request: the whole conversation it carries (text, "
                                "media as the model's encoders count them, earlier answers) and "
                                "max_tokens (413 above).")
    max_items: int = Field(64, gt=0, description="Most content parts in one request, its history's included (400 above).")
    max_new_tokens: int = Field(64, gt=0, description="Largest max_tokens a request may ask (400 above).")
    default_new_tokens: int = Field(8, gt=0, description="max_tokens when a request names none.")


class Affinity(_Strict):
    """How per-node workers are pinned (see ``mmtier.serve.routing``)."""

    pin_resource_prefix: str | None = Field(
        None, description="None: pin a node's worker with Ray's automatic 'node:<ip>' resource "
                          "(one worker per node IP). A prefix (e.g. 'mmtier_node_'): each node that "
                          "should get a worker carries one custom resource whose name starts with it "
                          "(needed when nodes share an IP, as on a one-machine test cluster).")
    pin_amount: float = Field(0.001, gt=0, le=1, description="Amount of the pin resource a worker claims.")


class Workers(_Strict):
    num_cpus: float = Field(1.0, ge=0, description="CPUs each per-node worker reserves.")
    device: Literal["auto", "cpu"] = Field(
        "auto", description="auto: a worker on a node with a GPU claims one (num_gpus=1) and runs the model "
                            "and its pool there (cuda); on a node without, the CPU. cpu: always the CPU.")
    max_ongoing_requests: int = Field(8, gt=0, description="Concurrent requests per worker.")
    torch_threads: int = Field(1, gt=0, description="torch intra-op threads in a worker.")
    turn_wait_s: float = Field(
        240.0, gt=0, description="Longest a request waits for a serial model (one turn at a time per "
                                 "worker) busy with other requests; then 503 'busy', nothing ran.")


class Ingress(_Strict):
    num_replicas: int = Field(1, gt=0, description="Ingress replicas (they hash media and route).")
    num_cpus: float = Field(0.5, ge=0, description="CPUs each ingress replica reserves.")
    max_ongoing_requests: int = Field(64, gt=0, description="Concurrent requests per ingress replica.")


class ServeAppConfig(_Strict):
    """The application's ``args``."""

    model: ModelArgs = Field(default_factory=ModelArgs)
    served_model_name: str = Field(
        "mmtier-chat", min_length=1, description="The model's name in the API (GET /v1/models; a request's "
                                                 "'model' must be it, else 404 model_not_found).")
    cache: CacheArgs = Field(default_factory=CacheArgs)
    cluster: dict[str, Any] = Field(default_factory=dict, description="ClusterSettings fields (namespace, timeouts, ...).")
    start_cache: bool = Field(True, description="Run mmtier.cluster.start() at deploy time (idempotent).")
    api_keys: dict[str, str] = Field(default_factory=dict, description="API key -> tenant (development; prefer the two below).")
    api_key_sha256: dict[str, str] = Field(default_factory=dict, description="hex SHA-256 of an API key -> tenant.")
    api_keys_env: str | None = Field(None, description="Environment variable holding a JSON object {api key: tenant}.")
    limits: Limits = Field(default_factory=Limits)
    affinity: Affinity = Field(default_factory=Affinity)
    workers: Workers = Field(default_factory=Workers)
    ingress: Ingress = Field(default_factory=Ingress)

    @field_validator("api_keys", "api_key_sha256")
    @classmethod
    def _tenants(cls, value: dict[str, str]) -> dict[str, str]:
        for key, tenant in value.items():
            if not key or not isinstance(tenant, str) or not tenant:
                raise ValueError("every API key needs a non-empty key and tenant")
        return value

    @classmethod
    def parse(cls, args: dict[str, Any] | ServeAppConfig | None) -> ServeAppConfig:
        if isinstance(args, ServeAppConfig):
            return args
        try:
            return cls(**(args or {}))
        except ValidationError as exc:
            lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
            raise ConfigError("invalid Serve app args: " + "; ".join(lines),
                              tuple(".".join(map(str, e["loc"])) for e in exc.errors())) from None

    def settings(self) -> ClusterSettings:
        try:
            return ClusterSettings(**self.cluster)
        except ValidationError as exc:
            raise ConfigError(f"invalid cluster settings: {exc}", ("cluster",)) from None

    def key_table(self) -> KeyTable:
        digests = {k.lower(): t for k, t in self.api_key_sha256.items()}
        for key, tenant in self.api_keys.items():
            digests[_sha256(key)] = tenant
        if self.api_keys_env:
            raw = os.environ.get(self.api_keys_env)
            if raw is None:
                raise ConfigError(f"api_keys_env: environment variable {self.api_keys_env} is not set",
                                  ("api_keys_env",))
            try:
                extra = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"api_keys_env: {self.api_keys_env} is not JSON ({exc.msg})",
                                  ("api_keys_env",)) from None
            if not isinstance(extra, dict) or not all(isinstance(k, str) and k and isinstance(t, str) and t
                                                      for k, t in extra.items()):
                raise ConfigError(f"api_keys_env: {self.api_keys_env} must be a JSON object "
                                  "{\"key\": \"tenant\"}", ("api_keys_env",))
            for key, tenant in extra.items():
                digests[_sha256(key)] = tenant
        if not digests:
            raise ConfigError("no API keys: set api_keys, api_key_sha256 or api_keys_env", ("api_keys",))
        return KeyTable(digests)


def _sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyTable:
    """API key -> tenant, held as SHA-256 digests; lookups compare in constant time."""

    def __init__(self, digests: dict[str, str]):
        self._digests = dict(digests)

    def tenant(self, key: str | None) -> str | None:
        if not key:
            return None
        probe = _sha256(key)
        found = None
        for digest, tenant in self._digests.items():     # every entry, so timing says nothing
            if hmac.compare_digest(digest, probe):
                found = tenant
        return found

    def __len__(self) -> int:
        return len(self._digests)
