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
