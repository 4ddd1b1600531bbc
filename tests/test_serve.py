"""The Serve app on a real two-node Ray cluster on loopback, driven by real HTTP requests, with
its default model: the transformers chat model (a small random-weight Qwen2-VL, Whisper for
audio) through mmtier's adapter.

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

import base64  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402

import pytest  # noqa: E402

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("transformers", reason="the hf extra (transformers, Pillow) is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

import mmtier.actors as mma  # noqa: E402
from mmtier.integrations.chat import dense_chat  # noqa: E402
from mmtier.serve.app import build_app  # noqa: E402
from mmtier.serve.config import ServeAppConfig  # noqa: E402
from mmtier.serve.engines import load_frontend  # noqa: E402
from mmtier.serve.hf_engine import load_chat  # noqa: E402

from .media_samples import float_wav, image, video, wav  # noqa: E402

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
               "max_video_pixels": 64 * 64, "max_turn_tokens": 600, "max_new_tokens": 16,
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


def call(url: str, body, key: str | None = "key-acme", header: str = "bearer", method: str = "POST",
         path: str = "/v1/turn", raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header(*(("Authorization", f"Bearer {key}") if header == "bearer" else ("X-API-Key", key)))
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def turn(*items, conv: str | None = None, new: int = NEW) -> dict:
    """Items: text, or ``(type, bytes)`` / ``(type, bytes, media_type)``."""
    content = [{"type": "text", "text": i} if isinstance(i, str)
               else {"type": i[0], "data": b64(i[1]), **({"media_type": i[2]} if len(i) > 2 else {})}
               for i in items]
    body = {"content": content, "max_new_tokens": new}
    if conv is not None:
        body["conversation_id"] = conv
    return body


def workers_state() -> dict:
    """Per worker node: its open conversations and the digests of the groups its pool holds."""
    from mmtier.actors.pool_host import host_name
    from mmtier.serve.routing import pin_targets

    ns = ServeAppConfig.parse(ARGS).settings().namespace
    out = {}
    for t in pin_targets(ray.nodes(), "mm_node_"):
        h = ray.get_actor(host_name(t.node), namespace=ns)
        info, inventory = ray.get([h.info.remote(), h.inventory.remote()], timeout=60)
        out[t.node] = (info["conversations"], sorted((i["key"]["digest"], i["tier"]) for i in inventory))
    return out


def test_health_and_auth(url):
    status, body = call(url, None, key=None, method="GET", path="/healthz")
    assert status == 200 and body["workers"] == 2
    ok = turn("hi")
    assert call(url, ok, key=None)[0] == 401
    status, body = call(url, ok, key="no-such-key")
    assert status == 401 and body["error"]["status"] == 401
    status, body = call(url, ok, key="key-globex", header="x-api-key")
    assert status == 200 and len(body["tokens"]) == NEW and isinstance(body["text"], str)


def _media_over_token_limit() -> dict:
    """Text and two images that fit the turn's token limit; a third image pushes it over."""
    big = image(9, (224, 224), flat=True)
    cost = load_frontend(MODEL).media_tokens("image", big)
    assert cost > 60                                      # 64 image tokens and two markers
    text = "a" * (ARGS["limits"]["max_turn_tokens"] - NEW - 2 * cost)
    return turn(text, *[("image", big)] * 3)


