"""Engines: adapters that put an engine's model code on top of ``TieredKVCache``.

Each module imports its engine lazily (an optional extra); nothing in the core imports this
package. mmtier's own chat app, built on the transformers adapter, is ``mmtier.chat``.

- ``vllm/``: the vLLM KV connector (``vllm.connector.MMTierConnector``, a thin class over its
  ``scheduler`` and ``worker`` sides), the encoder-cache connector (``vllm.ec``), the vLLM
  plugin (``vllm.plugin``) and the lookup channel between a scheduler and its worker;
- ``sglang``: the SGLang HiCache storage backend;
- ``connector_cache``: the cache an engine process embeds, shared by vLLM's and SGLang's
  connectors;
- ``transformers/``: the transformers adapter (``pip install mmtier[hf]``): attention function,
  ``Cache``, ``Session``; ``video_frames``: MP4 bytes as Qwen2-VL video inputs (PyAV, no
  torchvision).
"""
