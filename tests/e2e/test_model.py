"""End to end: the reference model's greedy generation through the cache equals the dense model.

Covers both kinds of sharing (content-only encoder outputs and cross-attention K/V at any
position; prefix-dependent media self-attention K/V under the same prefix only), tenants,
eviction on small device pools, lower tiers, and bad input.
"""

from __future__ import annotations

import random

import pytest
import torch

from mmtier import ConfigError, MMTierError, TieredKVCache
from tests.support.reference_model import (
    Audio,
    Image,
    Media,
    MediaError,
    PromptError,
    ReferenceModel,
    Text,
    reference_config,
)

NEW = 6
# tokens generated per prompt: the Triton kernels under the interpreter cost ~0.1 s per
# attention call, so that backend generates fewer (greedy: they are a prefix of the dense NEW)
NEW_BY_BACKEND = {"torch": NEW, "triton": 2}
SYS = Text("You are a terse assistant. ")
IMAGES = [bytes((i * 37 + j * 11) % 256 for j in range(3072 + 97 * i)) for i in range(3)]
CLIPS = [bytes((i * 53 + j * 7) % 256 for j in range(n)) for i, n in enumerate((1600, 3200))]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: one intra-op thread is faster and steadier on a small shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def dense_answers():
    """Dense answers per prompt, computed once per module (the dense model is the slow part)."""
    model = ReferenceModel(seed=0)
    memo: dict[tuple, list[int]] = {}

    def answer(prompt):
        key = tuple((type(i).__name__, getattr(i, "ids", None), getattr(i, "data", None)) for i in prompt)
        if key not in memo:
            memo[key] = model.generate_dense(prompt, NEW)
        return memo[key]

    return answer


def small_pools(pages: dict[str, int], **kw):
    """A reference config whose device pools hold exactly ``pages[modality]`` pages."""
    specs = reference_config().modalities
    want = {m: (pages[m] + 0.5) * specs[m].page_bytes for m in specs}
    arena = sum(want.values())
    return reference_config(device_bytes=int(arena), shares={m: b / arena for m, b in want.items()}, **kw)


def test_reuse_counts_and_dense_equality(dense_answers, backend):
    new = NEW_BY_BACKEND[backend.name]
    model = ReferenceModel(seed=0)
    img, clip = IMAGES[0], CLIPS[0]
    with TieredKVCache(model.cache_config(**backend.cfg())) as cache:
        def run(tenant, prompt):
            assert model.generate(cache, tenant, prompt, new) == dense_answers(prompt)[:new]
            return model.counters.snapshot()

        c = run("acme", [SYS, Image(img), Text("What is this?")])
        assert c["encoder_runs"] == {"vision": 1} and c["self_misses"] == {"vision": 1}

        # same prefix, same image: every media state is reused, no encoder, no decoder pass
        before = c["decoder_tokens"]
        c = run("acme", [SYS, Image(img), Text("And the colour?")])
        assert c["encoder_runs"] == {"vision": 1}
        assert c["self_hits"] == {"vision": 1} and c["cross_hits"] == {"vision": 1}
        assert c["decoder_tokens"] - before == len(SYS.ids) + len("And the colour?") + new - 1

        # another prefix: the image's self-attention K/V is recomputed from the cached encoder
        # outputs (no encoder run); its cross-attention K/V is reused at the new position
        c = run("acme", [Text("Another question first. "), Image(img), Audio(clip), Text("Both?")])
        assert c["encoder_runs"] == {"vision": 1, "audio": 1}
        assert c["embedding_hits"] == {"vision": 1}
        assert c["cross_hits"] == {"vision": 2} and c["self_misses"] == {"vision": 2, "audio": 1}

        # audio first under the system prompt: both cross states hit, both self states miss,
        # both encoders skipped
        c = run("acme", [SYS, Audio(clip), Image(img), Text("Again.")])
        assert c["encoder_runs"] == {"vision": 1, "audio": 1}
        assert c["embedding_hits"] == {"vision": 2, "audio": 1}
        assert c["cross_hits"] == {"vision": 3, "audio": 1}

        # another tenant never hits the first one's content: the encoder runs again
        c = run("globex", [SYS, Image(img), Text("What is this?")])
        assert c["encoder_runs"] == {"vision": 2, "audio": 1}
        assert c["cross_misses"] == {"vision": 2, "audio": 1}
        assert c["self_misses"] == {"vision": 4, "audio": 2}

        assert cache.stats().sequences == 0                  # every session released its sequences


