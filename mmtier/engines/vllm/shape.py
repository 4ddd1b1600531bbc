"""The cache a vLLM engine needs, read from the engine itself: its KV shape and the sizes a user
gives. A vLLM user names the connector and, at most, the sizes:

    kv_transfer_config = {"kv_connector": "MMTierConnector",
                          "kv_connector_module_path": "mmtier.engines.vllm.connector",
                          "kv_role": "kv_both",
                          "kv_connector_extra_config": {"mmtier_host_bytes": "8GiB",
                                                        "mmtier_disk_dir": "/nvme/mmtier"}}

``engine_shape`` reads layers, KV heads per rank, head size, the KV cache dtype and the block size
from vLLM's config (``kv_cache_config``'s attention spec where vLLM passes one, else the model
config), and the media the model takes from its multimodal config. ``cache_config`` builds the
``CacheConfig`` from that shape and the sizes, taken in this order: the ``mmtier_cache`` mapping
(or the ``mmtier_config`` YAML) of the extra config, flat ``mmtier_<field>`` keys of the extra
config, ``MMTIER_<FIELD>`` environment variables, then defaults that serve (see ``SIZE_FIELDS``).
Shape fields a user does give (a preset, an inline shape) are checked against the engine's: a
disagreement is a ``ConfigError`` at startup naming the field and both values, never a cache
whose pages do not fit vLLM's blocks. Nothing here imports vLLM: its config objects are read
by attribute.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import CacheConfig
from ...errors import ConfigError

# fields of CacheConfig a user may set without a shape (flat extra keys / environment variables)
SIZE_FIELDS = ("device", "device_bytes", "device_fraction", "host_bytes", "disk_dir", "disk_bytes",
               "disk_free_floor_bytes", "eviction_policy", "key_secret", "max_inflight_bytes",
               "stream_buffer_bytes", "attention_backend", "persist_on_close", "write_behind",
               "durable_lag_s", "durable_quiet_s")
BYTE_FIELDS = {"device_bytes", "host_bytes", "disk_bytes", "disk_free_floor_bytes", "max_inflight_bytes",
               "stream_buffer_bytes"}
SHAPE_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype")
DEFAULT_DEVICE_BYTES = 1 << 30          # the page pool in front of the lower tiers
DEFAULT_HOST_CAP = 32 << 30             # the host tier: a quarter of available memory, capped
EMBED_PAGE = 64                         # tokens per page of an encoder-output pool
_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
                 "float32": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16",
                 "float": "float32"}
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10 ** 3, "kib": 1 << 10, "m": 1 << 20, "mb": 10 ** 6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10 ** 9, "gib": 1 << 30, "t": 1 << 40, "tb": 10 ** 12,
          "tib": 1 << 40}


@dataclass(frozen=True)
class EngineShape:
    """What an engine's KV cache is on this rank, and the media its model takes."""

    model: str
    num_layers: int                  # attention layers whose KV the connector moves
    num_kv_heads: int                # per rank
    head_dim: int
    dtype: str                       # float32 / float16 / bfloat16 / float8_e4m3fn / float8_e5m2
    block_size: int
    media: tuple[str, ...] = ()      # mmtier KV modalities of the model's media ("vision", "audio")
    embed_width: int | None = None   # width of encoder outputs (the language model's input width)
    device: str = "cpu"
    # the recurrent state of Mamba / linear-attention layers, one pool per state tensor:
    # (width, dtype, rows of one layer's state) over ``state_layers`` layers; empty for
    # attention-only models
    states: tuple[tuple[int, str, int], ...] = ()
    state_layers: int = 0

    @property
    def state_modalities(self) -> tuple[str, ...]:
        return tuple(f"state{i}" for i in range(len(self.states)))


# vLLM's fp8 KV caches (``--kv-cache-dtype``): its tensors are uint8, the name says the format
_FP8_CACHE = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _dtype_name(value: Any, field: str) -> str:
    name = _TORCH_DTYPES.get(str(value))
    if name is None:
        raise ConfigError(f"{field}: vLLM's KV cache dtype is {value}; mmtier's pages hold float32, float16, "
                          f"bfloat16 or fp8 (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2)", (field,))
    return name


def _fp8_name(cc: Any) -> str | None:
    """mmtier's page dtype for vLLM's fp8 KV cache, or ``None`` where it is not fp8. Scales
    computed from the first batch (``calculate_kv_scales``) are refused: the bytes of a block
    would mean other values in an engine that computed other scales, under the same key."""
    cache_dtype = str(getattr(cc, "cache_dtype", "auto") or "auto")
    if cache_dtype not in _FP8_CACHE:
        if cache_dtype.startswith("fp8"):
            raise ConfigError(f"dtype: vLLM's KV cache dtype {cache_dtype} is not one mmtier serves "
                              f"({sorted(_FP8_CACHE)})", ("dtype",))
        return None
    if getattr(cc, "calculate_kv_scales", False):
        raise ConfigError("dtype: an fp8 KV cache whose scales vLLM computes at run time (calculate_kv_scales) "
                          "cannot be shared: stored blocks would be read under other scales", ("dtype",))
    return _FP8_CACHE[cache_dtype]


