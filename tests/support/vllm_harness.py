"""Drives mmtier's vLLM connectors with vLLM's own objects (config, factory, Request,
SchedulerOutput), the way vLLM's scheduler and model runner call them, on CPU tensors: an
imitation of an engine, kept only for what a real engine run cannot reach here (the two-node
Ray sharing tests, tensor-parallel refusal, chunk granularity). Real engines are tested in
``tests/engines/test_vllm_engine.py``."""

from __future__ import annotations

import hashlib

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.multimodal.inputs import (
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    MultiModalSharedField,
    PlaceholderRange,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from tests.support.engine_shapes import BS, D, H, L, cache_fields  # noqa: F401  (re-exported to the tests)

NUM_BLOCKS = 24
PROMPT = 41                      # 5 full blocks and one token
IMAGE_AT, IMAGE_LEN = 10, 16     # the image's placeholder positions [10, 26)


def vllm_config(fields: dict, kv_role: str = "kv_both", **extra) -> VllmConfig:
    kv = KVTransferConfig(kv_connector="MMTierConnector", kv_role=kv_role,
                          kv_connector_module_path="mmtier.engines.vllm.connector",
                          kv_connector_extra_config={"mmtier_cache": fields, "mmtier_tenant": "acme",
                                                     **extra})
    cfg = VllmConfig(kv_transfer_config=kv, cache_config=CacheConfig(block_size=BS),
                     device_config=DeviceConfig(device="cpu"),
                     scheduler_config=SchedulerConfig(max_model_len=4096, is_encoder_decoder=False,
                                                      disable_hybrid_kv_cache_manager=True))
    # both roles in this one process, as vLLM's in-process ("uni") executor has them (the CPU
    # platform sets "mp" while the config is built)
    cfg.parallel_config.distributed_executor_backend = "uni"
    return cfg


def connectors(fields: dict, kv_role: str = "kv_both", **extra):
    cfg = vllm_config(fields, kv_role, **extra)
    return (KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None),
            KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, None))


def request(rid: str, *, image="img-A", salt=None, seed=0, change_at=None, extend=0) -> Request:
    """The prompt of ``seed`` (``PROMPT`` tokens, the image at ``IMAGE_AT``), one token changed
    at ``change_at``, ``extend`` more tokens after it (the same ones for every ``extend``: a
    conversation's next turns)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(100, 30000, (PROMPT,), generator=g).tolist()
    tokens += torch.randint(100, 30000, (200,), generator=torch.Generator().manual_seed(seed + 1)).tolist()[:extend]
    if change_at is not None:
        tokens[change_at] += 1
    tokens[IMAGE_AT:IMAGE_AT + IMAGE_LEN] = [32000] * IMAGE_LEN     # placeholder tokens
    mm = [MultiModalFeatureSpec(data=image_inputs(image), modality="image", identifier=image,
                                mm_position=PlaceholderRange(offset=IMAGE_AT, length=IMAGE_LEN))]
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, mm_features=mm, cache_salt=salt)


def image_inputs(image: str) -> MultiModalKwargsItem:
    """The processed inputs of the image named ``image`` (pixels drawn from its name)."""
    seed = int.from_bytes(hashlib.sha256(image.encode()).digest()[:4], "little")
    pixels = torch.randn(16, 12, generator=torch.Generator().manual_seed(seed))
    return MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(
        data=pixels, field=MultiModalSharedField(batch_size=1))})


def paged(seed=None) -> dict[str, torch.Tensor]:
    """vLLM's standardized per-layer views [blocks, heads, block_size, 2*head_dim], physically
    block-then-token-major (LBNHC), poisoned with NaN or filled with random values."""
    out = {}
    for i in range(L):
        phys = torch.full((NUM_BLOCKS, BS, H, 2 * D), float("nan"))
        if seed is not None:
            phys.copy_(torch.randn(phys.shape, generator=torch.Generator().manual_seed(seed + i)))
        out[f"model.layers.{i}.self_attn.attn"] = phys.transpose(1, 2)
    return out


def step(sched, worker, req: Request, block_ids: list[int], kv: dict[str, torch.Tensor], *,
         wait_saves: bool = True) -> int:
    """One prefill step of ``req``: ask for the hit, allocate, build and run the metadata.
    Returns the hit (tokens vLLM would not compute). ``wait_saves=False``: return right after
    ``wait_for_save``, the writer thread's puts still running (as vLLM's model runner does)."""
    hit, is_async = ask(sched, req)
    sched.update_state_after_alloc(req, None, hit)
    new = NewRequestData(req.request_id, req.prompt_token_ids, req.mm_features, req.sampling_params,
                         None, (list(block_ids),), hit, None)
    out = SchedulerOutput(
        scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={req.request_id: req.num_prompt_tokens - hit},
        total_num_scheduled_tokens=req.num_prompt_tokens - hit,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[])
    worker.bind_connector_metadata(sched.build_connector_meta(out))
    if not worker._layers:
        worker.register_kv_caches(kv)
    worker.start_load_kv(None)
    for name, layer in kv.items():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, layer, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    if wait_saves:
        worker.wait_for_saves()        # the writer thread's puts (vLLM itself does not wait)
    return hit


def ask(sched, req: Request, computed: int = 0) -> tuple[int, bool]:
    """``get_num_new_matched_tokens`` as vLLM's scheduler calls it: ``None`` (a cluster pull in
    flight) means "ask again at a later step", which comes once the pull is done."""
    hit, is_async = sched.get_num_new_matched_tokens(req, computed)
    if hit is None:
        sched.link.wait()
        hit, is_async = sched.get_num_new_matched_tokens(req, computed)
    assert hit is not None and is_async is False
    return hit, is_async


def slots_of(block_ids: list[int], n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return torch.tensor(block_ids)[pos // BS] * BS + pos % BS


def tokens_kv(kv: dict[str, torch.Tensor], block_ids: list[int], n: int) -> torch.Tensor:
    """[layers, n, heads, 2*head_dim]: what the paged tensors hold for positions [0, n)."""
    slots = slots_of(block_ids, n)
    return torch.stack([t.transpose(1, 2).reshape(-1, H, 2 * D)[slots] for t in kv.values()])
