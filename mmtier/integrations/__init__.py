"""Engines on top of mmtier: each module imports the engine it serves lazily (an optional extra).

- ``vllm``: the vLLM KV connector (``KVConnectorBase_V1``), ``vllm_ec``: the encoder-cache
  connector (``ECConnectorBase``), ``sglang``: the SGLang HiCache storage backend.
"""
