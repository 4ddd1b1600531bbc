"""CacheConfig / ModalitySpec: presets, inheritance, size math, validation, immutability."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pydantic
import pytest
import yaml

from mmtier.config import DTYPES, CacheConfig, ModalitySpec
from mmtier.errors import ConfigError, MMTierError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _is_cache_preset(path: Path) -> bool:
    """configs/ also holds Ray / KubeRay / Serve YAML: a cache preset has model and modalities."""
    data = yaml.safe_load(path.read_text())
    if isinstance(data, dict) and isinstance(data.get("cache"), dict):
        data = data["cache"]
    return isinstance(data, dict) and "model" in data and "modalities" in data


PRESETS = sorted(p.name for p in CONFIGS.glob("*.yaml") if _is_cache_preset(p))


def base(**over):
    d = dict(model="m", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32",
             modalities={"text": {"page_size": 16}}, device="cpu", device_bytes=1 << 20)
    d.update(over)
    return d


def config_error(**over) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        CacheConfig(**base(**over))
    return info.value


# ---------------------------------------------------------------------------------- presets
EXPECTED = {
    # file: (model-level (L, H, D, dtype), {modality: (kind, page_size, page_shape)})
    "llava-1.5-7b.yaml": ((32, 32, 128, "float16"), {
        "text": ("kv", 16, (32, 2, 16, 32, 128)),
        "vision": ("kv", 64, (32, 2, 64, 32, 128))}),
    "qwen2.5-vl-7b.yaml": ((28, 4, 128, "bfloat16"), {
        "text": ("kv", 16, (28, 2, 16, 4, 128)),
        "vision": ("kv", 64, (28, 2, 64, 4, 128)),
        "video": ("kv", 128, (28, 2, 128, 4, 128))}),
    "llama-3.2-11b-vision.yaml": ((40, 8, 128, "bfloat16"), {
        "text": ("kv", 16, (32, 2, 16, 8, 128)),
        "vision": ("kv", 64, (8, 2, 64, 8, 128))}),
    "whisper-audio.yaml": ((32, 20, 64, "float16"), {
        "text": ("kv", 16, (32, 2, 16, 20, 64)),
        "audio": ("kv", 60, (32, 2, 60, 20, 64))}),
    "llama-3-8b.yaml": ((32, 8, 128, "bfloat16"), {
        "text": ("kv", 16, (32, 2, 16, 8, 128))}),
    "tiny-mm.yaml": ((2, 2, 64, "float32"), {
        "text": ("kv", 16, (2, 2, 16, 2, 64)),
        "vision": ("kv", 64, (2, 2, 64, 2, 64)),
        "audio": ("kv", 32, (2, 2, 32, 2, 64)),
        "vision_embed": ("embedding", 64, (64, 64))}),
}


def test_every_expected_preset_exists():
    assert set(EXPECTED) <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_resolved_and_modest(name):
    cfg = CacheConfig.from_yaml(CONFIGS / name)
    assert cfg.device == "cpu"
    assert cfg.device_bytes is not None and cfg.device_bytes <= 4 << 30   # loads on a small box
    text = (CONFIGS / name).read_text()
    assert text.lstrip().startswith("#"), "a preset starts with a comment header"
    assert "cuda:0" in text and "device_bytes: null" in text, "header shows how to switch to CUDA"
    plan = cfg.pool_bytes(cfg.device_bytes)
    for mod, spec in cfg.modalities.items():
        assert spec.name == mod
        assert spec.page_size >= 16
        assert spec.dtype is not None
        if spec.kind == "kv":
            assert None not in (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        assert plan[mod] // spec.page_bytes >= 8, f"{name}: {mod} pool too small to be useful"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_shapes_match_the_real_models(name):
    cfg = CacheConfig.from_yaml(CONFIGS / name)
    (layers, heads, hdim, dtype), mods = EXPECTED[name]
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype) == (layers, heads, hdim, dtype)
    assert set(cfg.modalities) == set(mods)
    for mod, (kind, page, shape) in mods.items():
        spec = cfg.modalities[mod]
        assert (spec.kind, spec.page_size, spec.page_shape) == (kind, page, shape)
        assert spec.page_bytes == math.prod(shape) * DTYPES[spec.dtype]


def test_preset_page_fits():
    llava = CacheConfig.from_yaml(CONFIGS / "llava-1.5-7b.yaml").modalities["vision"]
    assert 576 % llava.page_size == 0 and llava.pages_for(576) == 9
    whisper = CacheConfig.from_yaml(CONFIGS / "whisper-audio.yaml").modalities["audio"]
    assert 1500 % whisper.page_size == 0 and whisper.page_size >= 16
    mllama = CacheConfig.from_yaml(CONFIGS / "llama-3.2-11b-vision.yaml").modalities["vision"]
    assert mllama.num_layers == 8 and mllama.pages_for(1601) == 26
    tiny = CacheConfig.from_yaml(CONFIGS / "tiny-mm.yaml")
    assert tiny.device_bytes == 64 << 20 and tiny.modalities["vision_embed"].width == 64


def test_preset_equals_the_design_example():
    example = CacheConfig(
        model="tiny-mm", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32",
        modalities={"text": ModalitySpec(page_size=16), "vision": ModalitySpec(page_size=64),
                    "audio": ModalitySpec(page_size=32),
                    "vision_embed": ModalitySpec(kind="embedding", page_size=64, width=64)},
        device="cpu", device_bytes=64 << 20, host_bytes=256 << 20, attention_backend="auto")
    assert CacheConfig.from_yaml(CONFIGS / "tiny-mm.yaml") == example


def test_cache_section_is_accepted(tmp_path):
    src = (CONFIGS / "llama-3-8b.yaml").read_text()
    wrapped = "cache:\n" + "".join("  " + line + "\n" for line in src.splitlines())
    (tmp_path / "c.yaml").write_text(wrapped)
    assert CacheConfig.from_yaml(tmp_path / "c.yaml") == CacheConfig.from_yaml(CONFIGS / "llama-3-8b.yaml")


# ------------------------------------------------------------------------ inheritance / math
def test_unset_fields_inherit_from_the_model():
    cfg = CacheConfig(**base(num_layers=7, num_kv_heads=3, head_dim=48, dtype="bfloat16",
                             modalities={"text": {"page_size": 16},
                                         "vision": {"page_size": 32, "num_layers": 2, "dtype": "float32"}}))
    text, vision = cfg.modalities["text"], cfg.modalities["vision"]
    assert (text.num_layers, text.num_kv_heads, text.head_dim, text.dtype) == (7, 3, 48, "bfloat16")
    assert (vision.num_layers, vision.num_kv_heads, vision.head_dim, vision.dtype) == (2, 3, 48, "float32")
    assert text.name == "text" and vision.name == "vision"
    assert text.width is None


def test_modality_with_its_own_head_dim():
    cfg = CacheConfig(**base(head_dim=128, dtype="float16",
                             modalities={"text": {"page_size": 16}, "vision": {"page_size": 64, "head_dim": 80}}))
    v = cfg.modalities["vision"]
    assert v.head_dim == 80 and cfg.modalities["text"].head_dim == 128
    assert v.page_shape == (2, 2, 64, 2, 80)
    assert v.page_bytes == 2 * 2 * 64 * 2 * 80 * 2
    assert v.token_bytes == 2 * 2 * 2 * 80 * 2


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("page,layers,heads,hdim", [(16, 2, 2, 64), (1, 1, 1, 1), (60, 32, 20, 64), (7, 3, 5, 80)])
def test_kv_page_math(dtype, page, layers, heads, hdim):
    cfg = CacheConfig(**base(num_layers=layers, num_kv_heads=heads, head_dim=hdim, dtype=dtype,
                             modalities={"x": {"page_size": page}}))
    s = cfg.modalities["x"]
    assert s.page_shape == (layers, 2, page, heads, hdim)
    assert s.page_elems == layers * 2 * page * heads * hdim
    assert s.page_bytes == s.page_elems * DTYPES[dtype] == s.page_size * s.token_bytes
    assert s.itemsize == DTYPES[dtype]
    assert s.pages_for(0) == 0 and s.pages_for(1) == 1
    assert s.pages_for(page) == 1 and s.pages_for(page + 1) == 2 and s.pages_for(10 * page) == 10


def test_embedding_page_math():
    cfg = CacheConfig(**base(dtype="bfloat16", modalities={
        "text": {"page_size": 16}, "emb": {"kind": "embedding", "page_size": 64, "width": 96}}))
    e = cfg.modalities["emb"]
    assert e.page_shape == (64, 96)
    assert e.page_bytes == 64 * 96 * 2 and e.token_bytes == 96 * 2
    assert e.dtype == "bfloat16"                       # inherited
    assert e.num_layers is None and e.head_dim is None  # kv fields stay unset for embeddings
    import torch
    assert e.torch_dtype is torch.bfloat16


def test_unresolved_spec_refuses_size_math():
    spec = ModalitySpec(page_size=16)
    with pytest.raises(ConfigError) as info:
        _ = spec.page_bytes
    assert info.value.fields and set(info.value.fields) <= {"num_layers", "num_kv_heads", "head_dim", "dtype"}


def test_layout_fields_cover_every_size_field():
    s = CacheConfig(**base()).modalities["text"]
    names = [n for n, _ in s.layout_fields()]
    assert names == ["kind", "layers", "kv_heads", "head_dim", "width", "dtype", "page_size"]


def test_pool_bytes_explicit_and_equal_split():
    cfg = CacheConfig(**base(modalities={"a": {"page_size": 16, "share": 0.5},
                                         "b": {"page_size": 16}, "c": {"page_size": 16}}))
    assert cfg.pool_bytes(1000) == {"a": 500, "b": 250, "c": 250}
    cfg = CacheConfig(**base(modalities={"a": {"page_size": 16}, "b": {"page_size": 16}}))
    assert cfg.pool_bytes(1 << 20) == {"a": 1 << 19, "b": 1 << 19}


def test_cuda_shorthand_and_nvml_sizing_allowed():
    cfg = CacheConfig(**base(device="cuda", device_bytes=None))
    assert cfg.device == "cuda:0" and cfg.device_bytes is None
    assert CacheConfig(**base(device="cuda:3")).device == "cuda:3"


# ---------------------------------------------------------------------------- invalid configs
@pytest.mark.parametrize("over,field", [
    ({"bogus": 1}, "bogus"),
    ({"modalities": {"text": {"page_size": 16, "bogus": 1}}}, "modalities.text.bogus"),
    ({"modalities": {"text": {"page_size": -16}}}, "modalities.text.page_size"),
    ({"modalities": {"text": {"page_size": 0}}}, "modalities.text.page_size"),
    ({"modalities": {"text": {}}}, "modalities.text.page_size"),
    ({"modalities": {"text": {"page_size": 16, "head_dim": 0}}}, "modalities.text.head_dim"),
    ({"modalities": {"text": {"page_size": 16, "share": 0}}}, "modalities.text.share"),
    ({"modalities": {"text": {"page_size": 16, "share": 1.5}}}, "modalities.text.share"),
    ({"modalities": {"text": {"page_size": 16, "kind": "pixels"}}}, "modalities.text.kind"),
    ({"modalities": {"text": {"page_size": 16, "dtype": "int8"}}}, "modalities.text.dtype"),
    ({"modalities": {}}, "modalities"),
    ({"modalities": {"a b": {"page_size": 16}}}, "modalities"),
    ({"dtype": "float64"}, "dtype"),
    ({"dtype": "fp16"}, "dtype"),
    ({"num_layers": -1}, "num_layers"),
    ({"num_kv_heads": 0}, "num_kv_heads"),
    ({"head_dim": 0}, "head_dim"),
    ({"model": ""}, "model"),
    ({"eviction_policy": "mru"}, "eviction_policy"),
    ({"attention_backend": "cuda"}, "attention_backend"),
    ({"device": "gpu"}, "device"),
    ({"device": "cuda:"}, "device"),
    ({"device": "cuda:x"}, "device"),
    ({"device": "cuda:-1"}, "device"),
    ({"device": "CPU"}, "device"),
    ({"device_bytes": 0}, "device_bytes"),
    ({"device_bytes": -5}, "device_bytes"),
    ({"device_fraction": 0.99}, "device_fraction"),
    ({"host_bytes": -1}, "host_bytes"),
    ({"max_inflight_bytes": 0}, "max_inflight_bytes"),
])
def test_invalid_field_is_named(over, field):
    err = config_error(**over)
    assert isinstance(err, MMTierError) and isinstance(err, ValueError)
    assert field in err.fields, (err.fields, str(err))
    assert field in str(err)


def test_every_offending_field_is_named():
    err = config_error(bogus=1, dtype="int8", modalities={"text": {"page_size": -1}})
    assert {"bogus", "dtype", "modalities.text.page_size"} <= set(err.fields)


def test_embedding_without_width_is_refused():
    err = config_error(modalities={"e": {"kind": "embedding", "page_size": 16}})
    assert any(f.startswith("modalities.e") for f in err.fields)
    assert "width" in str(err)


def test_kv_with_width_is_refused():
    err = config_error(modalities={"e": {"kind": "kv", "page_size": 16, "width": 8}})
    assert any(f.startswith("modalities.e") for f in err.fields)
    assert "width" in str(err)


def test_shares_over_one_are_refused():
    err = config_error(modalities={"a": {"page_size": 16, "share": 0.7}, "b": {"page_size": 16, "share": 0.4}})
    assert "share" in str(err)


def test_cpu_without_device_bytes_is_refused():
    err = config_error(device_bytes=None)
    assert "device_bytes" in str(err)


@pytest.mark.parametrize("over,suffix", [
    ({"modalities": {"a": {"page_size": 16, "share": 0.7}, "b": {"page_size": 16, "share": 0.4}}},
     ".share"),
    ({"device_bytes": None}, "device_bytes"),
])
def test_model_level_errors_name_the_field(over, suffix):
    err = config_error(**over)
    assert any(f.endswith(suffix) for f in err.fields), err.fields


def test_embedding_without_width_names_width():
    err = config_error(modalities={"e": {"kind": "embedding", "page_size": 16}})
    assert "modalities.e.width" in err.fields


def test_invalid_modality_spec_raises_config_error():
    with pytest.raises(ConfigError):
        ModalitySpec(page_size=-1)


def test_bool_is_not_a_layer_count():
    config_error(num_layers=True)


# --------------------------------------------------------------------------------- YAML files
def test_malformed_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: m\nmodalities: {text: [page_size: 16\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_yaml(p)
    assert str(p) in str(info.value)


@pytest.mark.parametrize("body", ["- a\n- b\n", "42\n", "just a string\n", "", "cache: 3\n"])
def test_non_mapping_yaml(tmp_path, body):
    p = tmp_path / "list.yaml"
    p.write_text(body)
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_yaml(p)
    assert "mapping" in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError):
        CacheConfig.from_yaml(tmp_path / "absent.yaml")


def test_yaml_errors_name_the_field(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text((CONFIGS / "tiny-mm.yaml").read_text().replace("page_size: 32", "page_size: -32"))
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_yaml(p)
    assert info.value.fields == ("modalities.audio.page_size",)
    p.write_text((CONFIGS / "tiny-mm.yaml").read_text() + "colour: blue\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_yaml(p)
    assert info.value.fields == ("colour",)


# ------------------------------------------------------------------------------------ frozen
def test_configs_are_frozen():
    cfg = CacheConfig.from_yaml(CONFIGS / "tiny-mm.yaml")
    with pytest.raises((pydantic.ValidationError, TypeError, AttributeError)):
        cfg.device_bytes = 1   # type: ignore[misc]
    with pytest.raises((pydantic.ValidationError, TypeError, AttributeError)):
        cfg.model = "other"    # type: ignore[misc]
    spec = cfg.modalities["text"]
    with pytest.raises((pydantic.ValidationError, TypeError, AttributeError)):
        spec.page_size = 32    # type: ignore[misc]
    with pytest.raises((pydantic.ValidationError, TypeError, AttributeError)):
        spec.head_dim = 1      # type: ignore[misc]
    assert spec.page_size == 16 and cfg.device_bytes == 64 << 20
    assert hash(spec) == hash(spec.model_copy())


def test_modalities_mapping_is_frozen_and_the_config_hashes():
    cfg = CacheConfig.from_yaml(CONFIGS / "tiny-mm.yaml")
    text = cfg.modalities["text"]
    with pytest.raises(TypeError):
        cfg.modalities["text"] = ModalitySpec(page_size=1)   # type: ignore[index]
    with pytest.raises(TypeError):
        del cfg.modalities["text"]                           # type: ignore[attr-defined]
    for name in ("pop", "update", "clear", "setdefault"):
        assert not hasattr(cfg.modalities, name)
    assert cfg.modalities["text"] is text and len(cfg.modalities) == 4
    again = CacheConfig.from_yaml(CONFIGS / "tiny-mm.yaml")
    assert hash(cfg) == hash(again) and {cfg: 1}[again] == 1
    other = CacheConfig(**{**dict(cfg), "modalities": {**cfg.modalities, "text": ModalitySpec(page_size=32)}})
    assert other != cfg and other.modalities["text"].page_size == 32 and text.page_size == 16


def test_frozen_modalities_round_trip_json_pickle_and_revalidation():
    cfg = CacheConfig.from_yaml(CONFIGS / "tiny-mm.yaml")
    dumped = cfg.model_dump()
    assert type(dumped["modalities"]) is dict and dumped["modalities"]["vision"]["page_size"] == 64
    from_json = CacheConfig.model_validate_json(cfg.model_dump_json())
    assert from_json == cfg and hash(from_json) == hash(cfg)
    assert CacheConfig.model_validate(yaml.safe_load(yaml.safe_dump(json.loads(cfg.model_dump_json())))) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert CacheConfig(**dict(cfg)) == cfg                    # the frozen mapping validates again
    with pytest.raises(ConfigError) as err:
        CacheConfig(**{**dict(cfg), "modalities": {**cfg.modalities, "x y": {"page_size": 16}}})
    assert "modalities" in err.value.fields


def test_model_copy_revalidation_is_explicit():
    """``model_copy(update=...)`` skips validation; a new config goes through the constructor."""
    cfg = CacheConfig.from_yaml(CONFIGS / "tiny-mm.yaml")
    data = cfg.model_dump()
    data["modalities"] = {n: {k: v for k, v in s.items() if v is not None and k != "name"}
                          for n, s in data["modalities"].items()}
    assert CacheConfig(**data) == cfg
    data["device_bytes"] = None
    with pytest.raises(ConfigError):
        CacheConfig(**data)


def test_size_math_follows_a_copy_that_changes_its_fields():
    # the size math is taken once per spec; a copy with other fields takes it afresh
    s = CacheConfig(**base()).modalities["text"]
    before = (s.page_shape, s.page_bytes, s.torch_dtype)
    wider = s.model_copy(update={"page_size": s.page_size * 2, "dtype": "float32"})
    assert wider.page_shape[2] == 2 * s.page_size
    assert wider.page_bytes == math.prod(wider.page_shape) * 4
    import torch
    assert wider.torch_dtype is torch.float32
    assert (s.page_shape, s.page_bytes, s.torch_dtype) == before
    assert s == s.model_copy() and hash(s) == hash(s.model_copy()) and "page_bytes" not in s.model_dump()
