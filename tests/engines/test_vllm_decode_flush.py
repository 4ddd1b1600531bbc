"""The connector's decode saves step by step, driven with vLLM's own objects (``Request``,
``SchedulerOutput``; ``tests/support/vllm_harness.py``) where a real engine cannot be steered:
a whole chunk of generated tokens is flushed once its last block's KV is written, the last part
when vLLM preempts the request (its blocks handed to another request in that very step: read
before the step goes on) or aborts it (read at the next step), nothing is found before its copy
is stored, and a next turn repeating prompt and answer hits them through its forks and loads
KV bit-equal to what the engine's blocks held. Real engines: ``test_vllm_decode_saves.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.request", reason="no vLLM here: run ./run engines")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from tests.support import vllm_harness as h  # noqa: E402

CHUNK = 2 * h.BS                    # mmtier_chunk_blocks 2: chunks of 16 positions


def text_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=1000), None)


def output(req: Request | None, computed: int, *, preempted=()) -> SchedulerOutput:
    """A step that schedules one more token of ``req`` (computed positions ``computed``)."""
    ids = [req.request_id] if req is not None else []
    cached = CachedRequestData(req_ids=ids, resumed_req_ids=set(), new_token_ids=[[] for _ in ids],
                               all_token_ids={}, new_block_ids=[None for _ in ids],
                               num_computed_tokens=[computed for _ in ids],
                               num_output_tokens=[1 for _ in ids])
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={i: 1 for i in ids}, total_num_scheduled_tokens=len(ids),
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
                           free_encoder_mm_hashes=[], preempted_req_ids=set(preempted))


def run(sched, worker, out: SchedulerOutput, kv):
    """One step as vLLM's model runner calls the worker side; returns the step's metadata."""
    meta = sched.build_connector_meta(out)
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name, layer in kv.items():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, layer, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return meta


def decode(sched, worker, req: Request, kv, until: int) -> list:
    """Decode steps until positions [0, until) have KV; the metadata of each step."""
    metas = []
    for computed in range(req.num_computed_tokens, until):
        req.append_output_token_ids(1000 + computed)       # the token this step computes
        metas.append(run(sched, worker, output(req, computed), kv))
        req.num_computed_tokens = computed + 1
    return metas


def next_turn(req: Request, end: int, rid: str) -> Request:
    return text_request(rid, list(req.all_token_ids[:end]) + list(range(2000, 2007)))


@pytest.fixture
def sides(tmp_path):
    sched, worker = h.connectors(h.cache_fields(tmp_path / "spill"), mmtier_chunk_blocks=2)
    yield sched, worker
    worker.wait_for_saves()
    sched.shutdown()
    worker.shutdown()


def test_a_whole_chunk_as_it_fills_and_the_last_part_when_vllm_preempts(sides):
    sched, worker = sides
    kv = h.paged(seed=11)
    blocks = list(range(8))
    req = text_request("r", range(100, 127))                # 27 tokens: whole blocks end at 24
    assert h.step(sched, worker, req, blocks, kv) == 0       # the prompt: [0, 16), [16, 24)
    req.num_computed_tokens = 27
    metas = decode(sched, worker, req, kv, 45)
    flushed = [(op.start, op.end) for m in metas for op in m.flushes]
    # [24, 32) ends on a chunk boundary: flushed at the step after position 31's KV was written
    assert flushed == [(24, 32)] and metas[32 - 27].flushes and not any(m.flush_wait for m in metas)
    worker.wait_for_saves()
    want = h.tokens_kv(kv, blocks, 40).clone()
    # preempted: its blocks are freed and block 4 (positions 32-39) goes to another request
    out = output(None, 0, preempted={"r"})
    out.scheduled_new_reqs = [NewRequestData("other", [1] * 8, [], SamplingParams(max_tokens=1), None,
                                             ([4],), 0, None)]
    meta = sched.build_connector_meta(out)
    assert [(op.start, op.end) for op in meta.flushes] == [(32, 40)] and meta.flush_wait
    part = meta.flushes[0].key
    assert not worker.cache.contains(part)                   # nothing before its copy is stored
    worker.handle_preemptions(meta)                          # waits: block 4 is written next
    assert worker.cache.contains(part)
    kv_layers = list(kv.values())
    for t in kv_layers:                                      # the other request writes block 4
        t[4].fill_(float("nan"))
    # the next turn: prompt and answer up to 45 tokens, then its message; forks at 24 and 40
    again = next_turn(req, 45, "turn2")
    blocks2 = list(range(16, 23))
    for t in kv_layers:
        t[16:23].fill_(float("nan"))
    assert h.step(sched, worker, again, blocks2, kv) == 40
    assert torch.equal(h.tokens_kv(kv, blocks2, 40), want)   # bit-equal to the engine's blocks
    assert worker.connector_worker.decode_saves["groups"] == 2


def test_an_aborted_request_saves_its_last_part_at_the_next_step(sides):
    sched, worker = sides
    kv = h.paged(seed=12)
    blocks = list(range(8))
    req = text_request("a", range(300, 318))                 # 18 tokens: whole blocks end at 16
    assert h.step(sched, worker, req, blocks, kv) == 0
    req.num_computed_tokens = 18
    metas = decode(sched, worker, req, kv, 29)
    assert not any(m.flushes for m in metas)                 # [16, 32) not whole yet
    sched.request_finished(req, blocks)                      # aborted: vLLM frees its blocks next
    meta = run(sched, worker, output(None, 0), kv)           # an idle step (no forward needed)
    assert [(op.start, op.end) for op in meta.flushes] == [(16, 24)] and not meta.flush_wait
    worker.wait_for_saves()
    want = h.tokens_kv(kv, blocks, 24).clone()
    again = next_turn(req, 29, "turn2")
    blocks2 = list(range(16, 21))
    for t in kv.values():
        t[16:21].fill_(float("nan"))
    assert h.step(sched, worker, again, blocks2, kv) == 24
    assert torch.equal(h.tokens_kv(kv, blocks2, 24), want)


def test_decode_saves_off_flush_nothing(tmp_path):
    sched, worker = h.connectors(h.cache_fields(tmp_path / "spill"), mmtier_chunk_blocks=2,
                                 mmtier_save_decode=False)
    try:
        kv = h.paged(seed=13)
        req = text_request("o", range(500, 527))
        assert h.step(sched, worker, req, list(range(8)), kv) == 0
        req.num_computed_tokens = 27
        assert not any(m.flushes for m in decode(sched, worker, req, kv, 45))
        sched.request_finished(req, list(range(8)))
        assert not run(sched, worker, output(None, 0), kv).flushes
    finally:
        sched.shutdown()
        worker.shutdown()
