"""Two Ray Serve LLM replicas on two nodes (``tests/support/serve_llm_cluster.py``): they share through
the mmtier cluster, and mmtier's request router sends a request to the node holding its groups.

One cluster, real vLLM engines (CPU build, the tiny LLaVA), the real ``openai`` client over
loopback, few requests:

1. a first image chat is encoded on one node (A's), and the registry then holds its encoder
   output and every prompt segment there, under the keys the router computes (the same
   functions as the connectors: a mismatch finds nothing);
2. the conversation's next turns (the same image, a longer prefix) go to A's node: the
   segments each turn saves appear at A's store only, and each reports the earlier prefix as
   cached;
3. while a long streaming turn occupies A's replica (one request at a time per replica), a
   repeat of the first chat is routed to the other replica (the router's preferred replica is
   full: Serve's choice comes next): there the vision encoder does not run, its link pulls the
   groups from A's node, ``cached_tokens`` is the whole prefix, and the answer's tokens are
   the first chat's.
"""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("openai") is None
    or importlib.util.find_spec("ray.serve.llm") is None,
    reason="needs vLLM, Ray Serve LLM and the openai client: run in the engines environment (./run engines)")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from tests.support.serve_llm_cluster import ServeCluster

    # the router's budget for keys and lookup is 0.25 s by default (past it, Serve's own choice:
    # routing never adds more); under the load of this 2-core test machine, rendering a chat
    # with an image can take longer, and this test asserts the routing decision, not the fallback
    app = ServeCluster(tmp_path_factory.mktemp("serve-replicas"), router="affinity", router_timeout_s=10.0)
    yield app
    app.close()


