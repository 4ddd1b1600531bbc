"""A KV connector that does nothing (no hits, no loads, no saves), for the real-engine oracle:
vLLM with a connector in its loop but nothing moved. vLLM's CPU build binds such an engine's
OpenMP threads one core fewer than a plain engine's under its multiprocessing executor (which
moved bf16 logprobs); mmtier's plugin undoes that for mmtier's connector only
(``mmtier.engines.vllm.threads``), so this engine shows what vLLM alone does."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

MODULE = "tests.support.noop_connector"


class NoopConnector(KVConnectorBase_V1, SupportsHMA):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


def transfer_config():
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="NoopConnector", kv_connector_module_path=MODULE, kv_role="kv_both")
