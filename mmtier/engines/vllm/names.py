"""The names a vLLM config gives mmtier's connectors, and the one test of whether a config names
them (a ``KVTransferConfig`` / ``ECTransferConfig`` object, or the mapping a user writes in
``engine_kwargs`` / ``--kv-transfer-config``): by the connector's class name or its module path.
Imports nothing of vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KV_CONNECTOR, KV_MODULE = "MMTierConnector", "mmtier.engines.vllm.connector"
EC_CONNECTOR, EC_MODULE = "MMTierECConnector", "mmtier.engines.vllm.ec"
# the old module paths, still importable (``mmtier/integrations/``), so configs written against them count
KV_MODULES = (KV_MODULE, "mmtier.integrations.vllm")
EC_MODULES = (EC_MODULE, "mmtier.integrations.vllm_ec")


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def names_kv_connector(config: Any) -> bool:
    """Whether a KV transfer config (object or mapping; ``None``: none) names mmtier's KV connector."""
    return config is not None and (_field(config, "kv_connector") == KV_CONNECTOR
                                   or _field(config, "kv_connector_module_path") in KV_MODULES)


def names_ec_connector(config: Any) -> bool:
    """Whether an encoder-cache transfer config names mmtier's encoder-cache connector."""
    return config is not None and (_field(config, "ec_connector") == EC_CONNECTOR
                                   or _field(config, "ec_connector_module_path") in EC_MODULES)
