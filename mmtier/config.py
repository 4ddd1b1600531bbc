"""Typed configuration: ``CacheConfig`` and ``ModalitySpec``.

``ModalitySpec`` is frozen and owns the size math (``page_bytes``): every tier sizes itself
from it. A modality inherits the layers, KV heads, head dim and dtype it leaves unset from the
model-level fields of ``CacheConfig``; after validation ``CacheConfig.modalities`` holds fully
resolved specs (``name`` set, nothing left ``None``) in an immutable, hashable mapping.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from .errors import ConfigError

DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
DType = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
# an fp8 KV cache's dequantization scale (real value = stored value x scale), as an engine keeps
# it: one for every layer (a float), one per layer (vLLM's per-tensor ``k_scale`` of each
# attention layer), or one per layer and KV head (``[layers][kv_heads]``)
Scale = float | tuple[float, ...] | tuple[tuple[float, ...], ...]
POLICIES = ("lru", "modality_lru", "cost_aware", "bimodal_lru", "s3fifo", "arc", "dip", "duel", "chain_bip",
            "adaptive_slru")
DEFAULT_KEY_SECRET = "mmtier-default-secret"    # public: fine in-process and in tests, never served
KEY_SECRET_ENV = "MMTIER_KEY_SECRET"            # where `mmtier start` reads a preset's secret
# ModalitySpec's size math and torch dtype, taken once per spec (a put reads it a dozen times; frozen fields)
_SIZE_MATH = ("page_shape", "page_bytes", "torch_dtype")
_MODEL_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "k_scale", "v_scale")


class ModalitySpec(BaseModel):
    """One modality's page layout. Frozen: the page size math lives here and only here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, description="Modality name; filled from the key in CacheConfig.modalities.")
    kind: Literal["kv", "embedding"] = Field(
        "kv", description="'kv': attention K and V per layer; 'embedding': one vector of `width` per token (encoder outputs).")
    page_size: int = Field(..., gt=0, le=4096, strict=True, description="Tokens per page.")
    num_layers: int | None = Field(None, gt=0, strict=True, description="Layers whose KV this modality holds; default: the model's.")
    num_kv_heads: int | None = Field(None, gt=0, strict=True, description="KV heads; default: the model's.")
    head_dim: int | None = Field(None, gt=0, le=1024, strict=True, description="Head dimension; default: the model's.")
    dtype: DType | None = Field(None, description="Element dtype; default: the model's.")
    k_scale: Scale | None = Field(
        None, description="fp8 pages only: K's dequantization scale (a float, one per layer, or one per layer and "
                          "KV head); default: the model's, else 1.0.")
    v_scale: Scale | None = Field(None, description="fp8 pages only: V's dequantization scale, as k_scale.")
    width: int | None = Field(None, gt=0, strict=True, validate_default=True,
                              description="Vector width per token; required for kind='embedding'.")
    share: float | None = Field(
        None, gt=0, le=1, description="Fraction of the device arena for this pool; unset shares split the rest equally.")
    recompute_cost: float = Field(
        1.0, ge=0, description="Relative cost of recomputing one token of this modality (encoder pass vs re-reading text).")
    priority: float = Field(
        1.0, gt=0, description="Weight for modality-aware eviction: higher stays longer.")

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _config_error(exc) from None

    @field_validator("width")
    @classmethod
    def _width_for_kind(cls, value: int | None, info: ValidationInfo) -> int | None:
        kind = info.data.get("kind", "kv")
        if kind == "embedding" and value is None:
            raise ValueError("width is required when kind='embedding'")
        if kind == "kv" and value is not None:
            raise ValueError("width is only for kind='embedding'")
        return value

    # ---- size math (resolved specs only) ----
    @property
    def itemsize(self) -> int:
        return DTYPES[self._need("dtype")]

    @cached_property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page: ``[L, 2, P, H, D]`` for kv, ``[P, W]`` for embeddings."""
        if self.kind == "embedding":
            return (self.page_size, self._need("width"))
        return (self._need("num_layers"), 2, self.page_size, self._need("num_kv_heads"), self._need("head_dim"))

    @property
    def page_layers(self) -> int:
        """Layers a page holds, each one contiguous slice of it (an embedding page: one)."""
        return 1 if self.kind == "embedding" else self._need("num_layers")

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """Shape of one layer's slice of a page: ``[1, 2, P, H, D]`` for kv, the page itself
        for embeddings."""
        return self.page_shape if self.kind == "embedding" else (1, *self.page_shape[1:])

    @property
    def layer_bytes(self) -> int:
        return self.page_bytes // self.page_layers

    @property
    def page_elems(self) -> int:
        return math.prod(self.page_shape)

    @cached_property
    def page_bytes(self) -> int:
        return self.page_elems * self.itemsize

    @property
    def token_bytes(self) -> int:
        return self.page_bytes // self.page_size

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> ModalitySpec:
        """A copy whose size math is taken afresh (``update`` may change the fields it rests on)."""
        copied = super().model_copy(update=update, deep=deep)
        for name in _SIZE_MATH:
            copied.__dict__.pop(name, None)
        return copied

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @cached_property
    def torch_dtype(self):
        import torch

        return getattr(torch, self._need("dtype"))

    def layout_fields(self) -> tuple[tuple[str, str], ...]:
        """The payload layout as (name, value) pairs, in a fixed order (enters content keys)."""
        return (
            ("kind", self.kind),
            ("layers", str(self.num_layers)),
            ("kv_heads", str(self.num_kv_heads)),
            ("head_dim", str(self.head_dim)),
            ("width", str(self.width)),
            ("dtype", str(self.dtype)),
            ("page_size", str(self.page_size)),
        ) + ((("k_scale", repr(self.k_scale)), ("v_scale", repr(self.v_scale))) if self.is_fp8 else ())

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    def scale_rows(self, which: str) -> tuple[tuple[float, ...], ...] | None:
        """fp8 pages: the ``which`` ("k" or "v") dequantization scale as ``[layers][kv_heads]``
        floats (broadcast from a float or a per-layer list); ``None`` when the pages are not fp8
        or every scale is 1.0 (nothing to apply)."""
        if not self.is_fp8:
            return None
        value = self.k_scale if which == "k" else self.v_scale
        layers, heads = self._need("num_layers"), self._need("num_kv_heads")
        rows = _scale_rows(1.0 if value is None else value, layers, heads, f"{which}_scale")
        return None if all(x == 1.0 for row in rows for x in row) else rows

    def _need(self, field: str):
        value = getattr(self, field)
        if value is None:
            raise ConfigError(f"modality {self.name!r}: {field} is unset (spec not resolved)", (field,))
        return value


class FrozenModalities(Mapping[str, ModalitySpec]):
    """``CacheConfig.modalities`` after validation: a read-only mapping (no item assignment or
    deletion) that hashes, so a frozen config is immutable all the way down and hashable."""

    __slots__ = ("_specs",)

    def __init__(self, specs: Mapping[str, ModalitySpec]):
        self._specs = dict(specs)

    def __getitem__(self, name: str) -> ModalitySpec:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __hash__(self) -> int:
        return hash(tuple(self._specs.items()))

    def __repr__(self) -> str:
        return f"FrozenModalities({self._specs!r})"

    def __reduce__(self):
        return (FrozenModalities, (self._specs,))


class CacheConfig(BaseModel):
    """The whole cache: model shape, modalities, tiers, attention backend, eviction policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(..., min_length=1, description="Model identity; enters every content key.")
    num_layers: int = Field(..., gt=0, strict=True, description="Decoder layers (default for modalities).")
    num_kv_heads: int = Field(..., gt=0, strict=True, description="KV heads (default for modalities).")
    head_dim: int = Field(..., gt=0, le=1024, strict=True, description="Head dimension (default for modalities).")
    dtype: DType = Field("float16", description="KV dtype (default for modalities).")
    k_scale: Scale | None = Field(
        None, description="fp8 KV only: K's dequantization scale (real = stored x scale): a float, one per layer, "
                          "or one per layer and KV head (default for modalities; unset on fp8: 1.0).")
    v_scale: Scale | None = Field(None, description="fp8 KV only: V's dequantization scale, as k_scale.")
    modalities: dict[str, ModalitySpec] = Field(..., min_length=1, description="Modality name -> page layout.")
    device: str = Field("cpu", description="Device of the page arena: 'cpu' or 'cuda:N'.")
    device_bytes: int | None = Field(
        None, gt=0, strict=True, description="Bytes of the device arena; None: device_fraction of free memory (NVML) on CUDA.")
    device_fraction: float = Field(0.5, gt=0, le=0.95, description="Share of free GPU memory when device_bytes is None.")
    host_bytes: int = Field(0, ge=0, strict=True, description="Host-memory tier budget in bytes; 0: no host tier.")
    disk_dir: Path | None = Field(None, description="Directory of the disk tier (Arrow IPC files); None: no disk tier.")
    disk_bytes: int = Field(8 << 30, ge=0, strict=True, description="Disk tier budget in bytes.")
    disk_free_floor_bytes: int = Field(
        256 << 20, ge=0, strict=True, description="Never write when the filesystem's free space would drop below this.")
    persist_on_close: bool = Field(
        True, description="On close, write the shared groups still on the device and host tiers to the disk tier "
                          "(when there is one and its budget takes them), so a cache restarted over disk_dir finds "
                          "what this one held, not only what it had spilled.")
    write_behind: bool = Field(
        True, description="With a disk tier: every shared group saved into the cache is also written to disk in the "
                          "background, once (mmtier.tiers.durability), so a server stopped by a signal or killed "
                          "loses at most the last durable_lag_s of saves; off: only evictions and close write.")
    durable_lag_s: float = Field(
        1.0, gt=0, le=3600, description="The write-behind's bound on the lag from a save to its file being durable: "
                                        "a save is queued only while the queued bytes drain within it at the rate "
                                        "the disk was measured to take (else dropped, counted: durable_dropped).")
    durable_quiet_s: float = Field(
        0.05, ge=0, le=60, description="The write-behind's holdback: it starts writing only once saves have been quiet "
                                       "this long, so its copies, checksums and writes do not take the cores from a "
                                       "burst of saves; never past durable_lag_s (a queued save is written by its "
                                       "bound, a continuous stream of saves too); 0: write at once.")
    attention_backend: Literal["auto", "triton", "torch"] = Field(
        "auto", description="'auto': Triton on CUDA tensors, torch on CPU tensors.")
    eviction_policy: str = Field("adaptive_slru", description=f"Eviction policy, one of {POLICIES}.")
    put_placement: Literal["demote", "auto", "write_around"] = Field(
        "auto", description="Where a put lands when its device pool has no free pages for it: 'auto' (the default) "
                            "writes it around the pool straight into the host tier (one copy) where a demotion buys "
                            "nothing (a CPU pool: the host tier is the same memory) or would push down groups "
                            "running sequences hold, else demotes; 'demote' always pushes the policy's victims one "
                            "tier down first (two copies: theirs and the put's; the pool holds the newest puts); "
                            "'write_around' always writes around (mmtier.tiers.placement).")
    key_secret: str = Field(
        DEFAULT_KEY_SECRET, description="Server-side secret that authenticates keys and derives tenant salts "
                                        "(the default is public: `mmtier start` and the Serve app refuse it "
                                        "unless told the run is local / development).")
    max_inflight_bytes: int = Field(256 << 20, gt=0, strict=True, description="Bytes of tier copies in flight at once.")
    stream_buffer_bytes: int = Field(
        512 << 20, ge=0, strict=True,
        description="Host buffers kept between attention calls for pages streamed from disk (reused, not re-faulted).")

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _config_error(exc) from None
        shares = {n: s.share for n, s in self.modalities.items() if s.share is not None}
        if sum(shares.values()) > 1.0 + 1e-9:
            raise ConfigError(f"invalid mmtier config: modality shares add up to {sum(shares.values()):.3f} > 1",
                              tuple(f"modalities.{n}.share" for n in shares))
        if self.device == "cpu" and self.device_bytes is None:
            raise ConfigError("invalid mmtier config: device_bytes: required when device='cpu'",
                              ("device_bytes",))

    @field_validator("modalities")
    @classmethod
    def _names(cls, value: dict[str, ModalitySpec]) -> dict[str, ModalitySpec]:
        for name in value:
            if not name or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"modality name {name!r} must be alphanumeric (with _ or -)")
        return value

    @field_serializer("modalities", mode="wrap")
    def _dump_modalities(self, value: Mapping[str, ModalitySpec], handler) -> Any:
        return handler(dict(value))          # dumped as the plain mapping it was given as

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value != "cpu" and not (value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit())):
            raise ValueError(f"device must be 'cpu' or 'cuda:N', got {value!r}")
        return "cuda:0" if value == "cuda" else value

    @field_validator("eviction_policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown eviction policy {value!r}; choose one of {POLICIES}")
        return value

    @model_validator(mode="after")
    def _resolve(self) -> CacheConfig:
        if self.dtype not in FP8_DTYPES and (self.k_scale is not None or self.v_scale is not None):
            raise ValueError(f"k_scale / v_scale are for an fp8 KV cache (dtype float8_e4m3fn / float8_e5m2), "
                             f"dtype is {self.dtype}")
        resolved = {}
        for name, spec in self.modalities.items():
            update: dict[str, Any] = {"name": name}
            if spec.kind == "kv":
                for field in _MODEL_FIELDS:
                    if getattr(spec, field) is None:
                        update[field] = getattr(self, field)
                if (spec.dtype or self.dtype) not in FP8_DTYPES:      # the model's scales: its fp8 pools'
                    update.update({f: None for f in ("k_scale", "v_scale") if getattr(spec, f) is None})
            elif spec.dtype is None:
                update["dtype"] = self.dtype
            spec = spec.model_copy(update=update)
            _check_scales(spec, name)
            resolved[name] = spec
        object.__setattr__(self, "modalities", FrozenModalities(resolved))
        return self

    # ---- helpers ----
    def spec(self, modality: str) -> ModalitySpec:
        from .errors import UnknownModalityError

        try:
            return self.modalities[modality]
        except KeyError:
            raise UnknownModalityError(
                f"unknown modality {modality!r}; this cache has {sorted(self.modalities)}") from None

    def pool_bytes(self, arena_bytes: int) -> dict[str, int]:
        """How the device arena is carved: explicit shares first, the rest split equally."""
        fixed = {n: s.share for n, s in self.modalities.items() if s.share is not None}
        rest = [n for n in self.modalities if n not in fixed]
        left = max(0.0, 1.0 - sum(fixed.values()))
        out = {n: int(arena_bytes * f) for n, f in fixed.items()}
        for n in rest:
            out[n] = int(arena_bytes * left / len(rest))
        return out

    @classmethod
    def from_yaml(cls, path: str | Path) -> CacheConfig:
        """Load a config file (a mapping; a top-level ``cache:`` section is also accepted)."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        if isinstance(data, dict) and "cache" in data and "model" not in data:
            data = data["cache"]
        if not isinstance(data, dict):
            raise ConfigError(f"config {path} must be a mapping")
        return cls(**data)


def require_key_secret(cfg: CacheConfig, allow_default: bool, how: str) -> None:
    """``ConfigError`` when ``cfg`` uses the public default key secret and ``allow_default`` (an
    explicit local / development flag) is off: with it, anyone can derive every tenant's salt
    and forge key tags. ``how`` tells the operator where this command takes a secret from."""
    if cfg.key_secret == DEFAULT_KEY_SECRET and not allow_default:
        raise ConfigError(
            f"key_secret: the default key secret is public (tenant salts and key tags could be "
            f"derived by anyone); {how}, e.g. `export {KEY_SECRET_ENV}=$(python -c "
            f"'import secrets; print(secrets.token_hex(32))')`, the same on every node; or allow "
            f"the default explicitly for a local / development run", ("key_secret",))


def _scale_rows(value: Scale, layers: int, heads: int, field: str) -> tuple[tuple[float, ...], ...]:
    """``value`` as ``[layers][heads]`` floats; ``ValueError`` naming ``field`` where its shape
    or a value is wrong."""
    if isinstance(value, (int, float)):
        rows = ((float(value),) * heads,) * layers
    elif len(value) != layers:
        raise ValueError(f"{field}: {len(value)} entries for {layers} layers")
    elif all(isinstance(x, (int, float)) for x in value):
        rows = tuple((float(x),) * heads for x in value)
    else:
        if any(isinstance(x, (int, float)) or len(x) != heads for x in value):
            raise ValueError(f"{field}: each layer's entry must be {heads} per-head scales")
        rows = tuple(tuple(float(x) for x in row) for row in value)
    if not all(math.isfinite(x) and x > 0 for row in rows for x in row):
        raise ValueError(f"{field}: scales must be finite and > 0")
    return rows


def _check_scales(spec: ModalitySpec, name: str) -> None:
    """Scales only on fp8 kv pages, each of a shape the spec's layers and heads take."""
    for field in ("k_scale", "v_scale"):
        value = getattr(spec, field)
        if value is None:
            continue
        if not spec.is_fp8 or spec.kind != "kv":
            raise ValueError(f"modalities.{name}.{field}: scales are for fp8 kv pages "
                             f"(dtype float8_e4m3fn / float8_e5m2), this one is {spec.kind} {spec.dtype}")
        try:
            _scale_rows(value, spec.num_layers, spec.num_kv_heads, field)
        except ValueError as exc:
            raise ValueError(f"modalities.{name}.{exc}") from None


def _config_error(exc: ValidationError) -> ConfigError:
    fields = []
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(config)"
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError):       # a nested ModalitySpec's own error
            for field, line in zip(inner.fields, inner.lines):
                fields.append(f"{loc}.{field}")
                lines.append(f"{loc}.{line}")
            continue
        fields.append(loc)
        lines.append(f"{loc}: {err['msg']}")
    out = ConfigError("invalid mmtier config: " + "; ".join(lines), tuple(fields))
    out.lines = tuple(lines)
    return out
