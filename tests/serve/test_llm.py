"""The OpenAI-compatible serving path, end to end: Ray Serve LLM (``build_openai_app`` with
mmtier's ingress) over a real vLLM engine (its CPU build) carrying both mmtier connectors, on a
fresh local Ray, driven over loopback by the real ``openai`` client (``httpx`` for raw and bad
requests). One app for the module (``configs/serve-llm-cpu.yaml``: the tiny random-weight
LLaVA, one replica, vLLM's own prefix caching off, so every cached token in ``usage`` comes from
mmtier). Greedy tokens of a repeat are compared with the first answer, computed with nothing
cached (its ``cached_tokens`` is 0).

Runs in the engines environment (``./run engines``); elsewhere it is skipped with the reason."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

try:
    import vllm  # noqa: F401, I001  (first: ray.serve.llm's own message would suggest ray[llm])
    import httpx
    import openai
    import ray.serve.llm  # noqa: F401
except ImportError as exc:                 # the base environment has no vLLM / Ray Serve LLM
    pytest.skip(f"needs the engines environment (vLLM, ray.serve.llm, openai, httpx; ./run engines): {exc}",
                allow_module_level=True)

from mmtier.serve.llm_app import load_serve_config, start_llm_app, stop_llm_app  # noqa: E402
from mmtier.serve.tiny_models import image, text  # noqa: E402

pytestmark = pytest.mark.ray
MODEL = "tiny-llava"
KEYS = {"sk-test-a": "tenant-a", "sk-test-b": "tenant-b"}
KEY_A, KEY_B = "sk-test-a", "sk-test-b"
GREEDY = dict(max_tokens=8, temperature=0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MMTIER_MODELS", str(tmp_path_factory.mktemp("models")))
    doc = load_serve_config(ROOT / "configs" / "serve-llm-cpu.yaml")
    ingress = doc["applications"][0]["args"]["ingress_cls_config"]["ingress_extra_kwargs"]
    ingress["api_keys"] = dict(KEYS)
    t0 = time.perf_counter()
    running = start_llm_app(doc, port=_free_port())
    print(f"[serve-llm] ready in {time.perf_counter() - t0:.1f} s at {running.base_url}")
    try:
        yield running
    finally:
        stop_llm_app(running)
        mp.undo()


def client(app, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url, api_key=key, max_retries=0, timeout=300)


def data_url(picture, fmt: str) -> str:
    buf = io.BytesIO()
    picture.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_messages(url: str, words: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": words}]}]


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


# ---------------------------------------------------------------------------- the plugin
def test_vllm_plugin_binds_the_shim_in_a_fresh_process_before_llava_imports():
    """vLLM's own plugin loader (what each of its processes runs) installs the shim, and only
    then does vLLM's LLaVA module import; without the plugin that import fails here."""
    probe = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
             "import vllm.model_executor.models.llava; "
             "from mmtier.engines.vllm.plugin import shim_state; import json, dataclasses; "
             "print('STATE', json.dumps(dataclasses.asdict(shim_state())))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    state = json.loads(out.stdout.split("STATE ", 1)[1])
    if state["torchvision"]:
        pytest.skip("torchvision imports here: the shim has nothing to do")
    assert state == {"bound": True, "torchvision": False, "llava_before_plugin": False}
    bare = subprocess.run([sys.executable, "-c", "import vllm.model_executor.models.llava"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert bare.returncode != 0 and "torchvision" in bare.stderr


# ---------------------------------------------------------------------------- answers
def test_models_lists_the_model_and_wants_a_key(app):
    r = httpx.get(app.base_url + "/models", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [MODEL]
    assert client(app).models.list().data[0].id == MODEL
    r = httpx.get(app.base_url + "/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_text_repeat_is_served_from_mmtier_with_the_same_tokens(app):
    c = client(app)
    prompt = text(11, 300)
    first = c.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    t0 = time.perf_counter()
    again = c.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    print(f"[serve-llm] completion repeat: {cached(again.usage)}/{again.usage.prompt_tokens} cached, "
          f"{time.perf_counter() - t0:.2f} s")
    assert first.usage.prompt_tokens == 300 and cached(first.usage) == 0
    assert cached(again.usage) >= 256               # the 9 full blocks of 32 (vLLM recomputes the last token)
    assert again.choices[0].text == first.choices[0].text and first.usage.completion_tokens == 8
    msgs = [{"role": "user", "content": text(12, 200)}]
    chat1 = c.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    chat2 = c.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    assert cached(chat1.usage) == 0 and cached(chat2.usage) >= 160
    assert chat2.choices[0].message.content == chat1.choices[0].message.content


def test_image_repeat_is_served_from_mmtier_png_and_jpeg(app):
    c = client(app)
    words = text(21, 60)
    png = image_messages(data_url(image(21), "PNG"), words)
    first = c.chat.completions.create(model=MODEL, messages=png, **GREEDY)
    t0 = time.perf_counter()
    again = c.chat.completions.create(model=MODEL, messages=png, **GREEDY)
    print(f"[serve-llm] image repeat: {cached(again.usage)}/{again.usage.prompt_tokens} cached, "
          f"{time.perf_counter() - t0:.2f} s")
    assert first.usage.prompt_tokens >= 64 + 60 and cached(first.usage) == 0
    assert cached(again.usage) >= 96                # the image's 64 tokens and the text blocks after it
    assert again.choices[0].message.content == first.choices[0].message.content
    jpeg = image_messages(data_url(image(22), "JPEG"), words)      # another picture, the same words
    other = c.chat.completions.create(model=MODEL, messages=jpeg, **GREEDY)
    assert cached(other.usage) == 0                 # the image leads the prompt: nothing of it is shared
    other2 = c.chat.completions.create(model=MODEL, messages=jpeg, **GREEDY)
    assert cached(other2.usage) >= 96 and other2.choices[0].message.content == other.choices[0].message.content


def test_streaming_sends_the_same_tokens_and_usage_with_cached_tokens(app):
    c = client(app)
    msgs = [{"role": "user", "content": text(31, 160)}]
    whole = c.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    pieces, usage = [], None
    stream = c.chat.completions.create(model=MODEL, messages=msgs, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 8 and cached(usage) >= 128
    with httpx.stream("POST", app.base_url + "/completions", timeout=300,
                      headers={"Authorization": f"Bearer {KEY_A}"},
                      json={"model": MODEL, "prompt": text(32, 40), "stream": True, **GREEDY}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"


# ---------------------------------------------------------------------------- errors
def _gif_url() -> str:
    return data_url(image(41), "GIF").replace("image/gif", "image/png")    # declares PNG, holds a GIF


def _bad_requests() -> list[tuple[str, dict, bytes | dict, int, str | None, str | None]]:
    """(name, headers, body, status, code, param)."""
    png = io.BytesIO()
    image(42).save(png, "PNG")
    cut = "data:image/png;base64," + base64.b64encode(png.getvalue()[: len(png.getvalue()) // 2]).decode()
    gif = io.BytesIO()
    image(43).save(gif, "GIF")
    real_gif = "data:image/gif;base64," + base64.b64encode(gif.getvalue()).decode()
    wav = "UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAIA+AAACABAAZGF0YQAAAAA="
    key = {"Authorization": f"Bearer {KEY_A}"}
    chat = lambda content: {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    part = lambda url: chat([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w1"}])
    return [
        ("no key", {}, chat("w1 w2"), 401, "invalid_api_key", None),
        ("unknown key", {"Authorization": "Bearer sk-nobody"}, chat("w1 w2"), 401, "invalid_api_key", None),
        ("bad JSON", key, b'{"model": "tiny-llava", "messages": [', 400, "invalid_json", None),
        ("not an object", key, b"[1, 2]", 400, "invalid_json", None),
        ("no messages", key, {"model": MODEL}, 400, "missing_required_parameter", "messages"),
        ("no model", key, {"messages": [{"role": "user", "content": "w1"}]}, 400, "missing_required_parameter",
         "model"),
        ("unknown model", key, {**chat("w1"), "model": "gpt-9"}, 404, "model_not_found", "model"),
        ("GIF", key, part(real_gif), 400, "invalid_image_format", "messages[0].content[0].image_url.url"),
        ("GIF declared PNG", key, part(_gif_url()), 400, "invalid_image_format",
         "messages[0].content[0].image_url.url"),
        ("truncated PNG", key, part(cut), 400, "invalid_image", "messages[0].content[0].image_url.url"),
        ("broken base64", key, part("data:image/png;base64,iVBORw0K!!!"), 400, "invalid_base64",
         "messages[0].content[0].image_url.url"),
        ("remote URL", key, part("http://127.0.0.1:9/x.png"), 400, "invalid_image_url",
         "messages[0].content[0].image_url.url"),
        ("audio to a model without audio", key,
         chat([{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]), 400,
         "unsupported_modality", "messages[0].content[0]"),
        ("client cache_salt", key, {**chat("w1"), "cache_salt": "tenant-b"}, 400, "unsupported_parameter",
         "cache_salt"),
        ("completion cache_salt", key, {"model": MODEL, "prompt": "w1", "cache_salt": "x"}, 400,
         "unsupported_parameter", "cache_salt"),
    ]


def test_bad_requests_get_openai_shaped_errors_never_a_500(app):
    url = app.base_url + "/chat/completions"
    for name, headers, body, status, code, param in _bad_requests():
        if "completion cache_salt" == name:
            url = app.base_url + "/completions"
        kw = {"content": body, "headers": {**headers, "Content-Type": "application/json"}} \
            if isinstance(body, bytes) else {"json": body, "headers": headers}
        r = httpx.post(url, timeout=120, **kw)
        assert r.status_code == status, (name, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (name, err)
        assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error"), (name, err)
    c = client(app)
    with pytest.raises(openai.AuthenticationError):
        client(app, "sk-nobody").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}])
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model=MODEL, messages=image_messages(_gif_url(), "w1"), max_tokens=4)
    assert bad.value.code == "invalid_image_format"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "w1"}])
    ok = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1 w2 w3"}], max_tokens=2)
    assert ok.usage.completion_tokens == 2                         # the server still answers


def test_an_over_long_prompt_is_the_engines_400_not_a_500(app):
    r = httpx.post(app.base_url + "/completions", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120,
                   json={"model": MODEL, "prompt": text(51, 1100), "max_tokens": 4})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "1024" in err["message"]


# ---------------------------------------------------------------------------- tenants
def test_one_tenant_never_hits_anothers_content(app):
    a, b = client(app, KEY_A), client(app, KEY_B)
    words = text(61, 60)
    msgs = image_messages(data_url(image(61), "PNG"), words)
    prompt = text(62, 300)
    a1 = a.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    a2 = a.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    ta1 = a.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    ta2 = a.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert cached(a1.usage) == 0 and cached(a2.usage) >= 96 and cached(ta2.usage) >= 256
    b1 = b.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    tb1 = b.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert cached(b1.usage) == 0 and cached(tb1.usage) == 0        # A's groups are not B's
    b2 = b.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    assert cached(b2.usage) >= 96                                   # B's own, once B has sent it
    assert b1.choices[0].message.content == a1.choices[0].message.content == b2.choices[0].message.content
    assert tb1.choices[0].text == ta1.choices[0].text


def test_two_tenants_each_encode_an_image_once_and_never_get_the_others_output(app):
    """The same picture from two API keys: each tenant's vision tower runs once (its encoder
    output published once), the other's first request runs its own (it neither loads the first
    tenant's from any mmtier tier nor takes it from vLLM's own encoder cache: the ingress names
    the item per tenant), and repeats hit."""
    from tests.support.serve_llm_app import assert_tenants_apart, two_tenants

    msgs = image_messages(data_url(image(63), "PNG"), text(63, 60))
    assert_tenants_apart(two_tenants(app, MODEL, (KEY_A, KEY_B), msgs, "vision_embed"))


# ---------------------------------------------------------------------------- the cluster
def test_the_engines_saves_are_published_to_mmtiers_cluster(app):
    """``mmtier_cluster`` in the config: ``start_llm_app`` started mmtier's registry and node
    stores on this Ray, and the engine's worker process (a child of the replica) joined it:
    what it saves is written through to the node's store and published."""

    from mmtier.cluster import ClusterSettings, RegistryShards

    registry = RegistryShards(ClusterSettings())
    before = registry.stats().get(60)
    c = client(app)
    prompt = text(71, 200)
    c.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    deadline = time.monotonic() + 30
    while True:
        now = registry.stats().get(60)
        if now["keys"] >= before["keys"] + 6 or time.monotonic() > deadline:  # 6 full blocks of 32
            break
        time.sleep(0.5)
    assert now["keys"] >= before["keys"] + 6, (before, now)
