"""Old path, kept for configs written against it (``kv_connector_module_path:
mmtier.integrations.vllm``, ``ec_connector_module_path: mmtier.integrations.vllm_ec``, SGLang's
``module_path: mmtier.integrations.sglang``, the vLLM plugin's entry point of an older install,
``from mmtier.integrations import transformers as mt``); the code lives in ``mmtier.engines``.
Each module here is one import line."""