def _attention_specs(kv_cache_config: Any) -> list[tuple[Any, list[str]]]:
    """``(spec, layer names)`` of the KV cache groups whose spec has a head size (attention)."""
    out = []
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = group.kv_cache_spec
        if hasattr(spec, "head_size") and hasattr(spec, "num_kv_heads"):
            out.append((spec, list(group.layer_names)))
    return out


def _state_specs(kv_cache_config: Any) -> tuple[tuple[tuple[int, str, int], ...], int]:
    """``(width, dtype, rows of one layer)`` of each state tensor of the KV cache groups that
    hold a recurrent state (vLLM's ``MambaSpec``: ``shapes`` / ``dtypes`` per layer), and how
    many layers hold one; ``((), 0)`` where there are none."""
    specs = [(g.kv_cache_spec, len(g.layer_names)) for g in getattr(kv_cache_config, "kv_cache_groups", None) or []
             if hasattr(g.kv_cache_spec, "shapes") and hasattr(g.kv_cache_spec, "dtypes")]
    if not specs:
        return (), 0
    spec = specs[0][0]
    out = []
    for shape, dtype in zip(spec.shapes, spec.dtypes):
        rows = 1
        for d in shape[:-1]:
            rows *= int(d)
        out.append((int(shape[-1]), _dtype_name(dtype, "dtype"), rows))
    return tuple(out), sum(n for _, n in specs)


def _media(model_config: Any) -> tuple[str, ...]:
    if getattr(model_config, "multimodal_config", None) is None:
        return ()
    hf = getattr(model_config, "hf_config", None)
    media = []
    if any(getattr(hf, name, None) is not None for name in ("vision_config", "visual", "vision_tower")):
        media.append("vision")
    if any(getattr(hf, name, None) is not None for name in ("audio_config", "audio_encoder")):
        media.append("audio")
    return tuple(media) or ("vision",)


def engine_shape(vllm_config: Any, kv_cache_config: Any = None) -> EngineShape | None:
    """The KV shape of this rank of the engine ``vllm_config`` describes; ``None`` where the
    config names no model (a bare ``VllmConfig``: the cache config must then be whole)."""
    mc, par, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if mc is None:
        return None
    specs = _attention_specs(kv_cache_config)
    if specs:
        spec, _ = specs[0]
        layers = sum(len(names) for _, names in specs)
        heads, head_dim, block = int(spec.num_kv_heads), int(spec.head_size), int(spec.block_size)
        dtype = _fp8_name(cc) or _dtype_name(spec.dtype, "dtype")
    else:
        layers = int(mc.get_num_layers_by_block_type(par, "attention"))
        heads, head_dim, block = int(mc.get_num_kv_heads(par)), int(mc.get_head_size()), int(cc.block_size)
        cache_dtype = getattr(cc, "cache_dtype", "auto")
        dtype = _fp8_name(cc) or _dtype_name(mc.dtype if cache_dtype in ("auto", None) else cache_dtype, "dtype")
    media = _media(mc)
    states, state_layers = _state_specs(kv_cache_config)
    width = None
    if media:
        width = int(mc.get_inputs_embeds_size() if hasattr(mc, "get_inputs_embeds_size") else mc.get_hidden_size())
    return EngineShape(model=str(mc.model), num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                       dtype=dtype, block_size=block, media=media, embed_width=width,
                       device=_device(vllm_config), states=states, state_layers=state_layers)


@dataclass(frozen=True)
class EngineShard:
    """Which shard of every group this process's worker holds. A tensor-parallel rank holds its
    KV heads, a pipeline stage its layers: ``count`` workers (TP x PP), this one ``index``
    (``pp_rank * tp + tp_rank``; 0 on the scheduler), keyed apart by ``tag`` (``"tp1/2.pp0/1"``,
    ``None`` for an engine of one worker, whose keys stay the groups' own)."""

    index: int = 0
    count: int = 1
    tag: str | None = None


def engine_shard(vllm_config: Any, *, worker: bool) -> EngineShard:
    """The shard of the engine ``vllm_config`` this process holds (``worker``: a model runner's
    process, whose tensor / pipeline ranks vLLM has set up before it builds connectors)."""
    par = vllm_config.parallel_config
    tp, pp = int(par.tensor_parallel_size), int(par.pipeline_parallel_size)
    if tp * pp == 1:
        return EngineShard()
    tp_rank = pp_rank = 0
    if worker:
        from vllm.distributed import parallel_state

        tp_rank = parallel_state.get_tp_group().rank_in_group
        pp_rank = parallel_state.get_pp_group().rank_in_group
    return EngineShard(pp_rank * tp + tp_rank, tp * pp, f"tp{tp_rank}/{tp}.pp{pp_rank}/{pp}")


