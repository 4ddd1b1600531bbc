"""One Ray Serve LLM app from a CPU config in ``configs/`` for a test module (the OpenAI tests of
audio and video share one app across their checks), and what those tests ask of it: the
``openai`` client, the tokens a repeat can hit, a request the ingress refuses.

Import only in the engines environment (``httpx``, ``openai``; the app needs Ray Serve LLM)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai

from mmtier.serve.llm_app import LLMApp, load_serve_config, start_llm_app, stop_llm_app
from mmtier.serve.tiny_models import BLOCK
from tests.serve.test_llm import _free_port

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ERROR_FIELDS = {"message", "type", "param", "code"}


def served(config: str, tmp_path_factory, tag: str) -> Iterator[LLMApp]:
    """A module fixture's body: the app of ``configs/<config>`` on a free loopback port, its tiny
    model built under a fresh ``MMTIER_MODELS``; stopped (Ray with it) after the module."""
    import pytest

    mp = pytest.MonkeyPatch()
    mp.setenv("MMTIER_MODELS", str(tmp_path_factory.mktemp("models")))
    t0 = time.perf_counter()
    try:
        running = start_llm_app(load_serve_config(CONFIGS / config), port=_free_port())
        print(f"[{tag}] ready in {time.perf_counter() - t0:.1f} s at {running.base_url}")
        try:
            yield running
        finally:
            stop_llm_app(running)
    finally:
        mp.undo()


def client(app: LLMApp, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url, api_key=key, max_retries=0, timeout=300)


def full_blocks(prompt_tokens: int) -> int:
    """The prompt tokens a repeat can take from mmtier: every full block (vLLM computes the last
    prompt token itself)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def refused(app: LLMApp, key: str, body: dict, name: str) -> dict:
    """POST ``body`` to chat completions as it is (``httpx``); asserts a 400 with OpenAI's four
    error fields and returns them."""
    r = httpx.post(app.base_url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=120)
    assert r.status_code == 400, (name, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == ERROR_FIELDS and err["message"], (name, err)
    return err


def groups_of(modality: str) -> set[str]:
    """The digests of the ``modality`` groups the cluster's holders (node stores, pools) hold,
    from each holder the registry lists: an encoder output is there once its worker ran the
    encoder and saved it (written through to its node's store)."""
    import ray

    from mmtier.cluster import ClusterSettings, RegistryShards

    out: set[str] = set()
    for holder in RegistryShards(ClusterSettings()).holders().get(60):
        inventory = ray.get(ray.get_actor(holder.name, namespace="mmtier").inventory.remote(), timeout=60)
        out |= {item["key"]["digest"] for item in inventory if item["key"]["modality"] == modality}
    return out


def _published(before: set[str], modality: str, at_least: int, settle_s: float) -> set[str]:
    """The new ``modality`` groups once at least ``at_least`` are listed (30 s at most), after
    ``settle_s`` more for any stray publish."""
    deadline = time.monotonic() + 30
    while len(groups_of(modality) - before) < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(settle_s)
    return groups_of(modality) - before


def two_tenants(app: LLMApp, model: str, keys: tuple[str, str], messages: list[dict], modality: str) -> dict:
    """Tenant a (``keys[0]``) sends ``messages`` twice, then tenant b (``keys[1]``) twice, through
    mmtier's ingress (which sets each one's ``cache_salt`` and item names): the answers, cached
    tokens, and the encoder-output groups (``modality``) published after a's pair and after b's.
    A group appears only where a worker ran the encoder and saved its output: b's first request
    publishes its own only if it neither loaded a's from mmtier nor took it from vLLM's cache."""
    greedy = dict(max_tokens=8, temperature=0.0)
    before = groups_of(modality)
    out: dict = {"answers": [], "cached": []}
    for i, key in enumerate((keys[0], keys[0], keys[1], keys[1])):
        r = client(app, key).chat.completions.create(model=model, messages=messages, **greedy)
        out["answers"].append(r.choices[0].message.content)
        out["cached"].append(r.usage.prompt_tokens_details.cached_tokens)
        if i == 1:
            out["after_a"] = _published(before, modality, 1, 2.0)
    out["after_b"] = _published(before, modality, len(out["after_a"]) + 1, 2.0)
    return out


def assert_tenants_apart(r: dict) -> None:
    """Each tenant's encoder ran once (its output published once, a's repeat and b's repeat
    publish nothing new: they hit), b never got a's (b's first publishes as many groups again and
    hits no KV), and every answer is the first one's."""
    a = r["after_a"]
    assert a and len(r["after_b"]) == 2 * len(a) and a < r["after_b"], r
    assert r["cached"][0] == 0 and r["cached"][1] > 0 and r["cached"][2] == 0 and r["cached"][3] > 0, r
    assert len(set(r["answers"])) == 1, r