def test_prompt_ending_on_media_and_multi_turn(dense_answers, backend):
    new = NEW_BY_BACKEND[backend.name]
    model = ReferenceModel(seed=0)
    prompt = [SYS, Image(IMAGES[1])]
    turns = [[SYS, Audio(CLIPS[1]), Text("Transcribe.")], [Image(IMAGES[1])], [Text("Thanks.")]]
    with TieredKVCache(model.cache_config(**backend.cfg())) as cache:
        assert model.generate(cache, "acme", prompt, new) == dense_answers(prompt)[:new]
        # the second time the last item's self K/V hits: only its last position is recomputed
        assert model.generate(cache, "acme", prompt, new) == dense_answers(prompt)[:new]
        assert model.counters.self_hits["vision"] == 1
        assert model.chat(cache, "acme", turns, new) == model.chat_dense(turns, new)
        assert model.counters.encoder_runs == {"vision": 1, "audio": 1}


def _workload(seed: int, n: int) -> list[tuple[str, list]]:
    rng = random.Random(seed)
    prefixes = [SYS, Text("Be precise. "), Text("Answer in one word: ")]
    out = []
    for _ in range(n):
        prompt = [rng.choice(prefixes)]
        for _ in range(rng.randint(1, 2)):
            prompt.append(Image(rng.choice(IMAGES)) if rng.random() < 0.6 else Audio(rng.choice(CLIPS)))
        prompt.append(Text(rng.choice(["What?", "Why?", "Describe."])))
        out.append((rng.choice(["acme", "acme", "globex"]), prompt))
    return out


# prompts per workload: the Triton kernels under the interpreter cost ~0.1 s per attention call,
# so that backend serves a shorter workload (still evicting / spilling, still reusing)
PROMPTS = {"torch": 12, "triton": 4}
POOLS = {"text": 4, "vision": 2, "audio": 8, "vision_xattn": 2, "audio_xattn": 8,
         "vision_embed": 2, "audio_embed": 4}


def _serve(cache, model, dense_answers, work, new=NEW):
    placements = 0
    for tenant, prompt in work:
        assert model.generate(cache, tenant, prompt, new) == dense_answers(prompt)[:new], prompt
        placements += sum(isinstance(i, Media) for i in prompt)
    runs = sum(model.counters.encoder_runs.values())
    assert 0 < runs < placements                               # encoder outputs were reused
    return cache.stats()


def test_small_device_pools_evict_and_stay_exact(dense_answers, backend):
    model = ReferenceModel(seed=0)
    with TieredKVCache(small_pools(POOLS, **backend.cfg())) as cache:
        stats = _serve(cache, model, dense_answers, _workload(1, PROMPTS[backend.name]),
                       NEW_BY_BACKEND[backend.name])
    assert stats.counters["evictions"] > 0
    assert sum(model.counters.self_hits.values()) + sum(model.counters.cross_hits.values()) > 0


def test_lower_tiers_spill_and_stay_exact(dense_answers, tmp_path, backend):
    model = ReferenceModel(seed=0)
    cfg = small_pools(POOLS, host_bytes=1 << 20, disk_dir=tmp_path / "spill", disk_bytes=64 << 20,
                      disk_free_floor_bytes=0, **backend.cfg())
    with TieredKVCache(cfg) as cache:     # all 12 prompts on both backends: fewer would not reach disk
        stats = _serve(cache, model, dense_answers, _workload(1, PROMPTS["torch"]),
                       NEW_BY_BACKEND[backend.name])
    # The seeded workload's media K/V is several times the tiny device pools and the 1 MiB host
    # tier: groups must go device -> host -> disk, and some come back while answers stay exact.
    c = stats.counters
    assert c["spills_to_host"] > 0 and c["spills_to_disk"] > 0, c
    assert c["restores"] > 0, c
    assert sum(u.bytes for u in stats.tiers["disk"].values()) > 0
    assert 0 < sum(u.bytes for u in stats.tiers["host"].values()) <= 1 << 20


def test_bad_input_raises_typed_errors_and_changes_nothing(backend):
    model = ReferenceModel(seed=0)
    with TieredKVCache(model.cache_config(**backend.cfg())) as cache:
        before = cache.stats()
        bad = [
            (MediaError, [SYS, Image(b"")]),                      # empty bytes
            (MediaError, [SYS, Audio(b"")]),
            (MediaError, [SYS, Image("not bytes")]),
            (MediaError, [SYS, Media("video", b"frames")]),
            (PromptError, [Text([65, 300])]),
            (PromptError, [Text("")]),
            (PromptError, []),
            (PromptError, [SYS, "raw string"]),
        ]
        for error, prompt in bad:
            with pytest.raises(error) as info:
                model.generate(cache, "acme", prompt, NEW)
            assert isinstance(info.value, MMTierError)
        with pytest.raises(PromptError):
            model.generate(cache, "acme", [SYS], -1)
        after = cache.stats()
        assert after.counters == before.counters and after.sequences == 0
        assert model.counters.snapshot()["decoder_tokens"] == 0


def test_cache_of_another_model_is_refused(backend):
    model = ReferenceModel(seed=0)
    with TieredKVCache(reference_config(seed=1, **backend.cfg())) as cache:
        with pytest.raises(ConfigError) as info:
            model.generate(cache, "acme", [SYS], 1)
        assert info.value.fields == ("model",)
