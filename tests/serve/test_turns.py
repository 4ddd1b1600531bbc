"""The Serve worker's requests without Ray: ``TurnRunner`` (what ``TurnWorker`` answers its
requests through) with the real chat model over a real pool (``PoolService``, in this process),
driven into its 503 answers for real: a pool with no room for a request (``capacity``), two
requests for one worker at once (``busy``: the chat model takes one at a time), and a holder
gone mid-request (``holder_lost``: the worker's ``HostedCache`` over an in-process cluster, a
real ``ContentRegistry`` and holder ``PoolService``s reached by direct calls instead of Ray, as
in ``tests/cluster/test_engine_remote.py``).

Requests are stateless: each carries its conversation's earlier turns and their answers' text.
After each 503: the OpenAI-shaped error, the pool with no sequence, lease or unowned page left
behind (``leak_report``), and the conversation's cached history as it was: its next request that
fits attaches that history and equals the dense reference (``dense_chat``) of the turns that
succeeded.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers, Pillow) is not installed")

from mmtier.chat.model import dense_chat  # noqa: E402
from mmtier.cluster.engine_cache import HostedCache  # noqa: E402
from mmtier.cluster.pool import PoolService  # noqa: E402
from mmtier.cluster.registry import ContentRegistry, HolderInfo  # noqa: E402
from mmtier.content import split_address  # noqa: E402
from mmtier.errors import HolderLostError  # noqa: E402
from mmtier.serve.config import ModelArgs, Workers  # noqa: E402
from mmtier.serve.engine_loader import load_engine  # noqa: E402
from mmtier.serve.turns import TurnRunner  # noqa: E402
from tests.support.media_samples import image, wav  # noqa: E402

NEW = 3
SMALL = image(31, (64, 48))          # 4 image tokens: fits a one-page vision pool
BIG = image(32, (336, 336))          # 144 image tokens: three vision pages


@pytest.fixture(scope="module")
def engine():
    return load_engine(ModelArgs(seed=0))


@pytest.fixture
def pool(engine):
    """A small pool: the vision pool holds one page (one image of up to 64 tokens), the text
    pool 17 pages (272 tokens)."""
    cfg = engine.chat.cache_config(device_bytes=16 << 20, shares={"vision": 0.08, "text": 0.3})
    svc = PoolService(cfg, name="mmtier-pool:test:host0", node="test")
    pages = {m: p.num_pages for m, p in svc.cache.pools.items()}
    assert pages["vision"] == 1 and pages["text"] == 17, pages
    yield svc
    svc.close()


def dense(engine, *turns) -> list[list[int]]:
    return dense_chat(engine.chat, [[p for _k, p in t] for t in turns], NEW)


def assert_no_leak(svc: PoolService) -> None:
    report = svc.leak_report()
    assert report["sequences"] == 0 and report["leases"] == 0 and report["handles"] == 0, report
    assert report["used_pages"] == report["cached_pages"], report


def assert_503(status: int, body: dict, code: str, *words: str) -> None:
    assert status == 503, body
    err = body["error"]
    assert (err["type"], err["code"]) == ("service_unavailable_error", code) and set(body) == {"error"}, body
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err["message"]


@pytest.mark.parametrize("case", ["image_over_the_vision_pool", "text_over_the_text_pool"])
def test_no_room_for_a_request_is_503_capacity_and_changes_nothing(engine, pool, case):
    runner = TurnRunner(engine, pool.cache, Workers())
    t1 = [("text", "Look: "), ("image", SMALL)]
    status, first = runner.answer("acme", [], t1, NEW)
    assert status == 200, first
    history = [(t1, first["text"])]
    before = pool.cache.stats().tiers["device"]
    over = [("text", "and this: "), ("image", BIG)] if case.startswith("image") else [("text", "x" * 300)]
    status, body = runner.answer("acme", history, over, NEW)
    assert_503(status, body, "capacity", "vision pool" if case.startswith("image") else "text pool",
               "send it again, or a shorter one")
    assert_no_leak(pool)
    # what the failed request stored is whole groups (sealed spans, the image's encoder output),
    # never pages of its own
    after = pool.cache.stats().tiers["device"]
    assert all(after[m].pages >= before[m].pages for m in before)
    status, body = runner.answer("acme", [], over, NEW)           # alone, it does not fit either
    assert_503(status, body, "capacity")
    assert_no_leak(pool)
    # the next request that fits finds the first turn's groups, as if the failed one was never sent
    t2 = [("text", "so?")]
    status, second = runner.answer("acme", history, t2, NEW)
    assert status == 200, second
    assert second["cached_tokens"] == first["prompt_tokens"] + NEW - 1
    assert [first["tokens"], second["tokens"]] == dense(engine, t1, t2)
    assert_no_leak(pool)


def test_two_requests_at_once_one_waits_then_503_busy_and_changes_nothing(engine, pool):
    """Request A holds the model (paused inside its forward by a hook on the real model);
    requests B (another conversation's second turn) and a new one wait ``turn_wait_s`` and get
    503 ``busy``; nothing of theirs ran. A then finishes; B sent again equals dense."""
    runner = TurnRunner(engine, pool.cache, Workers(turn_wait_s=0.2))
    ta1, tb1 = [("text", "Hello. ")], [("text", "Bonjour. ")]
    (sa, a1), (sb, b1) = (runner.answer("acme", [], t, NEW) for t in (ta1, tb1))
    assert sa == sb == 200
    entered, go = threading.Event(), threading.Event()

    def pause(_module, _args):
        if not entered.is_set():
            entered.set()
            go.wait(timeout=60)

    hook = engine.chat.vlm.register_forward_pre_hook(pause)
    got: dict[str, tuple[int, dict]] = {}
    ta2, tb2 = [("text", "again: "), ("image", SMALL)], [("text", "and you?")]
    a = threading.Thread(target=lambda: got.setdefault("a", runner.answer("acme", [(ta1, a1["text"])], ta2, NEW)))
    try:
        a.start()
        assert entered.wait(timeout=60)                  # A is inside the model
        encoder_runs = dict(engine.chat.encoder_runs)
        t0 = time.monotonic()
        status, body = runner.answer("acme", [(tb1, b1["text"])], tb2, NEW)
        assert_503(status, body, "busy", "0.2 s", "nothing of it is kept: send it again")
        assert time.monotonic() - t0 < 30
        status, body = runner.answer("globex", [], [("text", "hi"), ("image", BIG)], NEW)
        assert_503(status, body, "busy")
        assert dict(engine.chat.encoder_runs) == encoder_runs      # nothing of theirs ran
    finally:
        go.set()
        a.join(timeout=120)
        hook.remove()
    assert not a.is_alive()
    status, a2 = got["a"]
    assert status == 200, a2
    status, b2 = runner.answer("acme", [(tb1, b1["text"])], tb2, NEW)
    assert status == 200 and b2["cached_tokens"] == b1["prompt_tokens"] + NEW - 1, b2
    assert [a1["tokens"], a2["tokens"]] == dense(engine, ta1, ta2)
    assert [b1["tokens"], b2["tokens"]] == dense(engine, tb1, tb2)
    assert_no_leak(pool)


class InProcessCluster:
    """The calls of ``RayTransport`` an embedded pool makes here, made directly: lookups and
    publishes on a real ``ContentRegistry``, remote groups on real holder ``PoolService``s. A
    holder that is gone answers as a dead actor does through Ray: ``HolderLostError``."""

    def __init__(self, registry: ContentRegistry, holders: dict[str, PoolService]):
        self.registry, self.holders = registry, holders
        self.calls: Counter[str] = Counter()

    def forget(self, digests):
        pass                                    # no lookup cache here: the registry answers afresh

    def lookup_async(self, addresses):          # a plain registry: digests (the shard router strips them)
        self.calls["lookup"] += 1
        return self.registry.lookup([split_address(a)[0] for a in addresses])

    def wait(self, answer, n):
        return answer

    def publish_later(self, holder, items, removed, info):
        self.calls["publish"] += 1
        self.registry.add(holder, items, HolderInfo(info["name"], info["node"], info["kind"]))
        self.registry.remove(holder, [split_address(a)[0] for a in removed])

    def attach(self, holder, proxy, tenant, wire):
        self.calls["attach"] += 1
        return self._holder(holder).attach(proxy, tenant, wire)

    def attend(self, holder, parts, layer, q, q_pos, causal, scale):
        self.calls["attend"] += 1
        return self._holder(holder).attend(parts, layer, q, q_pos, causal, scale)

    def attended(self, state, holder):
        return state

    def release(self, holder, proxies):
        self.calls["release"] += 1
        if holder in self.holders:
            self.holders[holder].release(proxies)

    def _holder(self, name: str) -> PoolService:
        h = self.holders.get(name)
        if h is None:
            raise HolderLostError(f"{name} is gone")
        return h


def test_a_holder_lost_mid_request_is_503_holder_lost_and_changes_nothing(engine):
    """A clip's Whisper cross-attention K/V (its ``audio`` group) is held by another node's pool
    and too large for this worker's audio pool, so the request plans to attend it where it
    lives. That holder dies before the request reaches it (the registry still lists it: it
    learns of the death only at its next sweep): 503 ``holder_lost``; the worker's pool keeps
    nothing of the request, and the conversation's next request attaches its history and
    equals the dense reference of the turns that succeeded."""
    clip = wav(33, 0.5)
    chat = engine.chat
    here = PoolService(chat.cache_config(device_bytes=16 << 20, shares={"audio": 0.1}),
                       name="mmtier-pool:here:host0", node="here")
    there = PoolService(chat.cache_config(device_bytes=32 << 20), name="mmtier-pool:there:host0", node="there")
    registry = ContentRegistry()
    cluster = InProcessCluster(registry, {there.name: there})
    here.transport = cluster
    try:
        key = here.cache.content_key("audio", clip, tenant="acme")
        warm = engine.answer(there.cache, "acme", [], [("text", "hear "), ("audio", clip)], NEW)
        assert warm.counts["encoder_runs"] == {"audio": 1}             # the clip on the other node
        assert there.cache.contains(key)
        registry.add(there.name, [there.held_item(key)], HolderInfo(there.name, "there", "pool"))
        audio = here.cache.pools["audio"]
        assert registry.lookup([key.hex])[0].nbytes > audio.num_pages * audio.spec.page_bytes

        runner = TurnRunner(engine, HostedCache(here), Workers(), node="here", calls=cluster.calls)
        t1 = [("text", "Hello. ")]
        status, first = runner.answer("acme", [], t1, NEW)
        assert status == 200, first
        history = [(t1, first["text"])]
        del cluster.holders[there.name]                       # the holder dies
        there.close()
        status, body = runner.answer("acme", history, [("text", "and this: "), ("audio", clip)], NEW)
        assert_503(status, body, "holder_lost", there.name, "send it again")
        assert cluster.calls["lookup"] >= 1 and cluster.calls["attach"] == 1
        assert_no_leak(here)
        t2 = [("text", "so?")]
        status, second = runner.answer("acme", history, t2, NEW)
        assert status == 200 and second["cached_tokens"] == first["prompt_tokens"] + NEW - 1, second
        assert [first["tokens"], second["tokens"]] == dense(engine, t1, t2)
        assert_no_leak(here)
    finally:
        here.close()
