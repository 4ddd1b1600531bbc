"""The Serve app on a real two-node Ray cluster on loopback, driven by the real ``openai``
client (and ``httpx`` for raw bad requests) over its OpenAI chat completions API, with its
default model: the transformers chat model (a small random-weight Qwen2-VL, Whisper for audio)
through mmtier's adapter. Requests are stateless: each carries its conversation's history
(earlier turns and the answers' text, as the client got them).

One module-scoped cluster: a head node and a second node, each with its own custom resource
(``mm_node_0`` / ``mm_node_1``: both nodes share 127.0.0.1, so ``node:<ip>`` cannot tell them
apart); mmtier started on both (a pool held by each node's worker, a store each); the app
deployed with one worker per node. Requests go to 127.0.0.1 only; media are real PNG / JPEG /
WAV bytes and MP4 videos encoded here by PyAV. Answers are checked against the chat layer's dense reference (``dense_chat``:
``DynamicCache`` + sdpa, each turn recomputed), run in this process with the same weights.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import json  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai", reason="the dev extra (openai) is not installed")
httpx = pytest.importorskip("httpx", reason="the dev extra (httpx) is not installed")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("transformers", reason="the hf extra (transformers, Pillow) is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

import mmtier.cluster as mma  # noqa: E402
from mmtier.chat.model import dense_chat  # noqa: E402
from mmtier.serve.app import build_app  # noqa: E402
from mmtier.serve.chat_model import load_chat  # noqa: E402
from mmtier.serve.config import ServeAppConfig  # noqa: E402
from mmtier.serve.engine_loader import load_frontend  # noqa: E402
from tests.support.media_samples import float_wav, image, part, video, wav  # noqa: E402

pytestmark = pytest.mark.ray

NEW = 3
ARGS = {
    "model": {"seed": 0},
    "cache": {"device_bytes": 128 << 20, "allow_default_key_secret": True,  # a local test cluster
              "shares": {"video": 0.05, "video_embed": 0.02}},    # small videos; the rest split evenly
    "cluster": {"call_timeout_s": 60.0, "sweep_interval_s": 2.0},
    "api_keys": {"key-acme": "acme", "key-globex": "globex"},
    "limits": {"max_media_bytes": 48 << 10, "max_request_bytes": 256 << 10, "max_image_pixels": 256 * 256,
               "max_audio_seconds": 5.0, "max_video_seconds": 8.0, "max_video_frames": 40,
               "max_video_pixels": 64 * 64, "max_request_tokens": 2000, "max_new_tokens": 16,
               "default_new_tokens": NEW},
    "affinity": {"pin_resource_prefix": "mm_node_"},
    "workers": {"num_cpus": 0, "turn_wait_s": 0.2},   # a turn's wait for the model (busy)
    "ingress": {"num_cpus": 0},
}
PNG = image(1, (64, 48))
JPEG = image(2, (80, 60), "JPEG")
CLIP = wav(1, 0.5)
MP4 = video(1, frames=12, size=(56, 56), fps=2)     # 6 s sampled at 2 fps: 6 temporal patches, 3 segments
MODEL = ServeAppConfig.parse(ARGS).model
NAME = ServeAppConfig.parse(ARGS).served_model_name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url():
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"mm_node_0": 1}, "object_store_memory": 100 << 20,
        "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"mm_node_1": 1}, object_store_memory=100 << 20)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="mmtier", include_dashboard=False, log_to_driver=False)
    port = _free_port()
    settings = ServeAppConfig.parse(ARGS).settings()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        serve.run(build_app(ARGS), name="mmtier", route_prefix="/", blocking=False)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        mma.shutdown(settings)
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def chat():
    return load_chat(MODEL)          # the workers' weights (same seed), for the dense reference


def dense(chat, *turns) -> list[list[int]]:
    return dense_chat(chat, [[p if isinstance(p, str) else p[1] for p in t] for t in turns], NEW)


def client(url: str, key: str = "key-acme"):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=180)


def messages(history, items) -> list[dict]:
    """``history``: earlier turns as ``(items, answer text)``; ``items``: the turn to answer.
    Items: text, or ``(type, bytes)`` / ``(type, bytes, {"media_type": ...})``."""
    out = []
    for turn, answer in history:
        out += [{"role": "user", "content": [part(i) for i in turn]}, {"role": "assistant", "content": answer}]
    return out + [{"role": "user", "content": [part(i) for i in items]}]


class Answer:
    """A completion as the client got it, and mmtier's extra figures."""

    def __init__(self, resp):
        self.resp = resp
        self.text = resp.choices[0].message.content
        self.usage = resp.usage
        self.cached = resp.usage.prompt_tokens_details.cached_tokens
        self.mm = resp.model_extra["mmtier"]
        self.tokens, self.node = self.mm["tokens"], self.mm["node"]
        self.counts, self.rule = self.mm["cache"]["counts"], self.mm["routing"]["rule"]