BAD = {
    "malformed_json": (400, "malformed_json"),
    "bad_base64": (400, "bad_base64"),
    "unknown_kind": (400, "unknown_media_kind"),
    "tenant_in_body": (400, "tenant_in_body"),
    "unknown_field": (400, "bad_request"),
    "too_many_tokens": (400, "bad_request"),
    "zero_new_tokens": (400, "bad_prompt"),
    "oversized_media": (413, "too_large"),
    "oversized_body": (413, "too_large"),
    "huge_body_2mb": (413, "too_large"),
    "huge_text_item": (413, "too_large"),
    "multibyte_text_item": (413, "too_large"),
    "turn_over_token_limit": (413, "too_large"),
    "media_over_token_limit": (413, "too_large"),
    "too_many_media": (400, "bad_request"),
    "lone_surrogate": (400, "bad_request"),
    "unknown_conversation": (404, "unknown_conversation"),
    "truncated_png": (400, "bad_media"),
    "not_an_image": (400, "bad_media"),
    "gif": (415, "unsupported_media_type"),
    "image_over_pixel_limit": (413, "too_large"),
    "declared_type_mismatch": (415, "unsupported_media_type"),
    "truncated_wav": (400, "bad_media"),
    "float_wav": (415, "unsupported_media_type"),
    "audio_over_seconds": (413, "too_large"),
    "truncated_mp4": (400, "bad_media"),
    "webm_video": (415, "unsupported_media_type"),
    "quicktime_video": (415, "unsupported_media_type"),
    "video_over_seconds": (413, "too_large"),
    "video_over_pixel_limit": (413, "too_large"),
}


