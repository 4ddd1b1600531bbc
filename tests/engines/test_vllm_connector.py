"""mmtier's vLLM KV connector, driven by vLLM's own factory, config, Request and SchedulerOutput
(``tests/support/vllm_harness.py``), for what a real engine run cannot reach here: the chunk
granularity of text groups, the refusal of tensor-parallel engines, and cache_salt tenants.
Everything an engine does (saves from real block tables, loads, preemption, restart from disk,
corrupt groups, the multiprocessing split) is tested in real engines: ``test_vllm_engine.py``.

Needs vLLM importable (the engines environment, ``tests/support/engines_env.sh``); skipped with the
reason otherwise."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="vLLM is not importable: run ./run engines (.venv-engines: vLLM's CPU build here); ./run test then runs this file there")

from mmtier.engines.connector_cache import close_shared  # noqa: E402
from mmtier.engines.vllm import copy as h_copy  # noqa: E402
from tests.support import vllm_harness as h  # noqa: E402


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


def test_a_tensor_parallel_engine_with_mmtier_cluster_is_refused_before_anything_opens(tmp_path):
    """Tensor-parallel engines run (tests/engines/test_vllm_parallel.py); with ``mmtier_cluster`` each
    worker's shard keys would have to reach the registry, which is not built: refused with both
    fields named, before a cache or a cluster connection is opened."""
    from vllm.config import ParallelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from mmtier.engines.vllm.connector import MMTierConnector
    from mmtier.errors import ConfigError

    spill = tmp_path / "spill"
    cfg = h.vllm_config(h.cache_fields(spill), mmtier_cluster={"namespace": "nowhere"})
    cfg.parallel_config = ParallelConfig(tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="mmtier_cluster") as info:
        MMTierConnector(cfg, KVConnectorRole.SCHEDULER, None)
    assert info.value.fields == ("mmtier_cluster", "tensor_parallel_size")
    assert not spill.exists() or not any(spill.iterdir())       # nothing opened, nothing written
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


def test_a_conversations_next_turns_hit_up_to_the_last_prompts_full_blocks_in_large_chunks(tmp_path):
    """Chunks of 16 blocks: the last prompt's full blocks ended inside one, which the next turn's
    whole chunk misses; the connector follows the part the last turn stored (``vllm.plan``'s
    forks) and loads every full block of it. Turn 1 [0, 40) of 41 tokens; turn 2 (61 tokens)
    hits 40, not 24; turn 3 (76) hits 56 through both turns' parts; the bytes are the saved ones."""
    sched, worker = h.connectors(h.cache_fields(tmp_path / "spill"), mmtier_chunk_blocks=16)
    try:
        kv = h.paged(seed=3)
        blocks = torch.randperm(h.NUM_BLOCKS, generator=torch.Generator().manual_seed(7)).tolist()
        b1, b2, b3 = blocks[:6], blocks[6:14], blocks[14:24]
        assert h.step(sched, worker, h.request("t1"), b1, kv) == 0
        turn1 = h.tokens_kv(kv, b1, 40)
        assert h.step(sched, worker, h.request("t2", extend=20), b2, kv) == 40
        assert torch.equal(h.tokens_kv(kv, b2, 40), turn1)          # loaded: turn 1's bytes
        turn2 = h.tokens_kv(kv, b2, 56)
        for t in kv.values():                                       # the third turn's blocks poisoned
            t[b3] = float("nan")
        assert h.step(sched, worker, h.request("t3", extend=35), b3, kv) == 56
        assert torch.equal(h.tokens_kv(kv, b3, 56), turn2)
        # a turn whose earlier text differs inside the part finds no fork: its prefix's blocks only
        assert sched.get_num_new_matched_tokens(h.request("t4", extend=35, change_at=35), 0) == (24, False)
    finally:
        worker.shutdown()
        close_shared()


@pytest.mark.parametrize("chunk_blocks", [1, 16])
def test_a_hit_loads_the_saved_bytes_into_other_blocks(tmp_path, chunk_blocks):
    """A prompt saved from one set of shuffled blocks, then asked again on other blocks, poisoned:
    the load writes there the very bytes saved, for every full block, every layer, K and V: by
    ``read_group`` straight into vLLM's blocks (block groups: each loaded whole) and through a
    stage (a chunk's group, of which the prompt holds only part)."""
    sched, worker = h.connectors(h.cache_fields(tmp_path / "spill"), mmtier_chunk_blocks=chunk_blocks)
    try:
        kv = h.paged(seed=3)
        first = shuffled_blocks(4)
        second = [b for b in shuffled_blocks(5, h.NUM_BLOCKS) if b not in first][:6]
        assert h.step(sched, worker, h.request("r1"), first, kv) == 0
        want = h.tokens_kv(kv, first, 40)
        for t in kv.values():                              # the second request's blocks poisoned
            t[second] = float("nan")
        assert h.step(sched, worker, h.request("r2"), second, kv) == 40
        assert torch.equal(h.tokens_kv(kv, second, 40), want)
    finally:
        worker.shutdown()
        close_shared()