def ask(url: str, items, history=(), key: str = "key-acme", new: int = NEW) -> Answer:
    resp = client(url, key).chat.completions.create(model=NAME, messages=messages(history, items), max_tokens=new)
    assert resp.object == "chat.completion" and resp.usage.completion_tokens == len(resp.model_extra["mmtier"]["tokens"])
    return Answer(resp)


def refused(url: str, items, history=(), key: str = "key-acme", new: int = NEW):
    """The ``openai`` client's error for a request the app refuses."""
    with pytest.raises(openai.APIStatusError) as err:
        ask(url, items, history, key, new)
    return err.value


def post(url: str, body=None, raw: bytes | None = None, key: str | None = "key-acme", header: str = "bearer",
         method: str = "POST", path: str = "/v1/chat/completions") -> tuple[int, dict]:
    """A raw request (``httpx``): for bodies the ``openai`` client would not send."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers.update({"Authorization": f"Bearer {key}"} if header == "bearer" else {"X-API-Key": key})
    content = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    r = httpx.request(method, url + path, content=content, headers=headers, timeout=180)
    return r.status_code, r.json()


def body(*items, history=(), new: int = NEW, **fields) -> dict:
    return {"model": NAME, "messages": messages(history, items), "max_tokens": new, **fields}


def workers_state() -> dict:
    """Per worker node: the digests of the groups its pool holds."""
    from mmtier.cluster.engine_pool import host_name
    from mmtier.serve.routing import pin_targets

    ns = ServeAppConfig.parse(ARGS).settings().namespace
    out = {}
    for t in pin_targets(ray.nodes(), "mm_node_"):
        h = ray.get_actor(host_name(t.node), namespace=ns)
        inventory = ray.get(h.inventory.remote(), timeout=60)
        out[t.node] = sorted((i["key"]["digest"], i["tier"]) for i in inventory)
    return out


def test_health_models_and_auth(url):
    status, health = post(url, key=None, method="GET", path="/healthz")
    assert status == 200 and health["workers"] == 2
    assert [m.id for m in client(url).models.list().data] == [NAME]
    status, err = post(url, body("hi"), key=None)
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError) as bad_key:
        ask(url, ["hi"], key="no-such-key")
    assert bad_key.value.code == "invalid_api_key" and bad_key.value.type == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(url, "no-such-key").models.list()
    status, answer = post(url, body("hi"), key="key-globex", header="x-api-key")
    assert status == 200 and answer["object"] == "chat.completion", answer
    a = ask(url, ["hi"], key="key-globex")
    assert a.usage.completion_tokens == NEW and isinstance(a.text, str) and a.tokens == answer["mmtier"]["tokens"]
    assert a.resp.choices[0].finish_reason == "length" and a.resp.model == NAME


def _media_over_token_limit() -> dict:
    """Text and two images that fit the request's token limit; a third image pushes it over."""
    big = image(9, (224, 224), flat=True)
    cost = load_frontend(MODEL).media_tokens("image", big)
    assert cost > 60                                      # 64 image tokens and two markers
    history = [(["b" * 500], "c")]                       # 501 tokens of history count too
    text = "a" * (ARGS["limits"]["max_request_tokens"] - NEW - 2 * cost - 501)
    return body(text, *[("image", big)] * 3, history=history)


