"""vLLM: ``connector.MMTierConnector`` (the KV connector, ``KVConnectorBase_V1``), a thin class
over its ``scheduler`` side and its ``worker`` side (``meta``: what the one tells the other each
step; ``setup``: what both read from vLLM's config; ``plan`` / ``keys``: a request's groups and
their keys; ``shape``: the cache the engine needs; ``hybrid``: vLLM's hybrid allocator; ``copy``:
the copies between vLLM's KV tensors and the cache); ``ec.MMTierECConnector`` (the encoder-cache
connector); ``plugin`` (vLLM's general plugin, with ``threads``); ``metrics``, ``names`` and
``lookup_channel``. Nothing here is imported eagerly: ``kv_connector_module_path`` names
``mmtier.engines.vllm.connector``, whose import loads vLLM. Inside this package ``import vllm``
is vLLM itself (imports are absolute).
"""
