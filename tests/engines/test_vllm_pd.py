"""The P/D handoff of mmtier's vLLM connector (``mmtier.engines.vllm.pd``), driven with vLLM's own
config, factory and ``Request`` objects (``tests/support/vllm_harness.py``): what a real engine
pair cannot be made to do on cue here: a decode request that arrives before the prefill
engine's groups are stored, and one whose groups never appear (a transfer past its timeout),
under both load-failure policies. Real engines run the flow end to end in
``tests/serve/test_llm_pd.py``.

Needs vLLM importable (``./run engines``)."""

from __future__ import annotations

import importlib.util
import time

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not importable: run ./run engines", allow_module_level=True)

import torch  # noqa: E402

from mmtier.engines.vllm import pd  # noqa: E402
from mmtier.errors import ConfigError  # noqa: E402
from tests.support import vllm_harness as h  # noqa: E402

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None}          # what Ray Serve LLM's P/D orchestrator sends
WHOLE = h.PROMPT // h.BS * h.BS               # the prompt's whole blocks: all a decoder loads


def _req(rid: str, params: dict | None, seed: int = 0):
    r = h.request(rid, seed=seed)
    r.kv_transfer_params = params
    return r


def _prefill(sched, worker, rid: str, blocks: list[int], kv, seed: int = 0) -> dict:
    req = _req(rid, dict(PREFILL), seed)
    assert h.step(sched, worker, req, blocks, kv) == 0
    delay, params = sched.request_finished(req, blocks)
    assert delay is False
    return params


def test_a_producer_names_the_groups_it_saved_and_a_consumer_loads_them_and_saves_no_prompt(tmp_path):
    fields = h.cache_fields(tmp_path / "spill")
    p_sched, p_worker = h.connectors(fields, "kv_producer")
    d_sched, d_worker = h.connectors(fields, "kv_consumer")
    kv, blocks = h.paged(seed=1), [3, 7, 1, 9, 4, 11]
    plan = p_sched._plan(_req("p0", dict(PREFILL))).plan
    params = _prefill(p_sched, p_worker, "p0", blocks, kv)
    assert params == {pd.GROUPS: [s.key.hex for s in plan.segments], pd.TOKENS: WHOLE}
    assert plan.segments[-1].end == WHOLE
    # a request that asks no handoff gets no params
    plain = h.request("p1", seed=5)
    h.step(p_sched, p_worker, plain, [0, 2, 5, 6, 8, 10], h.paged(seed=2))
    assert p_sched.request_finished(plain, [0, 2, 5, 6, 8, 10]) == (False, None)

    # the decode engine: the same bytes into its own blocks, every whole block below the last token
    kv_d, d_blocks = h.paged(), [12, 13, 14, 15, 16, 17]
    d = _req("d0", params)
    assert h.step(d_sched, d_worker, d, d_blocks, kv_d) == WHOLE
    assert torch.equal(h.tokens_kv(kv_d, d_blocks, WHOLE), h.tokens_kv(kv, blocks, WHOLE))
    assert d_sched.counts["pd_handoffs"] == 1 and d_sched.counts["pd_waits"] == 0
    # a prompt only the consumer saw: computed there, never saved
    fresh = _req("d1", None, seed=9)
    assert h.step(d_sched, d_worker, fresh, [18, 19, 20, 21, 22, 23], h.paged(seed=3)) == 0
    assert not any(d_sched.cache.contains(s.key) for s in d_sched._plan(fresh).plan.segments)
    for r, b in ((d, d_blocks), (fresh, [18, 19, 20, 21, 22, 23])):
        d_sched.request_finished(r, b)
    assert len(d_sched.cache.leases) == 0 and not d_sched.scheduler._reqs


