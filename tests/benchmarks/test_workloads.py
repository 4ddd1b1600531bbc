"""The trace generator (shapes, determinism, Arrow round trip) and the simulator's key plan."""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
import pytest

from benchmarks.eviction.tracesim import GroupTiers, dedup, plan, replay, waste
from benchmarks.eviction.workloads import (
    LLAVA_IMAGE_TOKENS,
    VIDEO_TOKENS_PER_S,
    WorkloadConfig,
    generate,
    load,
    qwen2vl_image_tokens,
    save,
    whisper_tokens,
)
from mmtier.config import CacheConfig, ModalitySpec
from mmtier.eviction import make_policy

SMALL = WorkloadConfig(seed=3, turns=300)


@pytest.fixture(scope="module")
def trace():
    return generate(SMALL)


def test_same_seed_same_trace_other_seed_other_trace(trace):
    assert generate(SMALL).equals(trace)
    assert not generate(WorkloadConfig(seed=4, turns=300)).equals(trace)


def test_arrow_round_trip(trace, tmp_path):
    path = save(trace, tmp_path / "t.arrow")
    back = load(path)
    assert back.equals(trace) and back.config == SMALL
    (tmp_path / "bad.arrow").write_bytes(b"")
    with pytest.raises((ValueError, pa.ArrowInvalid)):
        load(tmp_path / "bad.arrow")


def test_real_token_shapes():
    assert qwen2vl_image_tokens(448, 448) == 256
    assert qwen2vl_image_tokens(1080, 1920) == 26 * 47          # capped at max_pixels
    assert qwen2vl_image_tokens(4032, 3024) <= 1280
    assert whisper_tokens(12) == 1500 and whisper_tokens(31) == 3000
    t = generate(WorkloadConfig(seed=1, turns=600)).table.to_pydict()
    rows = list(zip(t["source"], t["tokens"], t["tenant"]))
    assert {s for s, _, _ in rows} >= {"llava15", "qwen2vl", "whisper", "qwen2vl_video"}
    for source, tokens, tenant in rows:
        if source == "llava15":
            assert tokens == LLAVA_IMAGE_TOKENS and tenant % 2 == 0
        elif source == "qwen2vl":
            assert 4 <= tokens <= 1280 and tenant % 2 == 1
        elif source == "whisper":
            assert tokens % 1500 == 0
        elif source == "qwen2vl_video":
            assert tokens % VIDEO_TOKENS_PER_S == 0 and tokens <= 8 * VIDEO_TOKENS_PER_S


def test_turn_structure_and_context_limit(trace):
    t = trace.table.to_pydict()
    turns = defaultdict(list)
    for i, req in enumerate(t["req"]):
        turns[req].append(i)
    assert sorted(turns) == list(range(SMALL.turns))
    next_turn: dict[int, int] = {}
    context: dict[int, int] = defaultdict(int)
    for req in sorted(turns):
        rows = turns[req]
        conv, turn = t["conv"][rows[0]], t["turn"][rows[0]]
        assert turn == next_turn.get(conv, 0)                    # turns of a conversation in order
        next_turn[conv] = turn + 1
        roles = [t["role"][i] for i in rows]
        assert roles[-2:] == ["user", "assistant"]
        assert ("system" in roles) == (turn == 0)
        assert [t["seg"][i] for i in rows] == list(range(len(rows)))
        context[conv] += sum(t["tokens"][i] for i in rows)
    assert max(context.values()) <= SMALL.max_context


def test_popular_images_recur_across_conversations_and_tenants():
    t = generate(WorkloadConfig(seed=0, turns=1500)).table.to_pydict()
    seen = defaultdict(lambda: (set(), set()))
    for m, media, conv, tenant in zip(t["modality"], t["media"], t["conv"], t["tenant"]):
        if m == "vision":
            seen[media][0].add(conv)
            seen[media][1].add(tenant)
    top = max(seen.values(), key=lambda v: len(v[0]))
    assert len(top[0]) >= 10 and len(top[1]) >= 2


def test_plan_chains_turns_and_scopes_sharing(trace):
    p = plan(trace)
    by_conv = defaultdict(list)
    for turn in p.turns:
        by_conv[turn.conv].append(turn)
    multi = [ts for ts in by_conv.values() if len(ts) >= 3]
    assert multi
    for ts in multi:                                             # the next turn reuses the chain
        for a, b in zip(ts, ts[1:]):
            prev = [k for k, _, _ in a.lookups] + ([a.seal_key] if a.seal_key else [])
            assert [k for k, _, _ in b.lookups][:len(prev)] == prev
    for mod, tokens in p.groups.values():                        # whole text pages only
        if mod == "text":
            assert tokens % 16 == 0
    # content-only groups: shared by conversations of one tenant; nothing crosses tenants
    content = WorkloadConfig(seed=3, turns=300, vision_sharing="content")
    pc = plan(generate(content))
    tenant_of = {}
    tr = generate(content).table.to_pydict()
    conv_tenant = dict(zip(tr["conv"], tr["tenant"]))
    for conv, keys in pc.conv_groups.items():
        for k in keys:
            assert tenant_of.setdefault(k, conv_tenant[conv]) == conv_tenant[conv]
    shared_c = sum(len(v) for v in pc.conv_groups.values()) - len(pc.groups)
    shared_p = sum(len(v) for v in p.conv_groups.values()) - len(p.groups)
    assert shared_c > shared_p > 0          # system prompts share under prefix; images more so


def small_cfg() -> CacheConfig:
    return CacheConfig(
        model="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", device_bytes=1 << 20,
        modalities={"text": ModalitySpec(page_size=16), "vision": ModalitySpec(page_size=16),
                    "audio": ModalitySpec(page_size=100, head_dim=16),
                    "video": ModalitySpec(page_size=144)})


def test_replay_metrics_and_schemes(trace):
    cfg = small_cfg()
    p = plan(trace)
    store = GroupTiers(cfg, make_policy(cfg), {m: 400 for m in cfg.modalities}, 1 << 20, 1 << 21)
    stats = replay(p, store, concurrency=3)
    store.check()
    assert sum(stats.uses.values()) == sum(len(t.lookups) for t in p.turns)
    assert 0 < stats.ratio("cost") < 1 and stats.ratio("device_cost") <= stats.ratio("cost")
    assert stats.bytes_moved > 0 and all(not g.refs for g in store.groups.values())
    specs = cfg.modalities
    assert waste(p, specs) <= waste(p, specs, {m: 16 for m in specs}) + 1e-9
    assert waste(p, specs, {m: 16 for m in specs}, padded=True) > 0.3   # audio pages 2x bytes
    per_conv, per_req = dedup(p, specs)
    assert 0 < per_req < per_conv < 1
