"""The Serve app on a real two-node Ray cluster on loopback, driven by real HTTP requests.

One module-scoped cluster: a head node and a second node, each with its own custom resource
(``mm_node_0`` / ``mm_node_1``: both nodes share 127.0.0.1, so ``node:<ip>`` cannot tell them
apart); mmtier started on both (a CPU pool and a store each); the app deployed with one worker
per node. Requests go to 127.0.0.1 only. Answers are checked against the dense reference model.
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
from ray.cluster_utils import Cluster  # noqa: E402

import mmtier.actors as mma  # noqa: E402
from mmtier.models import Audio, Image, ReferenceModel, Text  # noqa: E402
from mmtier.serve.app import build_app  # noqa: E402
from mmtier.serve.config import ServeAppConfig  # noqa: E402

pytestmark = pytest.mark.ray

NEW = 4
ARGS = {
    "model": {"seed": 0},
    "cache": {"device_bytes": 8 << 20, "allow_default_key_secret": True},   # a local test cluster
    "cluster": {"call_timeout_s": 60.0, "sweep_interval_s": 2.0},
    "api_keys": {"key-acme": "acme", "key-globex": "globex"},
    "limits": {"max_media_bytes": 48 << 10, "max_request_bytes": 256 << 10,
               "max_new_tokens": 16, "default_new_tokens": NEW},
    "affinity": {"pin_resource_prefix": "mm_node_"},
    "workers": {"num_cpus": 0},
    "ingress": {"num_cpus": 0},
}
IMG_X = bytes((j * 37 + 5) % 256 for j in range(3072))
BIG_AUDIO = bytes((j * 7) % 256 for j in range(40000))   # 1250 frames: more than an audio pool holds


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
def model():
    return ReferenceModel(seed=0)


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
    content = [{"type": "text", "text": i} if isinstance(i, str) else {"type": i[0], "data": b64(i[1])}
               for i in items]
    body = {"content": content, "max_new_tokens": new}
    if conv is not None:
        body["conversation_id"] = conv
    return body


def test_health_and_auth(url):
    status, body = call(url, None, key=None, method="GET", path="/healthz")
    assert status == 200 and body["workers"] == 2
    ok = turn("hi")
    assert call(url, ok, key=None)[0] == 401
    status, body = call(url, ok, key="no-such-key")
    assert status == 401 and body["error"]["status"] == 401
    status, body = call(url, ok, key="key-globex", header="x-api-key")
    assert status == 200 and body["tokens"] and len(body["tokens"]) == NEW


@pytest.mark.parametrize("case,status,kind", [
    ("malformed_json", 400, "malformed_json"),
    ("bad_base64", 400, "bad_base64"),
    ("unknown_kind", 400, "unknown_media_kind"),
    ("tenant_in_body", 400, "tenant_in_body"),
    ("unknown_field", 400, "bad_request"),
    ("too_many_tokens", 400, "bad_request"),
    ("oversized_media", 413, "too_large"),
    ("oversized_body", 413, "too_large"),
    ("huge_body_2mb", 413, "too_large"),
    ("huge_text_item", 413, "too_large"),
    ("multibyte_text_item", 413, "too_large"),
    ("turn_over_token_limit", 413, "too_large"),
    ("media_over_token_limit", 413, "too_large"),
    ("too_many_media", 400, "bad_request"),
    ("lone_surrogate", 400, "bad_request"),
    ("unknown_conversation", 404, "unknown_conversation"),
])
def test_bad_requests(url, case, status, kind):
    raw = None
    body = turn("hi")
    if case == "malformed_json":
        raw = b'{"content": [{"type": "text", "text": "hi"}'
    elif case == "bad_base64":
        body = {"content": [{"type": "image", "data": "not base64 !!"}]}
    elif case == "unknown_kind":
        body = {"content": [{"type": "video", "data": b64(b"1234")}]}
    elif case == "tenant_in_body":
        body = {**turn("hi"), "tenant": "globex"}
    elif case == "unknown_field":
        body = {**turn("hi"), "temperature": 0.5}
    elif case == "too_many_tokens":
        body = turn("hi", new=17)
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
        body = turn(*["z" * 4000] * 3)
    elif case == "media_over_token_limit":  # 5004 text + new tokens fit; 3 clips of 1250 frames do not
        body = turn("a" * 4000, "b" * 1000, *[("audio", BIG_AUDIO[: 40000 - i]) for i in range(3)])
    elif case == "too_many_media":
        body = turn(*[("image", IMG_X)] * 40)
    elif case == "lone_surrogate":
        raw = b'{"content": [{"type": "text", "text": "\\ud800"}]}'
    elif case == "unknown_conversation":
        body = turn("hi", conv="w0.deadbeef")
    got, answer = call(url, body, raw=raw)
    assert (got, answer["error"]["type"]) == (status, kind), answer
    assert answer["error"]["status"] == status and answer["error"]["message"]


def test_capacity_is_503(url):
    status, body = call(url, turn("listen: ", ("audio", BIG_AUDIO)))
    assert status == 503 and body["error"]["type"] == "capacity", body


def test_repeated_image_hits_on_its_node(url, model):
    prompt = ["Describe ", ("image", IMG_X), " briefly."]
    dense = model.generate_dense([Text("Describe "), Image(IMG_X), Text(" briefly.")], NEW)
    s1, first = call(url, turn(*prompt))
    assert s1 == 200, first
    assert first["tokens"] == dense
    media = first["cache"]["media"][0]
    assert media["cached"] is False and media["type"] == "image" and len(media["sha256"]) == 64
    assert first["cache"]["counts"]["encoder_runs"] == {"image": 1}

    assert call(url, turn("Unrelated text."))[0] == 200         # moves the least-loaded rotation

    s3, again = call(url, turn(*prompt))
    assert s3 == 200, again
    assert again["tokens"] == dense
    assert again["routing"]["rule"] == "content" and again["node"] == first["node"]
    assert again["cache"]["hit"] is True and again["cache"]["media"][0]["cached"] is True
    assert first["node"] in again["cache"]["media"][0]["nodes"]
    counts = again["cache"]["counts"]
    assert counts["cross_hits"] == {"image": 1} and counts["self_hits"] == {"image": 1}
    assert counts["encoder_runs"] == {}


def test_second_tenant_does_not_hit_first_tenants_content(url):
    status, body = call(url, turn("Describe ", ("image", IMG_X), " briefly."), key="key-globex")
    assert status == 200, body
    assert body["cache"]["hit"] is False and body["cache"]["media"][0]["cached"] is False
    assert body["routing"]["rule"] == "least_loaded"
    assert body["cache"]["counts"]["encoder_runs"] == {"image": 1}
    assert body["cache"]["counts"]["cross_misses"] == {"image": 1}


def test_affinity_follows_content_to_either_node(url):
    """New images land by rotation on both nodes; each repeat goes where its image is."""
    placed: dict[str, bytes] = {}
    for i in range(4):
        img = bytes((j * 11 + 17 * i + 1) % 256 for j in range(2048 + i))
        status, body = call(url, turn("Look: ", ("image", img)), key="key-globex")
        assert status == 200, body
        placed.setdefault(body["node"], img)
        if len(placed) == 2:
            break
    assert len(placed) == 2, "least-loaded rotation should use both nodes"
    for node, img in placed.items():
        status, body = call(url, turn("Again: ", ("image", img)), key="key-globex")
        assert status == 200, body
        assert (body["routing"]["rule"], body["node"]) == ("content", node)
        assert body["cache"]["counts"]["cross_hits"] == {"image": 1}


def test_conversation_turns_stay_on_their_node_and_match_dense(url, model):
    clip = bytes((j * 13 + 3) % 256 for j in range(1600))
    t1 = ["Hello. ", ("audio", clip), " What was said?"]
    t2 = ["And ", ("image", IMG_X), "?"]
    dense = model.chat_dense([[Text("Hello. "), Audio(clip), Text(" What was said?")],
                              [Text("And "), Image(IMG_X), Text("?")]], NEW)
    s, a1 = call(url, turn(*t1))
    assert s == 200, a1
    conv = a1["conversation_id"]
    s, a2 = call(url, turn(*t2, conv=conv))
    assert s == 200, a2
    assert [a1["tokens"], a2["tokens"]] == dense
    assert a2["routing"]["rule"] == "conversation" and a2["node"] == a1["node"] and a2["turn"] == 2
    # another tenant cannot use (or learn of) acme's conversation
    assert call(url, turn("x", conv=conv), key="key-globex")[0] == 404
    assert call(url, None, method="DELETE", path=f"/v1/conversations/{conv}")[0] == 200
    assert call(url, turn("x", conv=conv))[0] == 404


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
    assert "vision_xattn" in result.output


def _other_node_conversation(url: str, home: str) -> dict:
    """Open text-only conversations (least-loaded rotation) until one lands off ``home``."""
    for _ in range(6):
        status, opening = call(url, turn("Hi."))
        assert status == 200, opening
        if opening["node"] != home:
            return opening
        call(url, None, method="DELETE", path=f"/v1/conversations/{opening['conversation_id']}")
    raise AssertionError("the rotation never used the other node")


def test_other_node_fetches_the_image_once_and_skips_the_encoder(url, model):
    """The worker holds its node's pool: the image's groups on the first node are pulled whole
    (one lookup, one fetch per group, one publish) and the encoder does not run again."""
    img = bytes((j * 29 + 7) % 256 for j in range(3000))
    status, first = call(url, turn("Look: ", ("image", img)))
    assert status == 200 and first["cache"]["counts"]["encoder_runs"] == {"image": 1}, first
    opening = _other_node_conversation(url, first["node"])
    conv = opening["conversation_id"]
    status, second = call(url, turn("Look: ", ("image", img), conv=conv))
    assert status == 200, second
    assert second["node"] == opening["node"] != first["node"]
    counts = second["cache"]["counts"]
    assert counts["encoder_runs"] == {} and counts["cross_hits"] == {"image": 1}
    assert counts["embedding_hits"] == {"image": 1}            # self K/V from the fetched outputs
    # cross-attention K/V and encoder outputs: two groups, each fetched once
    assert second["cache"]["traffic"] == {"lookup": 1, "fetch": 2, "publish": 1}, second["cache"]
    status, third = call(url, turn("And now?", conv=conv))
    assert status == 200 and not {"lookup", "fetch"} & set(third["cache"]["traffic"])
    assert [opening["tokens"], second["tokens"], third["tokens"]] == model.chat_dense(
        [[Text("Hi.")], [Text("Look: "), Image(img)], [Text("And now?")]], NEW)


def test_killing_a_worker_loses_only_its_pool(url, model):
    """A worker dies: the registry forgets its pool's groups (it restarts empty), the other
    node's groups still serve, and the next turns succeed (recomputing what was lost)."""
    from mmtier.actors.pool_host import host_name
    from mmtier.models import cross_modality

    settings = ServeAppConfig.parse(ARGS).settings()
    imgs: dict[str, bytes] = {}
    for i in range(6):
        img = bytes((j * 13 + 31 * i + 3) % 256 for j in range(2500 + i))
        status, body = call(url, turn("See: ", ("image", img)), key="key-globex")
        assert status == 200, body
        imgs.setdefault(body["node"], img)
        if len(imgs) == 2:
            break
    assert len(imgs) == 2
    (dead, img_dead), (alive, img_alive) = sorted(imgs.items())
    cc = mma.connect(settings)
    params = model.encoders["vision"].params
    key = lambda img: cc.content_key(cross_modality("vision"), img, tenant="globex", params=params)  # noqa: E731
    assert cc.locate(key(img_dead)) is not None
    ray.kill(ray.get_actor(host_name(dead), namespace=settings.namespace), no_restart=False)
    deadline = time.monotonic() + 60
    while cc.locate(key(img_dead)) is not None and time.monotonic() < deadline:
        time.sleep(0.5)                                   # the restarted worker announces an empty pool
    assert cc.locate(key(img_dead)) is None
    assert host_name(alive) in {h for h, _ in cc.locate(key(img_alive)).holders}
    status, body = call(url, turn("Again: ", ("image", img_alive)), key="key-globex")
    assert status == 200 and body["node"] == alive, body
    assert body["cache"]["counts"]["cross_hits"] == {"image": 1}
    status, body = call(url, turn("Again: ", ("image", img_dead)), key="key-globex")
    assert status == 200, body
    assert body["cache"]["counts"]["encoder_runs"] == {"image": 1}       # recomputed
    assert body["tokens"] == model.generate_dense([Text("Again: "), Image(img_dead)], NEW)
    cc.close()