def _device(vllm_config: Any) -> str:
    """``"cpu"`` for vLLM's CPU build, else the CUDA device this worker computes on."""
    device_type = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu") or "cpu")
    if device_type == "cpu":
        return "cpu"
    import torch

    # a worker has set its device; a scheduler's process never touches CUDA (its cache holds keys only)
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_initialized() else "cuda:0"


def parse_bytes(value: Any, field: str) -> int:
    """``8589934592``, ``"8GiB"``, ``"512 MB"``, ``"1.5g"`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}: a byte count, got {value!r}", (field,))
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{field}: a byte count such as 8589934592 or '8GiB', got {value!r}", (field,))
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@functools.cache
def available_bytes() -> int:
    """Memory available to this process, read once (every connector of a process then derives
    the same defaults, and so shares one cache)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def default_sizes(shape: EngineShape) -> dict[str, Any]:
    """Sizes that serve when the user gives none: a 1 GiB page pool (on the CPU at most an eighth
    of available memory), a host tier of a quarter of available memory capped at 32 GiB, no disk
    tier unless a directory is given."""
    avail = available_bytes()
    device = DEFAULT_DEVICE_BYTES if shape.device != "cpu" else min(DEFAULT_DEVICE_BYTES, avail // 8)
    return {"device": shape.device, "device_bytes": device, "host_bytes": min(DEFAULT_HOST_CAP, avail // 4)}


def _sizes(extra: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in SIZE_FIELDS:
        env_name = "MMTIER_" + name.upper()
        if f"mmtier_{name}" in extra:
            out[name], where = extra[f"mmtier_{name}"], f"mmtier_{name}"
        elif env.get(env_name):
            out[name], where = env[env_name], env_name
        else:
            continue
        if name in BYTE_FIELDS:
            out[name] = parse_bytes(out[name], where)
        elif name == "device_fraction":
            out[name] = float(out[name])
    return out


def shape_fields(shape: EngineShape) -> dict[str, Any]:
    """The ``CacheConfig`` fields of ``shape``: a text pool of block-sized pages, a KV pool per
    media kind, and an encoder-output pool per media kind (the encoder-cache connector's)."""
    mods: dict[str, Any] = {"text": {"page_size": shape.block_size}}
    for name in shape.media:
        mods[name] = {"page_size": shape.block_size, "share": 0.5 / (2 * len(shape.media))}
        mods[f"{name}_embed"] = {"kind": "embedding", "width": shape.embed_width, "page_size": EMBED_PAGE,
                                 "share": 0.5 / (2 * len(shape.media))}
    for name, (width, dtype, rows) in zip(shape.state_modalities, shape.states):
        # a page per layer's state (a state is saved where a prefill step ends, not per block)
        mods[name] = {"kind": "embedding", "width": width, "dtype": dtype, "page_size": min(rows, 4096),
                      "share": 0.25 / len(shape.states)}
    return {"model": shape.model, "num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "dtype": shape.dtype, "modalities": mods}


def check_shape(cfg: CacheConfig, shape: EngineShape, kv_modalities: tuple[str, ...]) -> None:
    """``ConfigError`` naming the field and both values where a KV pool ``kv_modalities`` names
    disagrees with the engine's KV tensors."""
    for name in kv_modalities:
        if name not in cfg.modalities or cfg.spec(name).kind != "kv":
            continue
        spec = cfg.spec(name)
        for field in SHAPE_FIELDS:
            mine, theirs = getattr(spec, field), getattr(shape, field)
            if mine != theirs:
                where = field if getattr(cfg, field) == mine else f"modalities.{name}.{field}"
                raise ConfigError(f"{where}: the mmtier config says {mine!r}, the vLLM engine's KV cache "
                                  f"has {theirs!r} (model {shape.model}); drop the shape fields to have "
                                  f"them read from vLLM, or fix them", (where,))


def cache_config(user: Mapping[str, Any] | CacheConfig | None, extra: Mapping[str, Any] | None,
                 shape: EngineShape, env: Mapping[str, str] | None = None) -> CacheConfig:
    """The cache for an engine of ``shape``: ``user`` (the ``mmtier_cache`` fields or a loaded
    preset; ``None``: none given) over the flat / environment sizes over the defaults, the shape
    read from the engine wherever ``user`` leaves it out and checked where it does not."""
    env = os.environ if env is None else env
    given = user.model_dump() if isinstance(user, CacheConfig) else dict(user or {})
    fields = {**shape_fields(shape), **default_sizes(shape), **_sizes(extra or {}, env)}
    fields.update(given)
    for name in BYTE_FIELDS & fields.keys():
        if isinstance(fields[name], str):
            fields[name] = parse_bytes(fields[name], f"mmtier_cache.{name}")
    cfg = CacheConfig(**fields)
    check_shape(cfg, shape, ("text", *shape.media))
    return cfg