BAD = {
    "malformed_json": (400, "malformed_json"),
    "bad_base64": (400, "bad_base64"),
    "unknown_part_type": (400, "unknown_content_type"),
    "tenant_in_body": (400, "tenant_in_body"),
    "unknown_field": (400, "bad_request"),
    "other_model": (404, "model_not_found"),
    "too_many_tokens": (400, "bad_request"),
    "zero_new_tokens": (400, "bad_request"),
    "sampling": (400, "bad_request"),
    "last_is_assistant": (400, "bad_request"),
    "http_image_url": (400, "unsupported_url"),
    "oversized_media": (413, "too_large"),
    "oversized_body": (413, "too_large"),
    "huge_body_2mb": (413, "too_large"),
    "huge_text_item": (413, "too_large"),
    "multibyte_text_item": (413, "too_large"),
    "request_over_token_limit": (413, "too_large"),
    "media_over_token_limit": (413, "too_large"),
    "too_many_media": (400, "bad_request"),
    "lone_surrogate": (400, "bad_request"),
    "truncated_png": (400, "bad_media"),
    "not_an_image": (400, "bad_media"),
    "gif": (415, "unsupported_media_type"),
    "image_over_pixel_limit": (413, "too_large"),
    "declared_type_mismatch": (415, "unsupported_media_type"),
    "truncated_wav": (400, "bad_media"),
    "float_wav": (415, "unsupported_media_type"),
    "mp3_format": (415, "unsupported_media_type"),
    "audio_over_seconds": (413, "too_large"),
    "truncated_mp4": (400, "bad_media"),
    "webm_video": (415, "unsupported_media_type"),
    "quicktime_video": (415, "unsupported_media_type"),
    "video_over_seconds": (413, "too_large"),
    "video_over_pixel_limit": (413, "too_large"),
}