def test_a_cpu_save_reads_vllms_blocks_once_and_the_next_step_waits_for_it(tmp_path):
    """Whole-block groups on the CPU are saved straight from vLLM's blocks by the writer thread
    (no stage); the next step's ``start_load_kv`` returns only once those puts are done, so the
    blocks may be reused from then on: poisoned after it, the saved bytes still load intact."""
    sched, worker = h.connectors(h.cache_fields(tmp_path / "spill"), mmtier_chunk_blocks=1)
    try:
        kv = h.paged(seed=5)
        first = [3, 17, 8, 1, 22, 12]
        assert h.step(sched, worker, h.request("r1"), first, kv, wait_saves=False) == 0
        assert worker._reading_blocks, "the save did not take the direct path"
        pending = list(worker._reading_blocks)
        worker.bind_connector_metadata(type(sched.build_connector_meta(
            _empty_output()))())                           # the next step, nothing to load
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        assert all(f.done() for f in pending) and not worker._reading_blocks
        _reloads_intact(sched, worker, kv, first)
    finally:
        worker.shutdown()
        close_shared()


def _reloads_intact(sched, worker, kv, first) -> None:
    """vLLM reuses (poisons) every block; a second request sharing ``first``'s 40 cached tokens
    then loads exactly the bytes the first one computed."""
    want = h.tokens_kv(kv, first, 40)
    for t in kv.values():
        t.fill_(float("nan"))
    second = [9, 4, 20, 15, 6, 0]
    assert h.step(sched, worker, h.request("r2"), second, kv) == 40
    assert torch.equal(h.tokens_kv(kv, second, 40), want)


def test_a_cpu_save_of_parts_of_blocks_copies_nothing_in_the_forward(tmp_path):
    """Groups that are not whole blocks of vLLM's (the image's, a chunk's part) are copied out of
    vLLM's blocks by the writer thread after the forward, not in ``save_kv_layer``; the next
    step's ``handle_preemptions`` returns only once that is done: poisoned after it, the saved
    bytes still load intact."""
    sched, worker = h.connectors(h.cache_fields(tmp_path / "spill"), mmtier_chunk_blocks=16)
    try:
        kv = h.paged(seed=7)
        first = [3, 17, 8, 1, 22, 12]
        copies = []
        gather, copy_blocks = h_copy.gather, h_copy.copy_blocks
        h_copy.gather = lambda *a, **k: copies.append(threading.current_thread().name) or gather(*a, **k)
        h_copy.copy_blocks = lambda *a, **k: copies.append(threading.current_thread().name) or copy_blocks(*a, **k)
        try:
            assert h.step(sched, worker, h.request("r1"), first, kv, wait_saves=False) == 0
            pending = list(worker._reading_blocks)
            assert pending, "the saves did not read vLLM's blocks after the forward"
            worker.handle_preemptions(None)               # the next step begins
            assert all(f.done() for f in pending) and not worker._reading_blocks
        finally:
            h_copy.gather, h_copy.copy_blocks = gather, copy_blocks
        assert copies and all(name.startswith("mmtier-save") for name in copies)
        _reloads_intact(sched, worker, kv, first)
    finally:
        worker.shutdown()
        close_shared()


def test_a_save_with_a_nan_in_vllms_blocks_stores_nothing(tmp_path):
    """The copy out of vLLM's blocks tests what it moves: a NaN in one block's K makes the save
    of its group a skipped put (logged), never a stored group, and the engine goes on."""
    sched, worker = h.connectors(h.cache_fields(tmp_path / "spill"), mmtier_chunk_blocks=1)
    try:
        kv = h.paged(seed=6)
        blocks = [2, 11, 5, 19, 7, 13]
        layer = next(iter(kv.values()))
        layer[blocks[1], 1, 3, 7] = float("nan")          # block 1, head 1, its 4th position, layer 0, K
        assert h.step(sched, worker, h.request("r1"), blocks, kv) == 0
        # blocks 0 and 1's groups chain: block 0 is held, block 1 (and what follows it) is not
        assert sched.get_num_new_matched_tokens(h.request("r2"), 0) == (8, False)
    finally:
        worker.shutdown()
        close_shared()


def _empty_output():
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids=set(), free_encoder_mm_hashes=[])