def _wait_held(app, address: str, timeout_s: float = 20.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = app.holder_nodes([address])[0]
        if nodes or time.monotonic() > deadline:
            return nodes
        time.sleep(0.5)


def test_replicas_share_and_route_by_holder(app):
    from openai import OpenAI
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest

    from mmtier.serve.request_keys import RequestKeyer
    from tests.support.serve_llm_cluster import MODEL_ID, data_url
    from tests.support.vllm_mm_models import image, text
    from tests.support.vllm_models import BLOCK

    client = OpenAI(base_url=app.base + "/v1", api_key="none", timeout=300.0, max_retries=0)
    keyer = RequestKeyer(app.config)
    picture = data_url(image(7))

    def keys(messages):
        return keyer.submit(ChatCompletionRequest(model=MODEL_ID, messages=messages, max_tokens=8)).result(120)

    def ask(messages, **kw):
        r = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=8, temperature=0.0, **kw)
        details = r.usage.prompt_tokens_details
        return r.choices[0].message.content, r.usage.prompt_tokens, (details.cached_tokens if details else 0)

    first = [{"role": "user", "content": [{"type": "text", "text": text(1, 50)},
                                          {"type": "image_url", "image_url": {"url": picture}},
                                          {"type": "text", "text": text(2, 60)}]}]
    before = app.encoded()
    assert len(before) == 2, before
    answer, prompt_tokens, cached = ask(first)
    first_answer, first_tokens = answer, prompt_tokens
    assert cached == 0 and answer
    enc = app.encoded()
    a_node = next(n for n, c in enc.items() if c["encoded"] == 1)
    b_node = next(n for n in enc if n != a_node)
    assert enc[b_node]["encoded"] == 0, enc
    k1 = keys(first)
    assert len(k1.media) == 1 and len(k1.prefix) >= 4
    assert _wait_held(app, k1.prefix[-1][0].address) == {a_node}    # the router's keys are the saved ones
    assert _wait_held(app, k1.media[0].address) == {a_node}

    # 2. the next turns go where the conversation lives
    turns, conv, prev = [], first, k1
    for seed in (3, 4):
        conv = conv + [{"role": "assistant", "content": answer},
                       {"role": "user", "content": text(seed, 40)}]
        answer, prompt_tokens, cached = ask(conv)
        k = keys(conv)
        turns.append((_wait_held(app, k.prefix[-1][0].address), cached))
        assert cached >= sum(t for _, t in prev.prefix) // BLOCK * BLOCK - BLOCK
        prev = k
    assert [nodes for nodes, _ in turns] == [{a_node}, {a_node}], turns
    assert app.encoded()[a_node]["encoded"] == 0           # the image came from mmtier

    # 3. A's replica busy with a long streaming turn: a repeat of the first chat goes elsewhere
    long_conv = conv + [{"role": "assistant", "content": answer}, {"role": "user", "content": text(5, 30)}]
    first_chunk = threading.Event()
    pulled_before = app.encoded()[b_node]["pulled"]   # before: /collective_rpc waits for a busy replica

    def long_turn():
        stream = client.chat.completions.create(model=MODEL_ID, messages=long_conv, max_tokens=600,
                                                temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        for _ in stream:
            first_chunk.set()
        ended.append(time.monotonic())

    ended: list[float] = []
    worker = threading.Thread(target=long_turn, daemon=True)
    worker.start()
    assert first_chunk.wait(120)
    t0 = time.monotonic()
    again, again_tokens, again_cached = ask(first)
    t1 = time.monotonic()
    worker.join(300)
    enc = app.encoded()
    timing = f"repeat served in {t1 - t0:.1f} s, the long turn ended {ended[0] - t0:.1f} s after it was sent"
    assert enc[b_node]["encoded"] == 0, enc                 # no vision encoder on the other replica
    assert enc[b_node]["pulled"] > pulled_before, (enc, timing)   # it read A's groups through the cluster
    assert t1 < ended[0], "the long turn ended before the repeat was served: " + timing
    assert (again, again_tokens) == (first_answer, first_tokens)   # the same tokens, from pulled KV
    expected = min(sum(t for _, t in k1.prefix), again_tokens - 1) // BLOCK * BLOCK
    assert again_cached == expected > 64
    long_keys = keys(long_conv)
    assert _wait_held(app, long_keys.prefix[-1][0].address) == {a_node}   # the long turn ran on A

    # 4. another tenant (its cache_salt and item names, as mmtier's ingress sets them) sends the
    #    first chat: its encoder runs wherever it lands, it pulls nothing of A's from the other
    #    node, and the router's keys for it (salted) are the ones its engine saved
    import copy

    from mmtier.serve.llm_requests import tenant_media_ids

    body = {"messages": copy.deepcopy(first)}
    tenant_media_ids(body, "salt-b")
    pulled = {n: c["pulled"] for n, c in app.encoded().items()}
    other, other_tokens, other_cached = ask(body["messages"], extra_body={"cache_salt": "salt-b"})
    enc = app.encoded()
    assert (other, other_tokens, other_cached) == (first_answer, first_tokens, 0)
    assert sorted(c["encoded"] for c in enc.values()) == [0, 1], enc       # its own tower run, once
    assert {n: c["pulled"] for n, c in enc.items()} == pulled, enc         # nothing read from elsewhere
    ran_on = next(n for n, c in enc.items() if c["encoded"] == 1)
    kb = keyer.submit(ChatCompletionRequest(model=MODEL_ID, messages=body["messages"], max_tokens=8,
                                            cache_salt="salt-b")).result(120)
    assert kb.media[0] != k1.media[0] and kb.media[0].scope != k1.media[0].scope
    assert _wait_held(app, kb.media[0].address) == {ran_on}
    assert _wait_held(app, kb.prefix[-1][0].address) == {ran_on}


def test_best_node_prefers_media_then_the_longest_held_prefix():
    """The router's policy over a registry answer (no cluster): media held count first, then
    the leading run of prompt tokens held on one node; holders it cannot place are ignored."""
    import os

    from mmtier.cluster.registry import Location
    from mmtier.content import ContentKey
    from mmtier.serve.affinity_router import best_node
    from mmtier.serve.request_keys import RequestKeys

    def key() -> ContentKey:
        return ContentKey(os.urandom(32), "text", "content", os.urandom(16), os.urandom(32))

    def at(*holders: str) -> Location:
        return Location("text", 32, 1024, tuple((h, "host") for h in holders), 0)

    node_of = {"store-a": "A", "store-b": "B", "pool-b": "B"}
    keys = RequestKeys(media=(key(),), prefix=((key(), 32), (key(), 64), (key(), 32)))
    # B holds the image, A the longer prefix: media first
    assert best_node(keys, [at("store-b"), at("store-a"), at("store-a"), at("store-a")], node_of) == "B"
    # nobody holds the image: the longest leading run wins, a gap ends a node's run
    assert best_node(keys, [None, at("store-a", "pool-b"), at("store-b"), at("store-a")], node_of) == "B"
    assert best_node(keys, [None, at("store-a", "store-b"), at("store-a"), None], node_of) == "A"
    # a run must start at the first segment; holders of unknown nodes are skipped
    assert best_node(keys, [None, None, at("store-a"), at("store-a")], node_of) is None
    assert best_node(keys, [at("elsewhere"), None, None, None], node_of) is None
