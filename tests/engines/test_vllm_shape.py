"""The cache a vLLM engine needs, read from the engine (``mmtier.engines.vllm.shape``):
sizes from the extra config, flat keys or the environment in that order, shapes checked against
the engine's, and the shape read from a real ``VllmConfig`` where vLLM is installed."""

from __future__ import annotations

import pytest

from mmtier.config import CacheConfig
from mmtier.engines.connector_cache import config_from_extra
from mmtier.engines.vllm.shape import (
    EngineShape,
    available_bytes,
    cache_config,
    default_sizes,
    parse_bytes,
)
from mmtier.errors import ConfigError

SHAPE = EngineShape(model="/models/tiny", num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16",
                    block_size=32)
MM = EngineShape(model="/models/tiny-vl", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
                 block_size=16, media=("vision", "audio"), embed_width=256)


@pytest.mark.parametrize("text, want", [(4096, 4096), ("4096", 4096), ("8GiB", 8 << 30), ("512 MB", 512 * 10 ** 6),
                                        ("1.5g", int(1.5 * (1 << 30))), ("64kib", 64 << 10)])
def test_byte_counts_parse(text, want):
    assert parse_bytes(text, "f") == want


@pytest.mark.parametrize("text", ["lots", "8 GiBs", "-1G", True, "1e9"])
def test_bad_byte_counts_are_refused_naming_the_field(text):
    with pytest.raises(ConfigError) as err:
        parse_bytes(text, "mmtier_host_bytes")
    assert err.value.fields == ("mmtier_host_bytes",)


def test_no_fields_at_all_gives_a_cache_of_the_engines_shape_with_defaults_that_serve():
    cfg = cache_config(None, {}, SHAPE, env={})
    assert (cfg.model, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype) == \
        ("/models/tiny", 2, 2, 32, "bfloat16")
    assert list(cfg.modalities) == ["text"] and cfg.spec("text").page_size == 32
    assert cfg.disk_dir is None                                    # no disk tier unless asked
    assert 0 < cfg.host_bytes <= min(32 << 30, available_bytes() // 4)
    assert cfg.device == "cpu" and 0 < cfg.device_bytes <= 1 << 30
    assert default_sizes(SHAPE) == default_sizes(SHAPE)            # one value per process


def test_media_models_get_a_kv_pool_and_an_encoder_output_pool_per_media_kind():
    cfg = cache_config(None, {}, MM, env={})
    assert set(cfg.modalities) == {"text", "vision", "audio", "vision_embed", "audio_embed"}
    assert cfg.spec("vision").page_size == cfg.spec("audio").page_size == 16
    assert cfg.spec("vision_embed").kind == "embedding" and cfg.spec("vision_embed").width == 256
    assert cfg.spec("audio").num_kv_heads == 2 and cfg.spec("audio").dtype == "float16"


def test_sizes_come_from_the_cache_fields_then_flat_keys_then_the_environment(tmp_path):
    env = {"MMTIER_HOST_BYTES": "1GiB", "MMTIER_DISK_DIR": str(tmp_path / "env"), "MMTIER_DISK_BYTES": "2GiB"}
    extra = {"mmtier_host_bytes": "256MiB", "mmtier_disk_dir": str(tmp_path / "flat")}
    cfg = cache_config({"host_bytes": 64 << 20}, extra, SHAPE, env=env)
    assert cfg.host_bytes == 64 << 20                              # the cache fields win
    assert str(cfg.disk_dir) == str(tmp_path / "flat")              # then flat keys
    assert cfg.disk_bytes == 2 << 30                               # then the environment
    assert cache_config(None, {}, SHAPE, env=env).host_bytes == 1 << 30


@pytest.mark.parametrize("field, value, name", [("num_kv_heads", 8, "num_kv_heads"), ("head_dim", 128, "head_dim"),
                                                ("num_layers", 32, "num_layers"), ("dtype", "float16", "dtype")])
def test_a_shape_that_disagrees_with_the_engine_is_refused_naming_the_field_and_both_values(field, value, name):
    given = {"model": "preset", "num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "bfloat16",
             "modalities": {"text": {"page_size": 32}}, field: value}
    with pytest.raises(ConfigError) as err:
        cache_config(given, {}, SHAPE, env={})
    assert err.value.fields == (name,)
    assert repr(value) in str(err.value) and repr(getattr(SHAPE, field)) in str(err.value)


def test_a_modality_override_that_disagrees_names_the_modality_field():
    given = {"modalities": {"text": {"page_size": 32, "head_dim": 64}}}
    with pytest.raises(ConfigError) as err:
        cache_config(given, {}, SHAPE, env={})
    assert err.value.fields == ("modalities.text.head_dim",)


def test_a_matching_preset_keeps_its_own_model_name_and_page_size():
    given = {"model": "llava-preset", "num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "bfloat16",
             "modalities": {"text": {"page_size": 64}}, "device_bytes": 1 << 20}
    cfg = cache_config(given, {}, SHAPE, env={})
    assert cfg.model == "llava-preset" and cfg.spec("text").page_size == 64 and cfg.device_bytes == 1 << 20


def test_the_extra_config_without_an_engine_still_needs_a_whole_config():
    with pytest.raises(ConfigError):
        config_from_extra({"mmtier_host_bytes": "1GiB"})
    cfg = config_from_extra({"mmtier_host_bytes": "1GiB"}, SHAPE)
    assert isinstance(cfg, CacheConfig) and cfg.num_layers == 2


def test_the_shape_is_read_from_a_real_vllm_config(tmp_path):
    pytest.importorskip("vllm.engine.arg_utils", reason="no vLLM here: run ./run engines (the engines "
                        "environment runs this file)")
    from vllm.engine.arg_utils import EngineArgs

    from mmtier.engines.vllm.shape import engine_shape
    from tests.support.vllm_models import build_llama

    model = build_llama(tmp_path / "llama")
    vcfg = EngineArgs(model=str(model), skip_tokenizer_init=True, block_size=32, dtype="bfloat16",
                      max_model_len=1024).create_engine_config()
    shape = engine_shape(vcfg)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.block_size) == \
        (2, 2, 32, "bfloat16", 32)
    assert shape.model == str(model) and shape.media == () and shape.device == "cpu"