def _bad(case: str, conv: str | None = None) -> tuple[dict | None, bytes | None]:
    body, raw = None, None
    if case == "malformed_json":
        raw = b'{"content": [{"type": "text", "text": "hi"}'
    elif case == "bad_base64":
        body = {"content": [{"type": "image", "data": "not base64 !!"}]}
    elif case == "unknown_kind":
        body = {"content": [{"type": "document", "data": b64(b"1234")}]}
    elif case == "tenant_in_body":
        body = {**turn("hi"), "tenant": "globex"}
    elif case == "unknown_field":
        body = {**turn("hi"), "temperature": 0.5}
    elif case == "too_many_tokens":
        body = turn("hi", new=17)
    elif case == "zero_new_tokens":        # the chat model answers at least one token
        body = turn("hi", new=0)
    elif case == "oversized_media":
        body = turn("hi", ("image", bytes(50_000)))
    elif case == "oversized_body":
        raw = b" " * (300 << 10)
    elif case == "huge_body_2mb":          # the shape that once reached the decoder: 500
        raw = json.dumps(turn("x" * (2 << 20))).encode()
    elif case == "huge_text_item":         # under the body limit, over the per-item text limit
        body = turn("y" * (200 << 10))
    elif case == "multibyte_text_item":    # 1500 characters, 4500 UTF-8 bytes (tokens)
        body = turn("\u20ac" * 1500)
    elif case == "turn_over_token_limit":  # each item fits; together over max_turn_tokens
        body = turn(*["z" * 400] * 3)
    elif case == "media_over_token_limit":
        body = _media_over_token_limit()
    elif case == "too_many_media":
        body = turn(*[("image", image(1, (4, 4), flat=True))] * 40)
    elif case == "lone_surrogate":
        raw = b'{"content": [{"type": "text", "text": "\\ud800"}]}'
    elif case == "unknown_conversation":
        body = turn("hi", conv="w0.deadbeef")
    elif case == "truncated_png":
        body = turn("see ", ("image", PNG[: len(PNG) // 2]))
    elif case == "not_an_image":
        body = turn("see ", ("image", b"\x89PNG but not really" * 10))
    elif case == "gif":
        body = turn("see ", ("image", image(3, (16, 16), "GIF")))
    elif case == "image_over_pixel_limit":
        body = turn("see ", ("image", image(4, (257, 256))))
    elif case == "declared_type_mismatch":
        body = turn("see ", ("image", PNG, "image/jpeg"))
    elif case == "truncated_wav":
        body = turn("hear ", ("audio", CLIP[:-11]))
    elif case == "float_wav":
        body = turn("hear ", ("audio", float_wav()))
    elif case == "audio_over_seconds":
        body = turn("hear ", ("audio", wav(5, 5.5, rate=4000)))
    elif case == "truncated_mp4":
        body = turn("watch ", ("video", MP4[: len(MP4) // 2]))
    elif case == "webm_video":
        body = turn("watch ", ("video", video(2, frames=4, fmt="webm")))
    elif case == "quicktime_video":
        body = turn("watch ", ("video", video(2, frames=4, fmt="mov")))
    elif case == "video_over_seconds":
        body = turn("watch ", ("video", video(3, frames=9, size=(16, 16), fps=1)))
    elif case == "video_over_pixel_limit":
        body = turn("watch ", ("video", video(3, frames=4, size=(80, 64))))
    if conv is not None and body is not None and case != "unknown_conversation":
        body["conversation_id"] = conv
    return body, raw


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_requests(url, case):
    body, raw = _bad(case)
    got, answer = call(url, body, raw=raw)
    assert (got, answer["error"]["type"]) == BAD[case], answer
    assert answer["error"]["status"] == got and answer["error"]["message"]


def test_bad_media_changes_nothing(url, chat):
    """Bad media in a new turn or in an open conversation: a 4xx, no conversation opened or
    advanced, no group stored anywhere; the conversation's next good turn is its second."""
    s, first = call(url, turn("Hello. ", ("image", JPEG), " what?"))
    assert s == 200, first
    conv = first["conversation_id"]
    before = workers_state()
    for case in ("truncated_png", "gif", "truncated_wav", "float_wav", "image_over_pixel_limit", "truncated_mp4",
                 "webm_video"):
        for c in (None, conv):
            body, raw = _bad(case, c)
            got, answer = call(url, body, raw=raw)
            assert (got, answer["error"]["type"]) == BAD[case], answer
    assert workers_state() == before
    s, second = call(url, turn("and ", ("audio", CLIP), conv=conv))
    assert s == 200 and second["turn"] == 2, second
    assert [first["tokens"], second["tokens"]] == dense(chat, ["Hello. ", ("image", JPEG), " what?"],
                                                        ["and ", ("audio", CLIP)])


def test_conversation_turns_with_png_and_wav_match_dense(url, chat):
    t1 = ["Look: ", ("image", PNG, "image/png"), " what is it?"]
    t2 = ["and this: ", ("audio", wav(2, 0.5), "audio/wav")]     # a clip no test sent before
    t3 = ["so?"]
    s, a1 = call(url, turn(*t1))
    assert s == 200, a1
    conv = a1["conversation_id"]
    assert a1["cache"]["media"][0]["media_type"] == "image/png" and len(a1["cache"]["media"][0]["sha256"]) == 64
    assert a1["cache"]["counts"]["encoder_runs"] == {"image": 1}
    s, a2 = call(url, turn(*t2, conv=conv))
    assert s == 200, a2
    assert a2["routing"]["rule"] == "conversation" and a2["node"] == a1["node"] and a2["turn"] == 2
    counts = a2["cache"]["counts"]
    assert counts["encoder_runs"] == {"audio": 1} and counts["transcript_tokens"] > 0
    assert counts["cached_tokens"] > 0                  # turn 1 and its answer: attached, not prefilled
    s, a3 = call(url, turn(*t3, conv=conv))
    assert s == 200 and a3["cache"]["counts"]["encoder_runs"] == {}, a3
    assert [a1["tokens"], a2["tokens"], a3["tokens"]] == dense(chat, t1, t2, t3)
    # another tenant cannot use (or learn of) acme's conversation
    assert call(url, turn("x", conv=conv), key="key-globex")[0] == 404
    assert call(url, None, method="DELETE", path=f"/v1/conversations/{conv}")[0] == 200
    assert call(url, turn("x", conv=conv))[0] == 404


def test_video_turns_over_http_match_dense_and_a_repeated_video_runs_no_vision_tower(url, chat):
    """An MP4 item: decoded at the ingress, its frames sampled and encoded by the worker; the
    same video at a new place of the conversation reuses its segments' tower outputs, and a new
    conversation with the same opening goes to the node that holds them and attaches its
    segments' decoder K/V. Every answer equals the dense path's."""
    t1 = ["Watch: ", ("video", MP4, "video/mp4"), " what happens?"]
    t2 = ["and again: ", ("video", MP4)]
    s, a1 = call(url, turn(*t1))
    assert s == 200, a1
    media = a1["cache"]["media"][0]
    assert (media["type"], media["media_type"], media["cached"]) == ("video", "video/mp4", False)
    assert a1["cache"]["counts"]["encoder_runs"] == {"video": 1}           # one tower run, 3 segments
    s, a2 = call(url, turn(*t2, conv=a1["conversation_id"]))
    assert s == 200 and a2["cache"]["media"][0]["cached"] is True, a2
    counts = a2["cache"]["counts"]
    assert counts["encoder_runs"] == {} and counts["embedding_hits"] == {"video": 3}
    assert [a1["tokens"], a2["tokens"]] == dense(chat, t1, t2)
    s, a3 = call(url, turn(*t1))                                             # a new conversation
    assert s == 200 and a3["routing"]["rule"] == "content" and a3["node"] == a1["node"], a3
    assert a3["cache"]["counts"]["encoder_runs"] == {} and a3["cache"]["counts"]["media_hits"] == {"video": 3}
    assert a3["tokens"] == a1["tokens"]
    s, other = call(url, turn(*t1), key="key-globex")                        # another tenant: no hit
    assert s == 200 and other["cache"]["counts"]["encoder_runs"] == {"video": 1}, other
    assert other["cache"]["media"][0]["cached"] is False and other["tokens"] == a1["tokens"]


def _other_node_conversation(url: str, home: str, key: str = "key-acme") -> dict:
    """Open text-only conversations (least-loaded rotation) until one lands off ``home``."""
    for _ in range(6):
        status, opening = call(url, turn("Hi."), key=key)
        assert status == 200, opening
        if opening["node"] != home:
            return opening
        call(url, None, key=key, method="DELETE", path=f"/v1/conversations/{opening['conversation_id']}")
    raise AssertionError("the rotation never used the other node")


def test_other_node_fetches_the_groups_once_and_skips_the_encoders(url, chat):
    """An image's vision-tower output and a clip's Whisper cross-attention K/V (content-only
    groups) held on one node: a conversation on the other node with the same image and clip,
    after another opening, pulls each group whole (one lookup, one fetch per group, one
    publish) and runs no vision tower and no audio encoder; its answers equal the dense ones."""
    png, clip = image(20, (72, 56)), wav(21, 0.6)
    status, first = call(url, turn("Look: ", ("image", png), " and listen: ", ("audio", clip)))
    assert status == 200, first
    assert first["cache"]["counts"]["encoder_runs"] == {"image": 1, "audio": 1}, first
    opening = _other_node_conversation(url, first["node"])
    conv = opening["conversation_id"]
    status, second = call(url, turn("Look: ", ("image", png), " and listen: ", ("audio", clip), conv=conv))
    assert status == 200, second
    assert second["node"] == opening["node"] != first["node"]
    assert [m["cached"] for m in second["cache"]["media"]] == [True, True]
    assert [m["nodes"] for m in second["cache"]["media"]] == [[first["node"]]] * 2
    counts = second["cache"]["counts"]
    assert counts["encoder_runs"] == {}
    assert counts["embedding_hits"] == {"image": 1} and counts["media_hits"] == {"audio": 1}
    assert second["cache"]["traffic"] == {"lookup": 1, "fetch": 2, "publish": 1}, second["cache"]
    status, third = call(url, turn("And now?", conv=conv))
    assert status == 200 and not {"lookup", "fetch"} & set(third["cache"]["traffic"])
    assert [opening["tokens"], second["tokens"], third["tokens"]] == dense(
        chat, ["Hi."], ["Look: ", ("image", png), " and listen: ", ("audio", clip)], ["And now?"])
    # a new conversation with the image goes where it is held (now both nodes) and reuses it
    status, fourth = call(url, turn("New: ", ("image", png)))
    assert status == 200 and fourth["routing"]["rule"] == "content", fourth
    assert fourth["cache"]["counts"]["encoder_runs"] == {} and fourth["cache"]["traffic"].get("fetch", 0) == 0


def _clip_on_each_node(url: str, seed: int) -> dict[str, bytes]:
    """globex's new clips, sent until the least-loaded rotation put one on each node."""
    placed: dict[str, bytes] = {}
    for i in range(6):
        clip = wav(seed + i, 0.3)
        status, body = call(url, turn("Hear: ", ("audio", clip)), key="key-globex")
        assert status == 200, body
        placed.setdefault(body["node"], clip)
        if len(placed) == 2:
            return placed
    raise AssertionError("the least-loaded rotation should use both nodes")


def test_new_conversations_follow_their_clip_and_tenants_do_not_share(url):
    """New conversations land by rotation on both nodes; each repeat of a clip goes to the node
    that holds it; another tenant's same clip is a miss there."""
    placed = _clip_on_each_node(url, 30)
    for node, clip in placed.items():
        status, body = call(url, turn("Again: ", ("audio", clip)), key="key-globex")
        assert status == 200, body
        assert (body["routing"]["rule"], body["node"]) == ("content", node)
        assert body["cache"]["counts"]["media_hits"] == {"audio": 1}
        assert body["cache"]["counts"]["encoder_runs"] == {}
        status, other = call(url, turn("Again: ", ("audio", clip)))          # acme: no hit
        assert status == 200 and other["cache"]["hit"] is False, other
        assert other["cache"]["counts"]["encoder_runs"] == {"audio": 1}


def _worker(node: str):
    from mmtier.actors.pool_host import host_name

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


def test_no_room_for_a_turn_is_503_capacity_and_the_conversation_goes_on(url, chat):
    """A turn attaches its conversation's whole history (pinned while it runs) and adds its own
    tokens in the text pool. Turns of 590 text tokens: two fit a worker's text pool, the third
    does not: 503 ``capacity`` with the JSON error, the worker keeps no sequence or page of it,
    and the conversation goes on: its next short turn is its third, equal to the dense
    reference of the turns that succeeded, as if the failed turn was never sent."""
    n = ARGS["limits"]["max_turn_tokens"] - 10
    t1, t2, t3, t4 = [_text(50, n)], [_text(51, n)], [_text(52, n)], ["and now?"]
    status, a1 = call(url, turn(*t1))
    assert status == 200, a1
    conv, node = a1["conversation_id"], a1["node"]
    worker = _worker(node)
    text = ray.get(worker.stats.remote(), timeout=60)["tiers"]["device"]["text"]
    pages = text["capacity_bytes"] // chat.cache_config().spec("text").page_bytes
    per_turn = -(-(n + NEW) // 16)                              # a turn's span, in 16-token pages
    assert 2 * per_turn + 1 <= pages < 3 * per_turn             # the setup: two fit, three do not
    status, a2 = call(url, turn(*t2, conv=conv))
    assert status == 200 and a2["node"] == node, a2
    conversations = ray.get(worker.info.remote(), timeout=60)["conversations"]
    status, body = call(url, turn(*t3, conv=conv))
    assert status == 503, body
    assert set(body) == {"error"} and (body["error"]["status"], body["error"]["type"]) == (503, "capacity")
    assert "text pool" in body["error"]["message"] and f"conversation {conv} is unchanged" in body["error"]["message"]
    _assert_no_leak(worker)
    assert ray.get(worker.info.remote(), timeout=60)["conversations"] == conversations
    status, a4 = call(url, turn(*t4, conv=conv))
    assert status == 200 and a4["turn"] == 3 and a4["node"] == node, a4
    assert [a1["tokens"], a2["tokens"], a4["tokens"]] == dense(chat, t1, t2, t4)
    _assert_no_leak(worker)
    assert call(url, None, method="DELETE", path=f"/v1/conversations/{conv}")[0] == 200


def test_two_turns_at_once_on_one_worker_one_is_503_busy(url, chat):
    """The chat model takes one turn at a time per worker. Two long turns (each holds the model
    for seconds) of two conversations on one worker, sent at once: whichever comes second waits
    ``workers.turn_wait_s`` (0.2 s) and gets 503 ``busy`` with nothing of it run; the other
    answers. The busy turn, sent again, is its conversation's second and equals dense."""
    from concurrent.futures import ThreadPoolExecutor

    new = ARGS["limits"]["max_new_tokens"]
    opened: list[dict] = []
    hello: dict[str, str] = {}                   # conversation -> its opening text
    for i in range(3):                           # the rotation puts two of three on one node
        status, body = call(url, turn(f"Hi {i}.", new=new))
        assert status == 200, body
        opened.append(body)
        hello[body["conversation_id"]] = f"Hi {i}."
        pair = [b for b in opened if b["node"] == body["node"]]
        if len(pair) == 2:
            break
    for b in opened:
        if b not in pair:
            call(url, None, method="DELETE", path=f"/v1/conversations/{b['conversation_id']}")
    n = ARGS["limits"]["max_turn_tokens"] - new
    second = {b["conversation_id"]: [_text(70 + i, n)] for i, b in enumerate(pair)}
    with ThreadPoolExecutor(2) as pool:
        sent = {c: pool.submit(call, url, turn(*t, conv=c, new=new)) for c, t in second.items()}
        got = {c: f.result() for c, f in sent.items()}
    assert sorted(s for s, _ in got.values()) == [200, 503], got
    (busy, (_, err)), = [(c, r) for c, r in got.items() if r[0] == 503]
    assert set(err) == {"error"} and (err["error"]["status"], err["error"]["type"]) == (503, "busy"), err
    assert "busy with other turns for 0.2 s" in err["error"]["message"]
    assert f"conversation {busy} is unchanged" in err["error"]["message"]
    worker = _worker(pair[0]["node"])
    _assert_no_leak(worker)
    status, again = call(url, turn(*second[busy], conv=busy, new=new))
    assert status == 200 and again["turn"] == 2, again
    answers = {c: (again if c == busy else r[1]) for c, r in got.items()}
    for b in pair:
        c = b["conversation_id"]
        assert [b["tokens"], answers[c]["tokens"]] == dense_chat(chat, [[hello[c]], second[c]], new)
        call(url, None, method="DELETE", path=f"/v1/conversations/{c}")
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
    node's groups still serve, and the next turns succeed (recomputing what was lost)."""
    from mmtier.actors.pool_host import host_name

    settings = ServeAppConfig.parse(ARGS).settings()
    clips = _clip_on_each_node(url, 40)
    (dead, clip_dead), (alive, clip_alive) = sorted(clips.items())
    cc = mma.connect(settings)
    frontend = load_frontend(MODEL)
    key = lambda clip: frontend.routing_keys(cc, "globex", "audio", clip)[0]  # noqa: E731
    deadline = time.monotonic() + 10
    while cc.locate(key(clip_dead)) is None and time.monotonic() < deadline:
        time.sleep(0.2)                                   # the turn's publish is fire-and-forget
    assert cc.locate(key(clip_dead)) is not None
    ray.kill(ray.get_actor(host_name(dead), namespace=settings.namespace), no_restart=False)
    deadline = time.monotonic() + 90
    while cc.locate(key(clip_dead)) is not None and time.monotonic() < deadline:
        time.sleep(0.5)                                   # the restarted worker announces an empty pool
    assert cc.locate(key(clip_dead)) is None
    assert host_name(alive) in {h for h, _ in cc.locate(key(clip_alive)).holders}
    status, body = call(url, turn("Again: ", ("audio", clip_alive)), key="key-globex")
    assert status == 200 and body["node"] == alive, body
    assert body["cache"]["counts"]["media_hits"] == {"audio": 1}
    # a new conversation sent to the restarting worker fails over to the other node
    status, body = call(url, turn("Again: ", ("audio", clip_dead)), key="key-globex")
    assert status == 200 and body["routing"]["rule"] in ("least_loaded", "failover"), body
    assert body["cache"]["counts"]["encoder_runs"] == {"audio": 1}       # recomputed
    assert body["tokens"] == dense(chat, ["Again: ", ("audio", clip_dead)])[0]
    cc.close()