def test_a_decoder_that_arrives_before_the_save_waits_for_it_instead_of_missing(tmp_path):
    fields = h.cache_fields(tmp_path / "spill")
    p_sched, p_worker = h.connectors(fields, "kv_producer")
    d_sched, d_worker = h.connectors(fields, "kv_consumer", mmtier_pd_wait_s=60)
    plan = p_sched._plan(_req("p", dict(PREFILL), seed=4)).plan
    params = pd.handoff_params([s.key.hex for s in plan.segments], WHOLE)   # named, not yet stored
    d = _req("d", params, seed=4)
    assert d_sched.get_num_new_matched_tokens(d, 0) == (None, False)       # ask again later
    assert d_sched.counts["pd_waits"] == 1
    kv = h.paged(seed=6)
    assert _prefill(p_sched, p_worker, "p", list(range(6)), kv, seed=4) == params
    kv_d = h.paged()
    assert h.step(d_sched, d_worker, d, list(range(10, 16)), kv_d) == WHOLE
    assert torch.equal(h.tokens_kv(kv_d, list(range(10, 16)), WHOLE), h.tokens_kv(kv, list(range(6)), WHOLE))
    # a decode request aborted while it waits (the client went away): nothing of it stays
    named = [s.key.hex for s in p_sched._plan(_req("q", dict(PREFILL), seed=8)).plan.segments]   # never saved
    gone = _req("gone", pd.handoff_params(named, WHOLE), seed=8)
    assert d_sched.get_num_new_matched_tokens(gone, 0) == (None, False)
    assert d_sched.request_finished(gone, []) == (False, None)
    d_sched.request_finished(d, list(range(10, 16)))
    assert len(d_sched.cache.leases) == 0 and not d_sched.scheduler._reqs


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_groups_that_never_appear_end_the_wait_per_the_policy(tmp_path, policy):
    p_sched, p_worker = h.connectors(h.cache_fields(tmp_path / "p"), "kv_producer")
    # another cache: the prefill engine's saves never reach it (a lost store, a dead link)
    d_sched, d_worker = h.connectors(h.cache_fields(tmp_path / "d"), "kv_consumer", mmtier_pd_wait_s=0.3,
                                     mmtier_load_failure_policy=policy)
    params = _prefill(p_sched, p_worker, "p", list(range(6)), h.paged(seed=1))
    d, blocks = _req("d", params), list(range(10, 16))
    assert d_sched.get_num_new_matched_tokens(d, 0) == (None, False)
    time.sleep(0.35)
    hit = h.step(d_sched, d_worker, d, blocks, h.paged(seed=2))
    assert d_sched.counts["pd_timeouts"] == 1
    failed = d_worker.get_block_ids_with_load_errors()
    if policy == "recompute":          # vLLM computes the whole prompt
        assert hit == 0 and failed == set()
    else:                              # the named tokens are claimed, their load fails: vLLM fails it
        assert hit == WHOLE and failed == set(blocks[:WHOLE // h.BS])
        assert d_sched._kv_transfer_config.kv_load_failure_policy == "fail"
    d_sched.request_finished(d, blocks)
    assert len(d_sched.cache.leases) == 0 and not d_sched.scheduler._reqs


def test_settings_are_checked():
    assert pd.wait_setting({}) == pd.WAIT_S and pd.wait_setting({"mmtier_pd_wait_s": "2.5"}) == 2.5
    for bad in (0, -1, "soon", None):
        with pytest.raises(ConfigError, match="mmtier_pd_wait_s"):
            pd.wait_setting({"mmtier_pd_wait_s": bad})
    with pytest.raises(ConfigError, match="kv_role"):
        pd.role_setting("kv_sender")
    assert pd.PendingHandoff.from_params({"do_remote_decode": True}, 1.0) is None
    assert pd.PendingHandoff.from_params({pd.GROUPS: ["ab", 3], pd.TOKENS: "x"}, 1.0).names == {"ab"}
    wait = pd.PendingHandoff.from_params(pd.handoff_params(["a", "b"], 64), 1.0)
    assert wait.wanted(["a", "b", "c"]) == 2 and wait.wanted(["b", "a"]) == 2 and wait.wanted(["x", "a"]) == 0


def test_real_engines_hand_the_prompt_over_bit_equal_in_bf16(tmp_path):
    """Real engines (``tests/support/vllm_pd_scenarios.py``): a prefill engine and then a decode
    engine over one disk directory, bf16 weights, activations and pages; prompts of 97 to 2500
    tokens, four in flight on each engine. The decode engine's greedy tokens are a plain
    engine's, it loaded every whole block below each prompt's last token, and it wrote no file."""
    from tests.support.engine_runs import scenario
    from tests.support.vllm_models import BLOCK, build_llama

    model = str(build_llama(tmp_path / "llama"))
    r = scenario("tests.support.vllm_pd_scenarios", "pd", tmp_path / "run", model=model, dtype="bfloat16")
    for n, params, first, got, want in zip(r["lengths"], r["params"], r["first"], r["decode"], r["plain"],
                                           strict=True):
        assert params[pd.TOKENS] == n // BLOCK * BLOCK and len(params[pd.GROUPS]) == n // BLOCK   # block chunks
        assert first == want["tokens"][:1]
        assert got["tokens"] == want["tokens"], n
        assert got["cached"] == (n - 1) // BLOCK * BLOCK and want["cached"] == 0, n
    assert max(r["lengths"]) >= 2000
    assert r["files_after_decode"] == r["files_after_prefill"] != []
