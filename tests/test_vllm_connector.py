"""mmtier's vLLM KV connector, driven by vLLM's own factory, config, Request and SchedulerOutput.

Needs vLLM importable (the optional engines environment, ``tests/engines_env.sh``); skipped with
the reason otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="vLLM is not importable: run ./run engines (an overlay venv with vLLM and SGLang, no CUDA); ./run test then runs this file there")

from mmtier.groups import Tier  # noqa: E402
from mmtier.integrations.engine_cache import close_shared  # noqa: E402
from tests import vllm_harness as h  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def pair(tmp_path):
    sched, worker = h.connectors(h.cache_fields(tmp_path / "spill"))
    yield sched, worker
    worker.shutdown()
    close_shared()


@pytest.mark.parametrize(("chunk_blocks", "expect"), [(1, 32), (16, 24)])
def test_a_changed_token_hits_up_to_its_block_or_its_chunk(tmp_path, chunk_blocks, expect):
    sched, worker = h.connectors(h.cache_fields(tmp_path / "spill"), mmtier_chunk_blocks=chunk_blocks)
    try:
        h.step(sched, worker, h.request("r1"), shuffled_blocks(1), h.paged(seed=1))
        # token 35 differs: block-sized groups keep [26, 32); one chunk [26, 40) is lost whole
        assert sched.get_num_new_matched_tokens(h.request("r2", change_at=35), 0) == (expect, False)
    finally:
        worker.shutdown()
        close_shared()


def shuffled_blocks(seed: int, n: int = 6) -> list[int]:
    return torch.randperm(h.NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def test_factory_loads_the_connector_and_both_roles_share_the_embedded_cache(pair):
    sched, worker = pair
    assert type(sched).__module__ == "mmtier.integrations.vllm"
    assert sched.cache is worker.cache


def test_tensor_parallel_engines_are_refused_not_silently_mixed(tmp_path):
    from vllm.config import ParallelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from mmtier.errors import ConfigError
    from mmtier.integrations.vllm import MMTierConnector

    cfg = h.vllm_config(h.cache_fields(tmp_path / "spill"))
    cfg.parallel_config = ParallelConfig(tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        MMTierConnector(cfg, KVConnectorRole.WORKER, None)
    close_shared()


def test_hits_by_full_blocks_per_prefix_image_and_salt(pair):
    sched, worker = pair
    src = h.paged(seed=1)
    assert h.step(sched, worker, h.request("r1"), shuffled_blocks(1), src) == 0
    # same prefix + image: every full block (40 of 41 tokens; the last one vLLM computes)
    assert sched.get_num_new_matched_tokens(h.request("r2"), 0) == (40, False)
    assert sched.get_num_new_matched_tokens(h.request("r2b"), 16) == (24, False)
    # another tenant (cache_salt): nothing
    assert sched.get_num_new_matched_tokens(h.request("r3", salt="other"), 0) == (0, False)
    # another image after the same prefix: only the prefix's full block ([0, 8) of [0, 10))
    assert sched.get_num_new_matched_tokens(h.request("r4", image="img-B"), 0) == (8, False)
    # another prompt altogether: nothing
    assert sched.get_num_new_matched_tokens(h.request("r5", seed=9), 0) == (0, False)


def test_save_with_shuffled_slots_then_load_into_a_fresh_tensor_restores_the_bytes(pair):
    sched, worker = pair
    blocks_a, blocks_b = shuffled_blocks(2), shuffled_blocks(3)
    src = h.paged(seed=5)
    assert h.step(sched, worker, h.request("a"), blocks_a, src) == 0
    dst = h.paged()                                   # NaN-poisoned
    worker._layers, worker._layer_index = {}, {}
    assert h.step(sched, worker, h.request("b"), blocks_b, dst) == 40
    assert worker.get_block_ids_with_load_errors() == set()
    assert torch.equal(h.tokens_kv(dst, blocks_b, 40), h.tokens_kv(src, blocks_a, 40))
    untouched = h.tokens_kv(dst, blocks_b, 41)[:, 40]  # the last token is vLLM's to compute
    assert torch.isnan(untouched).all()


def _fill_device(cache, n: int) -> None:
    """Unrelated groups that push everything the connector saved down to disk."""
    for i in range(n):
        for modality, size in (("text", h.BS), ("vision", 16)):
            key = cache.content_key(modality, f"filler-{i}".encode())
            cache.put(key, torch.randn(h.L, size, h.H, h.D), torch.randn(h.L, size, h.H, h.D))
    cache.flush()


def _save_to_disk(disk_dir: Path, seed: int) -> tuple[list, torch.Tensor]:
    """Save a request's KV, push every group it made down to disk, close the process's cache."""
    sched, worker = h.connectors(h.cache_fields(disk_dir, device_pages=8))
    blocks = shuffled_blocks(seed)
    src = h.paged(seed=seed)
    h.step(sched, worker, h.request("first", seed=seed), blocks, src)
    saved = [seg.key for seg in sched._plan(h.request("probe", seed=seed)).plan.segments]
    _fill_device(worker.cache, 8)
    assert {worker.cache._groups[k].tier for k in saved} == {Tier.DISK}
    worker.shutdown()
    close_shared()
    return saved, h.tokens_kv(src, blocks, 40)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """Two directories, one left intact and one with the image's file corrupted, each opened
    and loaded from by one new process (``python -m tests.vllm_harness``)."""
    root = tmp_path_factory.mktemp("restart")
    cases = {"clean": (root / "clean", 11), "corrupt": (root / "corrupt", 12)}
    expect = {}
    for name, (disk_dir, seed) in cases.items():
        saved, expect[name] = _save_to_disk(disk_dir, seed)
        if name == "corrupt":
            image = next(k for k in saved if k.modality == "vision")      # positions [10, 26)
            path = next(disk_dir.glob(f"vision-{image.hex}*.arrow"))
            raw = bytearray(path.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            path.write_bytes(bytes(raw))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    args = [a for d, seed in cases.values() for a in (str(d), str(seed))]
    done = subprocess.run([sys.executable, "-m", "tests.vllm_harness", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    got = {name: next(g for g in lines if g["dir"] == str(d)) for name, (d, _) in cases.items()}
    return {name: (got[name], expect[name]) for name in cases}


def test_load_after_groups_went_to_disk_in_a_new_process(restarted):
    got, expect = restarted["clean"]
    assert got["hit"] == 40 and got["failed"] == []
    assert got["ray_imported"] is False            # without mmtier_cluster the path never imports Ray
    assert torch.equal(torch.tensor(got["values"]).reshape(expect.shape), expect)


def test_a_corrupt_file_fails_the_load_and_is_reported_never_wrong_bytes(restarted):
    got, expect = restarted["corrupt"]
    blocks = h.LOADER_BLOCKS
    assert got["hit"] == 40
    assert set(got["failed"]) == {blocks[1], blocks[2], blocks[3]}     # positions [10, 26)
    values = torch.tensor(got["values"]).reshape(expect.shape)
    bad = torch.isnan(values).all(dim=(0, 2, 3))
    assert bad[10:26].all() and not bad[:10].any() and not bad[26:].any()
    assert torch.equal(values[:, :10], expect[:, :10]) and torch.equal(values[:, 26:], expect[:, 26:])
