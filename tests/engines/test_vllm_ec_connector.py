"""mmtier's vLLM encoder-cache connector through vLLM's factory: encoder outputs saved by one
instance are found and loaded by another, per tenant, keyed by the item's processed inputs (never
by vLLM's identifier alone, which a client may choose); a corrupt copy fails its request.
``tests/engines/test_vllm_engine_mm.py`` runs the same in real engines."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.distributed.ec_transfer.ec_connector.base",
                    reason="vLLM is not importable: run ./run engines (.venv-engines: a real vLLM engine, its CPU build here, and SGLang); ./run test then runs this file there")

from vllm.config import DeviceConfig, ECTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402
from vllm.multimodal.inputs import (  # noqa: E402
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    MultiModalSharedField,
    PlaceholderRange,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from mmtier.core.groups import Tier  # noqa: E402
from mmtier.engines.connector_cache import close_shared  # noqa: E402
from tests.support import vllm_harness as h  # noqa: E402

WIDTH = 24


def fields(tmp_path, device_pages=64):
    embed, text = device_pages * 16 * WIDTH * 4, 2 * (2 * 16 * 16 * 4 + 256)   # text: 2 pages (a pool
    share = embed / (embed + text)                                              # of none is refused)
    return dict(model="tiny-ec", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float32",
                modalities={"text": {"page_size": 16, "share": 1 - share},
                            "vision_embed": {"kind": "embedding", "width": WIDTH, "page_size": 16,
                                             "share": share}},
                device="cpu", device_bytes=embed + text + 64, host_bytes=0,
                disk_dir=str(tmp_path / "spill"), disk_bytes=64 << 20, disk_free_floor_bytes=0)


def connector(f, role, tenant="acme"):
    ec = ECTransferConfig(ec_connector="MMTierECConnector", ec_role="ec_both",
                          ec_connector_module_path="mmtier.engines.vllm.ec",
                          ec_connector_extra_config={"mmtier_cache": f, "mmtier_tenant": tenant})
    cfg = VllmConfig(ec_transfer_config=ec, device_config=DeviceConfig(device="cpu"))
    cfg.parallel_config.distributed_executor_backend = "uni"   # both roles in this process
    return ECConnectorFactory.create_connector(cfg, role)


@pytest.fixture
def roles(tmp_path):
    f = fields(tmp_path)
    yield connector(f, ECConnectorRole.SCHEDULER), connector(f, ECConnectorRole.WORKER), f
    close_shared()


def pixels(seed: int) -> torch.Tensor:
    return torch.randn(3, 28, 28, generator=torch.Generator().manual_seed(seed))


def request(rid: str, identifier: str, picture: torch.Tensor | None, salt: str | None = None) -> Request:
    """A request with one image item: vLLM's identifier, and its processed inputs (``None``:
    the scheduler was not given them); ``salt``: its ``cache_salt`` (the tenant's)."""
    data = None if picture is None else MultiModalKwargsItem(
        {"pixel_values": MultiModalFieldElem(data=picture, field=MultiModalSharedField(batch_size=1))})
    tokens = list(range(100, 100 + h.PROMPT))
    mm = [MultiModalFeatureSpec(data=data, modality="image", identifier=identifier,
                                mm_position=PlaceholderRange(offset=h.IMAGE_AT, length=h.IMAGE_LEN))]
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, mm_features=mm, cache_salt=salt)


def schedule(sched, req) -> tuple[bool, object]:
    """vLLM's calls for one item: ``ensure_cache_available``, ``has_cache_item`` (held: vLLM
    loads it, else runs the encoder), ``update_state_after_alloc``, then the step's metadata."""
    assert sched.ensure_cache_available(req, 0)
    held = sched.has_cache_item(req.mm_features[0].identifier)
    sched.update_state_after_alloc(req, 0)
    return held, sched.build_connector_meta(None)


def run(sched, worker, req, encoder_cache, computed=None) -> bool:
    """One step: scheduled, the worker loads what is listed or saves what the encoder computed
    (``computed``), the worker's report goes back. Returns whether vLLM would load it."""
    held, meta = schedule(sched, req)
    worker.bind_connector_metadata(meta)
    worker.start_load_caches(encoder_cache)
    if not held and computed is not None:
        ident = req.mm_features[0].identifier
        encoder_cache[ident] = computed
        worker.save_caches(encoder_cache, ident)
    worker.clear_connector_metadata()
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=worker.build_connector_worker_meta()))
    sched.request_finished(req)
    return held


def test_encoder_outputs_round_trip_between_instances_keyed_by_content(roles):
    sched, worker, f = roles
    assert type(worker).__module__ == "mmtier.engines.vllm.ec"
    x = torch.randn(h.IMAGE_LEN, WIDTH)
    assert not run(sched, worker, request("r1", "img-A", pixels(1)), {}, computed=x)
    encoder_cache = {}
    # the same pixels under another identifier (another uuid, another instance's hash): loaded
    assert run(sched, worker, request("r2", "other-id", pixels(1)), encoder_cache)
    assert torch.equal(encoder_cache["other-id"], x)
    assert sched.take_unavailable_requests() == set()
    other = connector(f, ECConnectorRole.SCHEDULER, tenant="other")
    assert not schedule(other, request("r3", "img-A", pixels(1)))[0]


