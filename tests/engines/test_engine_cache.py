"""The engine-side cache plumbing every connector shares (no engine needed): the cache named by
an extra config, one per configuration per process, and the Serve LLM config's connectors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from mmtier.config import CacheConfig
from mmtier.engines.connector_cache import (
    CLUSTER_ENV,
    close_shared,
    cluster_from_extra,
    config_from_extra,
    open_shared,
    shared_cache,
    tenant_from_extra,
)
from mmtier.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
FIELDS = dict(model="tiny-engine", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float32",
              modalities={"text": {"page_size": 16}}, device="cpu", device_bytes=1 << 20)


def test_one_cache_per_configuration_per_process():
    try:
        a = shared_cache(config_from_extra({"mmtier_cache": FIELDS}))
        assert shared_cache(config_from_extra({"mmtier_cache": dict(FIELDS)})) is a
        assert shared_cache(config_from_extra({"mmtier_cache": {**FIELDS, "model": "other"}})) is not a
    finally:
        close_shared()
    assert a.closed


@pytest.mark.parametrize("extra", [{}, {"mmtier_cache": FIELDS, "mmtier_config": "x.yaml"},
                                   {"mmtier_cache": [1, 2]}])
def test_the_cache_must_be_named_exactly_once(extra):
    with pytest.raises(ConfigError):
        config_from_extra(extra)


def test_the_cluster_is_joined_only_when_asked_and_its_fields_are_checked(monkeypatch):
    monkeypatch.delenv(CLUSTER_ENV, raising=False)
    assert cluster_from_extra({"mmtier_cache": FIELDS}) is None
    try:
        cache, link = open_shared({"mmtier_cache": FIELDS})
        assert link is None and cache is shared_cache(config_from_extra({"mmtier_cache": FIELDS}))
    finally:
        close_shared()
    settings, address = cluster_from_extra({"mmtier_cluster": {"namespace": "ns", "address": "10.0.0.1:6379",
                                                               "call_timeout_s": 5}})
    assert (settings.namespace, settings.call_timeout_s, address) == ("ns", 5.0, "10.0.0.1:6379")
    monkeypatch.setenv(CLUSTER_ENV, '{"namespace": "from-env"}')
    assert cluster_from_extra({})[0].namespace == "from-env"
    assert cluster_from_extra({"mmtier_cluster": {}})[0].namespace == "mmtier"     # the config wins
    for bad, field in (({"mmtier_cluster": {"namspace": "x"}}, "mmtier_cluster.namspace"),
                       ({"mmtier_cluster": {"call_timeout_s": -1}}, "mmtier_cluster.call_timeout_s"),
                       ({"mmtier_cluster": {"address": ""}}, "mmtier_cluster.address"),
                       ({"mmtier_cluster": "mmtier"}, "mmtier_cluster")):
        with pytest.raises(ConfigError) as err:
            cluster_from_extra(bad)
        assert err.value.fields == (field,)
    monkeypatch.setenv(CLUSTER_ENV, "{not json")
    with pytest.raises(ConfigError):
        cluster_from_extra({})


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs Ray (mmtier.cluster)")
def test_an_engine_cache_shares_only_with_the_clusters_model_secret_and_layouts():
    from mmtier.cluster.link import check_compatible

    base = CacheConfig(**FIELDS)
    check_compatible(base, CacheConfig(**{**FIELDS, "device_bytes": 4 << 20, "host_bytes": 1 << 20}))
    for other, field in ((dict(model="another"), "model"), (dict(key_secret="s" * 64), "key_secret"),
                         (dict(head_dim=32), "modalities.text"),
                         (dict(modalities={"vision": {"page_size": 16}}), "modalities.text")):
        with pytest.raises(ConfigError) as err:
            check_compatible(base, CacheConfig(**{**FIELDS, **other}))
        assert err.value.fields == (field,)


def test_a_bad_tenant_is_refused():
    assert tenant_from_extra({"mmtier_tenant": "acme"}) == "acme"
    with pytest.raises(ConfigError):
        tenant_from_extra({"mmtier_tenant": ""})


def test_serve_llm_config_carries_both_connectors_over_one_valid_cache():
    app = yaml.safe_load((ROOT / "configs" / "serve-llm-vllm.yaml").read_text())["applications"][0]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    kwargs = app["args"]["llm_configs"][0]["engine_kwargs"]
    kv, ec = kwargs["kv_transfer_config"], kwargs["ec_transfer_config"]
    for module, cls in ((kv["kv_connector_module_path"], kv["kv_connector"]),
                        (ec["ec_connector_module_path"], ec["ec_connector"])):
        path = ROOT / (module.replace(".", "/") + ".py")
        assert f"class {cls}(" in path.read_text()
        assert importlib.util.find_spec(module.rsplit(".", 1)[0]) is not None
    cfg = config_from_extra(kv["kv_connector_extra_config"])
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype) == (28, 4, 128, "bfloat16")
    assert cfg.spec(ec["ec_connector_extra_config"]["mmtier_embed_modality"]).kind == "embedding"
    assert kwargs["block_size"] == cfg.spec("text").page_size
