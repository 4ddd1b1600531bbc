"""Engine integrations: adapters that put an engine's model code on top of ``TieredKVCache``.

Each module imports its engine lazily (an optional extra); nothing in the core imports this
package.

- ``transformers``: the transformers adapter (``pip install mmtier[hf]``): attention function,
  ``Cache``, ``Session``; ``video_frames``: MP4 bytes as Qwen2-VL video inputs (PyAV, no
  torchvision) (mmtier's own chat app built on it is ``mmtier.chat``);
- ``vllm``: the vLLM KV connector (``KVConnectorBase_V1``), ``vllm_ec``: the encoder-cache
  connector (``ECConnectorBase``), ``sglang``: the SGLang HiCache storage backend.
"""