def _bad(case: str, history=()) -> tuple[dict | None, bytes | None]:
    req, raw = None, None
    items = {
        "truncated_png": ("see ", ("image", PNG[: len(PNG) // 2])),
        "not_an_image": ("see ", ("image", b"\x89PNG but not really" * 10)),
        "gif": ("see ", ("image", image(3, (16, 16), "GIF"), {"media_type": "image/gif"})),
        "image_over_pixel_limit": ("see ", ("image", image(4, (257, 256)))),
        "declared_type_mismatch": ("see ", ("image", PNG, {"media_type": "image/jpeg"})),
        "truncated_wav": ("hear ", ("audio", CLIP[:-11])),
        "float_wav": ("hear ", ("audio", float_wav())),
        "mp3_format": ("hear ", ("audio", CLIP, {"media_type": "audio/mpeg"})),
        "audio_over_seconds": ("hear ", ("audio", wav(5, 5.5, rate=4000))),
        "truncated_mp4": ("watch ", ("video", MP4[: len(MP4) // 2])),
        "webm_video": ("watch ", ("video", video(2, frames=4, fmt="webm"))),
        "quicktime_video": ("watch ", ("video", video(2, frames=4, fmt="mov"))),
        "video_over_seconds": ("watch ", ("video", video(3, frames=9, size=(16, 16), fps=1))),
        "video_over_pixel_limit": ("watch ", ("video", video(3, frames=4, size=(80, 64)))),
        "oversized_media": ("hi", ("image", bytes(50_000))),
        "huge_text_item": ("y" * (200 << 10),),          # under the body limit, over the text limit
        "multibyte_text_item": ("\u20ac" * 1500,),       # 1500 characters, 4500 UTF-8 bytes (tokens)
        "request_over_token_limit": ("z" * 700, "z" * 700, "z" * 700),   # each fits; together over
        "too_many_media": tuple([("image", image(1, (4, 4), flat=True))] * 70),
    }.get(case)
    if items is not None:
        req = body(*items, history=history)
    elif case == "malformed_json":
        raw = b'{"model": "mmtier-chat", "messages": [{"role": "user", "content": "hi"}'
    elif case == "bad_base64":
        req = body("x", history=history)
        req["messages"][-1]["content"].append({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}})
    elif case == "unknown_part_type":
        req = body("x", history=history)
        req["messages"][-1]["content"].append({"type": "document", "document": {"data": "MTIz"}})
    elif case == "tenant_in_body":
        req = body("hi", history=history, tenant="globex")
    elif case == "unknown_field":
        req = body("hi", history=history, tools=[])
    elif case == "other_model":
        req = {**body("hi", history=history), "model": "gpt-4o"}
    elif case == "too_many_tokens":
        req = body("hi", history=history, new=17)
    elif case == "zero_new_tokens":        # the chat model answers at least one token
        req = body("hi", history=history, new=0)
    elif case == "sampling":
        req = body("hi", history=history, temperature=0.8)
    elif case == "last_is_assistant":
        req = body("hi", history=history)
        req["messages"].append({"role": "assistant", "content": "ok"})
    elif case == "http_image_url":
        req = body("x", history=history)
        req["messages"][-1]["content"].append({"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}})
    elif case == "oversized_body":
        raw = b" " * (300 << 10)
    elif case == "huge_body_2mb":          # the shape that once reached the decoder: 500
        raw = json.dumps(body("x" * (2 << 20))).encode()
    elif case == "media_over_token_limit":
        req = _media_over_token_limit()
    elif case == "lone_surrogate":
        raw = b'{"model": "mmtier-chat", "messages": [{"role": "user", "content": "\\ud800"}]}'
    return req, raw


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_requests_are_openai_errors(url, case):
    req, raw = _bad(case)
    got, answer = post(url, req, raw=raw)
    assert (got, answer["error"]["code"]) == BAD[case], answer
    err = answer["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("not_found_error" if got == 404 else "invalid_request_error")


def test_the_openai_client_raises_its_typed_errors(url):
    """The same refusals through the ``openai`` client: its exception classes, status, code
    and param from the OpenAI-shaped body."""
    err = refused(url, ["see ", ("image", PNG[: len(PNG) // 2])])
    assert isinstance(err, openai.BadRequestError) and err.code == "bad_media"
    assert err.param == "messages[0].content[1]"
    err = refused(url, ["see ", ("image", image(3, (16, 16), "GIF"), {"media_type": "image/gif"})])
    assert err.status_code == 415 and err.code == "unsupported_media_type"
    err = refused(url, ["see ", ("image", image(4, (257, 256)))])
    assert err.status_code == 413 and err.code == "too_large"
    with pytest.raises(openai.NotFoundError) as missing:
        client(url).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


def test_bad_media_changes_nothing(url, chat):
    """Bad media in a new request or in one that carries a conversation: a 4xx, nothing stored
    anywhere; the conversation's next good request attaches its first turn and equals dense."""
    t1 = ["Hello. ", ("image", JPEG, {"media_type": "image/jpeg"}), " what?"]
    first = ask(url, t1)
    history = [(t1, first.text)]
    before = workers_state()
    for case in ("truncated_png", "gif", "truncated_wav", "float_wav", "image_over_pixel_limit", "truncated_mp4",
                 "webm_video"):
        for h in ((), history):
            req, raw = _bad(case, h)
            got, answer = post(url, req, raw=raw)
            assert (got, answer["error"]["code"]) == BAD[case], answer
    bad_history = [(["Hello. ", ("image", PNG[: len(PNG) // 2])], first.text)]       # bad media in the history
    got, answer = post(url, body("and?", history=bad_history))
    assert (got, answer["error"]["code"]) == (400, "bad_media"), answer
    assert workers_state() == before
    t2 = ["and ", ("audio", CLIP)]
    second = ask(url, t2, history)
    assert second.node == first.node and second.rule == "content"
    assert second.cached == first.usage.prompt_tokens + NEW - 1 > 0
    assert [first.tokens, second.tokens] == dense(chat, t1, t2)


def test_a_conversation_of_stateless_requests_matches_dense_and_reuses_its_history(url, chat):
    """Each request carries the conversation so far, the answers as the client got their text;
    the history's groups are found by key on the node that holds them (routing rule content),
    ``usage.prompt_tokens_details.cached_tokens`` counts them (all of the history but the last
    answer token), and every answer equals the dense model's. Another tenant sending the very
    same messages hits none of acme's groups."""
    t1 = ["Look: ", ("image", PNG, {"media_type": "image/png"}), " what is it?"]
    t2 = ["and this: ", ("audio", wav(2, 0.5))]          # a clip no test sent before
    t3 = ["so?"]
    a1 = ask(url, t1)
    media = a1.mm["cache"]["media"][0]
    assert media["media_type"] == "image/png" and len(media["sha256"]) == 64
    assert a1.counts["encoder_runs"] == {"image": 1} and a1.cached == 0
    a2 = ask(url, t2, [(t1, a1.text)])
    assert a2.rule == "content" and a2.node == a1.node
    assert a2.counts["encoder_runs"] == {"audio": 1} and a2.counts["transcript_tokens"] > 0
    assert a2.cached == a1.usage.prompt_tokens + NEW - 1 == a2.counts["cached_tokens"]
    assert a2.usage.prompt_tokens == a2.cached + a2.counts["prefilled_tokens"]
    history = [(t1, a1.text), (t2, a2.text)]
    a3 = ask(url, t3, history)
    assert a3.node == a1.node and a3.counts["encoder_runs"] == {}
    assert a3.cached == a2.usage.prompt_tokens + NEW - 1
    assert [a1.tokens, a2.tokens, a3.tokens] == dense(chat, t1, t2, t3)
    other = ask(url, t3, history, key="key-globex")                    # the same messages, globex
    assert other.cached == 0 and other.counts["encoder_runs"] == {"image": 1, "audio": 1}
    assert other.tokens == a3.tokens


def test_streaming_answers_as_server_sent_events_with_usage(url, chat):
    """``stream: true`` with ``stream_options.include_usage``: the client's chunks join to the
    answer (its tokens as the dense model's), the last chunk carries ``usage`` with the cached
    tokens of the history."""
    t1, t2 = ["Tell me: "], ["more, with a \u20ac"]
    first = ask(url, t1)
    stream = client(url).chat.completions.create(model=NAME, messages=messages([(t1, first.text)], t2),
                                                 max_tokens=8, stream=True, stream_options={"include_usage": True})
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    from mmtier.chat.media import ids_text, text_ids

    want = dense_chat(chat, [t1, t2], 8)
    assert first.tokens == dense_chat(chat, [t1], NEW)[0]
    assert text_ids("".join(parts)) == want[1] and "".join(parts) == ids_text(want[1])
    assert finish == "length" and usage.completion_tokens == 8
    assert usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + NEW - 1
    status, raw = None, b""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body(*t2, history=[(t1, first.text)], stream=True),
                      headers={"Authorization": "Bearer key-acme"}, timeout=180) as r:
        status = r.status_code
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")


def test_video_requests_match_dense_and_a_repeated_video_runs_no_vision_tower(url, chat):
    """An MP4 item (a ``video_url`` data URL): decoded at the ingress, its frames sampled and
    encoded by the worker; the same video at a new place of the conversation reuses its
    segments' tower outputs, and a new conversation with the same opening goes to the node that
    holds them and attaches its segments' decoder K/V. Every answer equals the dense path's."""
    t1 = ["Watch: ", ("video", MP4, {"media_type": "video/mp4"}), " what happens?"]
    t2 = ["and again: ", ("video", MP4)]
    a1 = ask(url, t1)
    media = a1.mm["cache"]["media"][0]
    assert (media["type"], media["media_type"], media["cached"]) == ("video", "video/mp4", False)
    assert a1.counts["encoder_runs"] == {"video": 1}           # one tower run, 3 segments
    a2 = ask(url, t2, [(t1, a1.text)])
    assert [m["cached"] for m in a2.mm["cache"]["media"]] == [True, True]
    assert a2.counts["encoder_runs"] == {} and a2.counts["embedding_hits"] == {"video": 3}
    assert [a1.tokens, a2.tokens] == dense(chat, t1, t2)
    a3 = ask(url, t1)                                             # a new conversation
    assert a3.rule == "content" and a3.node == a1.node
    assert a3.counts["encoder_runs"] == {} and a3.counts["media_hits"] == {"video": 3}
    assert a3.tokens == a1.tokens and a3.cached > 0
    other = ask(url, t1, key="key-globex")                        # another tenant: no hit
    assert other.counts["encoder_runs"] == {"video": 1} and other.cached == 0
    assert other.mm["cache"]["media"][0]["cached"] is False and other.tokens == a1.tokens


def _opening_off(url: str, home: str, text: str, key: str = "key-acme") -> tuple[list, Answer]:
    """A text-only opening (no prefix to route by: least-loaded rotation) sent until one lands
    off ``home``."""
    for i in range(6):
        turn = [f"{i}. {text}"]
        opening = ask(url, turn, key=key)
        if opening.node != home:
            return turn, opening
    raise AssertionError("the rotation never used the other node")


def test_other_node_fetches_the_groups_once_and_skips_the_encoders(url, chat):
    """An image's vision-tower output and a clip's transcript (content-only groups) held on one
    node: a conversation whose long opening lives on the other node goes on there (its history
    outweighs the media) with the same image and clip, pulls each group whole (one lookup, one
    fetch per group, one publish) and runs no vision tower and no audio encoder; its answers
    equal the dense ones."""
    png, clip = image(20, (72, 56)), wav(21, 0.6)
    turn = ["Look: ", ("image", png), " and listen: ", ("audio", clip)]
    first = ask(url, turn)
    assert first.counts["encoder_runs"] == {"image": 1, "audio": 1}, first.mm
    t0, opening = _opening_off(url, first.node, _text(60, 300))
    second = ask(url, turn, [(t0, opening.text)])
    assert second.rule == "content" and second.node == opening.node != first.node, second.mm["routing"]
    assert [m["cached"] for m in second.mm["cache"]["media"]] == [True, True]
    assert [m["nodes"] for m in second.mm["cache"]["media"]] == [[first.node]] * 2
    assert second.counts["encoder_runs"] == {}
    assert second.counts["embedding_hits"] == {"image": 1} and second.counts["media_hits"] == {"audio": 1}
    assert second.mm["cache"]["traffic"] == {"lookup": 1, "fetch": 2, "publish": 1}, second.mm["cache"]
    third = ask(url, ["And now?"], [(t0, opening.text), (turn, second.text)])
    assert third.node == opening.node and not {"lookup", "fetch"} & set(third.mm["cache"]["traffic"])
    assert [opening.tokens, second.tokens, third.tokens] == dense(chat, t0, turn, ["And now?"])
    # a new conversation with the image goes where it is held (now both nodes) and reuses it
    fourth = ask(url, ["New: ", ("image", png)])
    assert fourth.rule == "content" and fourth.counts["encoder_runs"] == {}
    assert fourth.mm["cache"]["traffic"].get("fetch", 0) == 0


def _clip_on_each_node(url: str, seed: int) -> dict[str, bytes]:
    """globex's new clips, sent until the least-loaded rotation put one on each node."""
    placed: dict[str, bytes] = {}
    for i in range(6):
        clip = wav(seed + i, 0.3)
        placed.setdefault(ask(url, ["Hear: ", ("audio", clip)], key="key-globex").node, clip)
        if len(placed) == 2:
            return placed
    raise AssertionError("the least-loaded rotation should use both nodes")


def test_new_conversations_follow_their_clip_and_tenants_do_not_share(url):
    """New conversations land by rotation on both nodes; each repeat of a clip goes to the node
    that holds it; another tenant's same clip is a miss there."""
    placed = _clip_on_each_node(url, 30)
    for node, clip in placed.items():
        again = ask(url, ["Again: ", ("audio", clip)], key="key-globex")
        assert (again.rule, again.node) == ("content", node)
        assert again.counts["media_hits"] == {"audio": 1} and again.counts["encoder_runs"] == {}
        other = ask(url, ["Again: ", ("audio", clip)])          # acme: no hit
        assert other.mm["cache"]["hit"] is False and other.counts["encoder_runs"] == {"audio": 1}


def _worker(node: str):
    from mmtier.cluster.engine_pool import host_name

    return ray.get_actor(host_name(node), namespace=ServeAppConfig.parse(ARGS).settings().namespace)


def _assert_no_leak(worker) -> None:
    """The worker's pool holds no sequence, lease or page outside a cached group."""
    report = ray.get(worker.leak_report.remote(), timeout=60)
    assert report["sequences"] == 0 and report["leases"] == 0, report
    assert report["used_pages"] == report["cached_pages"], report


def _text(seed: int, n: int) -> str:
    """``n`` seeded ASCII letters: ``n`` tokens of the byte-level vocabulary, new to the cache."""
    import random
    import string

    return "".join(random.Random(seed).choices(string.ascii_lowercase + " ", k=n))


def test_no_room_for_a_request_is_503_capacity_and_the_conversation_goes_on(url, chat):
    """A request attaches its conversation's whole history (pinned while it runs) and adds its
    turn's tokens in the text pool. Turns of 590 text tokens: two fit a worker's text pool, the
    third does not: 503 ``capacity`` with the OpenAI-shaped error, the worker keeps no sequence
    or page of it, and the conversation goes on: its next short request attaches the two turns
    that succeeded and equals their dense reference, as if the failed one was never sent."""
    n = 590
    t1, t2, t3, t4 = [_text(50, n)], [_text(51, n)], [_text(52, n)], ["and now?"]
    a1 = ask(url, t1)
    worker = _worker(a1.node)
    text = ray.get(worker.stats.remote(), timeout=60)["tiers"]["device"]["text"]
    pages = text["capacity_bytes"] // chat.cache_config().spec("text").page_bytes
    per_turn = -(-(n + NEW) // 16)                              # a turn's span, in 16-token pages
    assert 2 * per_turn + 1 <= pages < 3 * per_turn             # the setup: two fit, three do not
    a2 = ask(url, t2, [(t1, a1.text)])
    assert a2.node == a1.node
    history = [(t1, a1.text), (t2, a2.text)]
    err = refused(url, t3, history)
    assert isinstance(err, openai.InternalServerError) and err.status_code == 503
    assert (err.code, err.type) == ("capacity", "service_unavailable_error")
    assert "text pool" in err.message and "send it again, or a shorter one" in err.message
    _assert_no_leak(worker)
    a4 = ask(url, t4, history)
    assert a4.node == a1.node and a4.cached == a2.usage.prompt_tokens + NEW - 1
    assert [a1.tokens, a2.tokens, a4.tokens] == dense(chat, t1, t2, t4)
    _assert_no_leak(worker)


def test_two_requests_at_once_on_one_worker_one_is_503_busy(url, chat):
    """The chat model takes one request at a time per worker. Two conversations opened on one
    node (by rotation); their long second requests (each holds the model for seconds), sent at
    once, both go there (their history is there): whichever comes second waits
    ``workers.turn_wait_s`` (0.2 s) and gets 503 ``busy`` with nothing of it run; the other
    answers. The busy one, sent again, equals dense."""
    from concurrent.futures import ThreadPoolExecutor

    new = ARGS["limits"]["max_new_tokens"]
    opened: list[tuple[list, Answer]] = []
    for i in range(3):                           # the rotation puts two of three on one node
        turn = [f"Hi {i}."]
        opened.append((turn, ask(url, turn, new=new)))
        pair = [(t, a) for t, a in opened if a.node == opened[-1][1].node]
        if len(pair) == 2:
            break
    n = 584
    second = [[_text(70 + i, n)] for i in range(2)]
    histories = [[(t, a.text)] for t, a in pair]
    with ThreadPoolExecutor(2) as pool:
        sent = [pool.submit(post, url, body(*second[i], history=histories[i], new=new)) for i in range(2)]
        got = [f.result() for f in sent]
    assert sorted(s for s, _ in got) == [200, 503], got
    (busy, (_, err)), = [(i, r) for i, r in enumerate(got) if r[0] == 503]
    assert set(err) == {"error"} and err["error"]["code"] == "busy", err
    assert "busy with other requests for 0.2 s" in err["error"]["message"]
    worker = _worker(pair[0][1].node)
    _assert_no_leak(worker)
    again = ask(url, second[busy], histories[busy], new=new)
    assert again.node == pair[busy][1].node
    answers = [again.tokens if i == busy else got[i][1]["mmtier"]["tokens"] for i in range(2)]
    for i, (turn, first) in enumerate(pair):
        assert [first.tokens, answers[i]] == dense_chat(chat, [turn, second[i]], new)
    _assert_no_leak(worker)


def test_cli_start_and_status_on_the_running_cluster(url, tmp_path):
    import yaml
    from click.testing import CliRunner

    from mmtier.cli import main

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({"applications": [
        {"name": "mmtier", "import_path": "mmtier.serve.app:build_app", "args": ARGS}]}))
    result = CliRunner().invoke(main, ["start", "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    assert "existing" in result.output and "created" not in result.output    # idempotent
    result = CliRunner().invoke(main, ["status"])
    assert result.exit_code == 0, result.output
    assert result.output.count("pool ") >= 2 and "hit ratio" in result.output
    assert "transcript" in result.output and "audio" in result.output


def test_killing_a_worker_loses_only_its_pool(url, chat):
    """A worker dies: the registry forgets its pool's groups (it restarts empty), the other
    node's groups still serve, and the next requests succeed (recomputing what was lost): a
    request sent to the restarting worker fails over to the other node (stateless: nothing of
    the conversation was the worker's)."""
    from mmtier.cluster.engine_pool import host_name

    settings = ServeAppConfig.parse(ARGS).settings()
    clips = _clip_on_each_node(url, 40)
    (dead, clip_dead), (alive, clip_alive) = sorted(clips.items())
    cc = mma.connect(settings)
    frontend = load_frontend(MODEL)
    key = lambda clip: frontend.routing_keys(cc, "globex", "audio", clip)[0]  # noqa: E731
    deadline = time.monotonic() + 10
    while cc.locate(key(clip_dead)) is None and time.monotonic() < deadline:
        time.sleep(0.2)                                   # the request's publish is fire-and-forget
    assert cc.locate(key(clip_dead)) is not None
    ray.kill(ray.get_actor(host_name(dead), namespace=settings.namespace), no_restart=False)
    deadline = time.monotonic() + 90
    while cc.locate(key(clip_dead)) is not None and time.monotonic() < deadline:
        time.sleep(0.5)                                   # the restarted worker announces an empty pool
    assert cc.locate(key(clip_dead)) is None
    assert host_name(alive) in {h for h, _ in cc.locate(key(clip_alive)).holders}
    again = ask(url, ["Again: ", ("audio", clip_alive)], key="key-globex")
    assert again.node == alive and again.counts["media_hits"] == {"audio": 1}
    lost = ask(url, ["Again: ", ("audio", clip_dead)], key="key-globex")
    assert lost.rule in ("least_loaded", "failover")
    assert lost.counts["encoder_runs"] == {"audio": 1}       # recomputed
    assert lost.tokens == dense(chat, ["Again: ", ("audio", clip_dead)])[0]
    cc.close()
