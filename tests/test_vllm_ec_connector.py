"""mmtier's vLLM encoder-cache connector through vLLM's factory: encoder outputs saved by one
instance are found and loaded by another, per tenant; a corrupt copy fails its request."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.distributed.ec_transfer.ec_connector.base",
                    reason="vLLM is not importable: run ./run engines (an overlay venv with vLLM and SGLang, no CUDA); ./run test then runs this file there")

from vllm.config import DeviceConfig, ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402

from mmtier.groups import Tier  # noqa: E402
from mmtier.integrations.engine_cache import close_shared  # noqa: E402
from tests import vllm_harness as h  # noqa: E402

WIDTH = 24


def fields(tmp_path, device_pages=64):
    return dict(model="tiny-ec", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float32",
                modalities={"text": {"page_size": 16, "share": 0.25},
                            "vision_embed": {"kind": "embedding", "width": WIDTH, "page_size": 16,
                                             "share": 0.75}},
                device="cpu", device_bytes=device_pages * 16 * WIDTH * 4 * 4 // 3, host_bytes=0,
                disk_dir=str(tmp_path / "spill"), disk_bytes=64 << 20, disk_free_floor_bytes=0)


def connector(f, role, tenant="acme"):
    ec = ECTransferConfig(ec_connector="MMTierECConnector", ec_role="ec_both",
                          ec_connector_module_path="mmtier.integrations.vllm_ec",
                          ec_connector_extra_config={"mmtier_cache": f, "mmtier_tenant": tenant})
    cfg = VllmConfig(ec_transfer_config=ec, device_config=DeviceConfig(device="cpu"))
    return ECConnectorFactory.create_connector(cfg, role)


@pytest.fixture
def roles(tmp_path):
    f = fields(tmp_path)
    yield connector(f, ECConnectorRole.SCHEDULER), connector(f, ECConnectorRole.WORKER), f
    close_shared()


def load(sched, worker, req, encoder_cache):
    for i in range(len(req.mm_features)):
        sched.update_state_after_alloc(req, i)
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    worker.start_load_caches(encoder_cache)
    worker.clear_connector_metadata()
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=worker.build_connector_worker_meta()))


def test_encoder_outputs_round_trip_between_instances(roles):
    sched, worker, f = roles
    assert type(worker).__module__ == "mmtier.integrations.vllm_ec"
    x = torch.randn(h.IMAGE_LEN, WIDTH)
    assert not sched.has_cache_item("img-A")
    worker.save_caches({"img-A": x}, "img-A")
    assert sched.has_cache_item("img-A") and not sched.has_cache_item("img-B")
    assert not connector(f, ECConnectorRole.SCHEDULER, tenant="other").has_cache_item("img-A")
    encoder_cache = {}
    load(sched, worker, h.request("r1"), encoder_cache)
    assert torch.equal(encoder_cache["img-A"], x)
    assert sched.take_unavailable_requests() == set()


def test_a_corrupt_copy_fails_the_request_never_wrong_outputs(tmp_path):
    f = fields(tmp_path, device_pages=2)
    sched, worker = connector(f, ECConnectorRole.SCHEDULER), connector(f, ECConnectorRole.WORKER)
    try:
        worker.save_caches({"img-A": torch.randn(h.IMAGE_LEN, WIDTH)}, "img-A")
        for i in range(4):                      # push img-A down to disk
            worker.save_caches({f"f{i}": torch.randn(16, WIDTH)}, f"f{i}")
        key = worker.key("img-A")
        worker.cache.flush()
        assert worker.cache._groups[key].tier == Tier.DISK
        path = next((tmp_path / "spill").glob(f"vision_embed-{key.hex}*.arrow"))
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
        encoder_cache = {}
        load(sched, worker, h.request("r1"), encoder_cache)
        assert "img-A" not in encoder_cache
        assert sched.take_unavailable_requests() == {"r1"}
        assert not sched.has_cache_item("img-A")
    finally:
        close_shared()
