"""Prefill and decode on different vLLM engines, mmtier carrying the KV, end to end: Ray Serve
LLM's ``build_pd_openai_app`` (``configs/serve-llm-cpu-pd.yaml``: a prefill engine with
``kv_role: kv_producer``, a decode engine with ``kv_consumer``, mmtier's ingress) beside a
reference app of one engine doing both (``kv_both``, another mmtier tenant, so it shares no KV
with the pair), on a fresh local Ray, real vLLM engines (CPU build, the tiny random-weight
LLaVA), the real ``openai`` client over loopback.

Greedy answers of the P/D app are bit-equal to the reference's (text, an image, a prompt of
thousands of tokens, several requests in flight), and the decode engine's ``cached_tokens`` is
every whole block below the prompt's last token: it loaded the prompt the prefill engine saved
(vLLM's own prefix cache is off, and a decode engine saves no prompt of its own).

Runs in the engines environment (``./run engines``); elsewhere it is skipped with the reason."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

try:
    import vllm  # noqa: F401, I001  (first: ray.serve.llm's own message would suggest ray[llm])
    import openai
    import ray.serve.llm  # noqa: F401
except ImportError as exc:                 # the base environment has no vLLM / Ray Serve LLM
    pytest.skip(f"needs the engines environment (vLLM, ray.serve.llm, openai; ./run engines): {exc}",
                allow_module_level=True)

from mmtier.serve.llm_app import load_serve_config, start_llm_app, stop_llm_app  # noqa: E402
from mmtier.serve.tiny_models import BLOCK, image, text  # noqa: E402
from tests.serve.test_llm import _free_port, data_url  # noqa: E402

pytestmark = pytest.mark.ray
MODEL = "tiny-llava"
KEY = "sk-local-acme"
GREEDY = dict(max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})


def _with_reference(doc: dict) -> dict:
    """The P/D config plus ``ref``: one engine (the decode engine's settings, ``kv_both``) at
    ``/ref``, its groups under another mmtier tenant."""
    pd = doc["applications"][0]
    llm = copy.deepcopy(pd["args"]["decode_config"])
    kv = llm["engine_kwargs"]["kv_transfer_config"]
    kv["kv_role"] = "kv_both"
    kv["kv_connector_extra_config"] = extra = copy.deepcopy(kv["kv_connector_extra_config"])
    extra["mmtier_tenant"] = "serve-llm-reference"
    llm["engine_kwargs"].pop("ec_transfer_config", None)     # the reference runs its own vision tower
    doc["applications"].append({"name": "ref", "route_prefix": "/ref", "import_path": "ray.serve.llm:build_openai_app",
                                "args": {"ingress_cls_config": copy.deepcopy(pd["args"]["ingress_cls_config"]),
                                         "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0.1}},
                                         "llm_configs": [llm]}})
    return doc


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MMTIER_MODELS", str(tmp_path_factory.mktemp("models")))
    doc = _with_reference(load_serve_config(ROOT / "configs" / "serve-llm-cpu-pd.yaml"))
    t0 = time.perf_counter()
    running = start_llm_app(doc, port=_free_port())
    print(f"[serve-llm-pd] ready in {time.perf_counter() - t0:.1f} s at {running.base_url}")
    try:
        pd = openai.OpenAI(base_url=running.base_url, api_key=KEY, max_retries=0, timeout=300)
        ref = openai.OpenAI(base_url=running.base_url.replace("/v1", "/ref/v1"), api_key=KEY, max_retries=0,
                            timeout=300)
        yield pd, ref
    finally:
        stop_llm_app(running)
        mp.undo()


def _ask(client, messages):
    r = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content, r.usage.prompt_tokens, (details.cached_tokens if details else 0)


def _whole_blocks(prompt_tokens: int) -> int:
    """What the decode engine loads: every whole block below the prompt's last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def _check(apps, messages, label: str) -> tuple[str, int]:
    pd, ref = apps
    want, want_tokens, ref_cached = _ask(ref, messages)
    got, tokens, cached = _ask(pd, messages)
    assert ref_cached == 0, (label, ref_cached)
    assert (got, tokens) == (want, want_tokens), label        # bit-equal greedy tokens
    assert cached == _whole_blocks(tokens) > 0, (label, cached, tokens)
    return got, tokens


def test_text_and_image_prompts_decode_from_the_prefill_engines_kv(apps):
    _check(apps, [{"role": "user", "content": text(11, 150)}], "text")
    picture = data_url(image(5), "PNG")
    _check(apps, [{"role": "user", "content": [{"type": "text", "text": text(12, 40)},
                                               {"type": "image_url", "image_url": {"url": picture}},
                                               {"type": "text", "text": text(13, 70)}]}], "image")


def test_a_long_prompt(apps):
    _, tokens = _check(apps, [{"role": "user", "content": text(21, 3000)}], "long")
    assert tokens >= 3000


def test_several_requests_in_flight(apps):
    pd, ref = apps
    prompts = [[{"role": "user", "content": text(100 + i, 90 + 37 * i)}] for i in range(4)]
    want = [_ask(ref, m) for m in prompts]
    got: list = [None] * len(prompts)
    errors: list = []

    def one(i):
        try:
            got[i] = _ask(pd, prompts[i])
        except Exception as exc:            # noqa: BLE001 (reported below, with the others)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    for (a, n, _), (b, m, cached) in zip(want, got, strict=True):
        assert (b, m) == (a, n)
        assert cached == _whole_blocks(m)