def test_each_cache_salt_is_a_scope_of_its_own_and_no_salt_is_the_server_tenants(roles):
    """Two tenants (two ``cache_salt``s, as the Serve ingress sets them) send the same picture:
    each one's encoder runs once and saves under its own key; the same salt hits again on
    another identifier; a request without a salt is the server tenant's, apart from both. The
    worker saves and loads under the keys the scheduler sent (the metadata carries the scope)."""
    sched, worker, _ = roles
    xa, xb, xn = (torch.randn(h.IMAGE_LEN, WIDTH) for _ in range(3))
    assert not run(sched, worker, request("a1", "img", pixels(1), salt="salt-a"), {}, computed=xa)
    assert not run(sched, worker, request("b1", "img", pixels(1), salt="salt-b"), {}, computed=xb)
    assert not run(sched, worker, request("n1", "img", pixels(1)), {}, computed=xn)
    got = {}
    for rid, salt in (("a2", "salt-a"), ("b2", "salt-b"), ("n2", None)):
        cache = {}
        assert run(sched, worker, request(rid, f"id-{rid}", pixels(1), salt=salt), cache)
        got[salt] = cache[f"id-{rid}"]
    assert torch.equal(got["salt-a"], xa) and torch.equal(got["salt-b"], xb) and torch.equal(got[None], xn)
    assert not schedule(sched, request("c1", "img", pixels(1), salt="salt-c"))[0]    # a third: nothing
    keys = {s: sched.item_key(r, r.mm_features[0]) for s, r in
            (("a", request("k", "img", pixels(1), salt="salt-a")), ("b", request("k", "img", pixels(1), salt="salt-b")),
             ("n", request("k", "img", pixels(1))))}
    assert len({*keys.values()}) == 3 and len({k.scope for k in keys.values()}) == 3
    assert worker.cache.stats().by_modality["vision_embed"]["puts"] == 3


def test_two_images_under_one_identifier_never_share_an_encoder_output(roles):
    """A client's uuid names image A, then image B: B's encoder runs (vLLM's identifier, which
    the old key was made of, is the same)."""
    sched, worker, _ = roles
    run(sched, worker, request("r1", "u", pixels(1)), {}, computed=torch.randn(h.IMAGE_LEN, WIDTH))
    assert not schedule(sched, request("r2", "u", pixels(2)))[0]
    assert not sched.has_cache_item("u")      # nor for a request it has not seen


def test_an_item_without_its_inputs_is_neither_loaded_nor_saved(roles):
    sched, worker, _ = roles
    assert not run(sched, worker, request("r1", "img-A", None), {}, computed=torch.randn(h.IMAGE_LEN, WIDTH))
    assert worker.cache.stats().by_modality.get("vision_embed", {}).get("puts", 0) == 0
    assert not schedule(sched, request("r2", "img-A", None))[0]


def test_an_answer_for_other_content_fails_the_request_never_a_wrong_output(roles):
    """vLLM asked ``has_cache_item`` for one request's item and allocates another request's
    item of the same identifier and other content: that request fails (vLLM would not run its
    encoder, and the stored output is another image's)."""
    sched, worker, _ = roles
    run(sched, worker, request("r1", "u", pixels(1)), {}, computed=torch.randn(h.IMAGE_LEN, WIDTH))
    assert sched.ensure_cache_available(request("r2", "u", pixels(1)), 0)
    assert sched.has_cache_item("u")
    sched.update_state_after_alloc(request("r3", "u", pixels(2)), 0)
    assert sched.build_connector_meta(None).loads == {}
    assert sched.take_unavailable_requests() == {"r3"}


def test_a_corrupt_copy_fails_the_request_never_wrong_outputs(tmp_path):
    f = fields(tmp_path, device_pages=2)
    sched, worker = connector(f, ECConnectorRole.SCHEDULER), connector(f, ECConnectorRole.WORKER)
    try:
        run(sched, worker, request("r0", "img-A", pixels(1)), {}, computed=torch.randn(h.IMAGE_LEN, WIDTH))
        for i in range(4):                      # push img-A down to disk
            run(sched, worker, request(f"f{i}", f"f{i}", pixels(10 + i)), {}, computed=torch.randn(16, WIDTH))
        probe = request("probe", "img-A", pixels(1))
        key = worker.item_key(probe, probe.mm_features[0])
        worker.cache.flush()
        assert worker.cache.index.groups[key].tier == Tier.DISK
        path = next((tmp_path / "spill").glob(f"vision_embed-{key.hex}*.arrow"))
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
        encoder_cache = {}
        assert run(sched, worker, request("r1", "img-A", pixels(1)), encoder_cache)
        assert "img-A" not in encoder_cache
        assert sched.take_unavailable_requests() == {"r1"}
        assert not schedule(sched, request("r2", "img-A", pixels(1)))[0]
    finally:
        close_shared()
