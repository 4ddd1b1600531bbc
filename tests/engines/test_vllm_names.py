"""``mmtier.engines.vllm.names``: whether a vLLM transfer config names mmtier's connectors,
as an object (vLLM's ``KVTransferConfig``) or as the mapping a user writes; and the Serve
router's check of a deployment's ``engine_kwargs`` built on it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mmtier.engines.vllm.names import names_ec_connector, names_kv_connector
from mmtier.errors import ConfigError


@pytest.mark.parametrize("wrap", [dict, lambda **kw: SimpleNamespace(**kw)], ids=["mapping", "object"])
def test_a_config_names_mmtiers_connector_by_class_or_module(wrap):
    assert names_kv_connector(wrap(kv_connector="MMTierConnector"))
    assert names_kv_connector(wrap(kv_connector="Other", kv_connector_module_path="mmtier.engines.vllm.connector"))
    assert not names_kv_connector(wrap(kv_connector="NixlConnector"))
    assert not names_kv_connector(wrap(kv_connector="MMTierECConnector"))
    assert names_ec_connector(wrap(ec_connector="MMTierECConnector"))
    assert names_ec_connector(wrap(ec_connector="X", ec_connector_module_path="mmtier.engines.vllm.ec"))
    assert not names_ec_connector(wrap(ec_connector="ECExampleConnector"))
    assert not names_kv_connector(None) and not names_ec_connector(None)


def test_the_old_module_paths_still_name_mmtiers_connectors():
    """Configs written before the connectors moved to ``mmtier.engines.vllm`` name them by the old
    paths, which still import (``mmtier/integrations/``)."""
    assert names_kv_connector({"kv_connector": "Other", "kv_connector_module_path": "mmtier.integrations.vllm"})
    assert names_ec_connector({"ec_connector": "X", "ec_connector_module_path": "mmtier.integrations.vllm_ec"})


def test_the_router_takes_only_mmtiers_connector_joined_to_a_cluster():
    from mmtier.serve.request_keys import connector_extras

    extra = {"mmtier_cluster": {"namespace": "mmtier"}, "mmtier_tenant": "t"}
    kv, ec = connector_extras({"kv_transfer_config": {"kv_connector_module_path": "mmtier.engines.vllm.connector",
                                                      "kv_connector": "Named", "kv_connector_extra_config": extra},
                               "ec_transfer_config": {"ec_connector": "MMTierECConnector",
                                                      "ec_connector_extra_config": {"a": 1}}})
    assert kv == extra and ec == {"a": 1}
    kv, ec = connector_extras({"kv_transfer_config": {"kv_connector": "MMTierConnector",
                                                      "kv_connector_extra_config": extra},
                               "ec_transfer_config": {"ec_connector": "ECExampleConnector"}})
    assert ec is None
    with pytest.raises(ConfigError, match="mmtier's KV connector"):
        connector_extras({"kv_transfer_config": {"kv_connector": "NixlConnector"}})
    with pytest.raises(ConfigError, match="mmtier_cluster"):
        connector_extras({"kv_transfer_config": {"kv_connector": "MMTierConnector"}})
