"""Two tenants through vLLM's OpenAI API server (``python -m vllm.entrypoints.openai.api_server``,
what ``vllm serve`` runs) with mmtier's KV and encoder-cache connectors (sizes and a disk tier)
and vLLM's prefix cache on: the same image chat under two ``cache_salt``s (the request body's
field, the openai client's ``extra_body``), seen from the server's side only: the answers'
``usage.prompt_tokens_details.cached_tokens``, the vision tower's runs counted in the worker
(``mmtier.demo.worker_ext`` through ``/collective_rpc``) and mmtier's counters on ``/metrics``.

One server, then a second one over the same disk folder after the first was stopped the way
users stop it (SIGTERM, vLLM's default shutdown: no close runs; mmtier's write-behind had put
what it saved on disk within its lag):

- first server: tenant A's chat (tower runs, mmtier saves), A again (vLLM's prefix cache hits),
  then tenant B's: no cached tokens and no mmtier hit. B's tower is not counted here: vLLM's own
  encoder cache is keyed by content, not by ``cache_salt`` (README, "Tenants");
- second server (nothing in vLLM's caches, A's and B's groups only on mmtier's disk tier): a
  third tenant C first, its tower runs, no cached tokens, no mmtier hit; then A and B, whose
  prompts hit their own groups in mmtier's disk tier.

A salt vLLM has not seen gives no cached tokens without mmtier (the salt enters the first block's
hash), so a new tenant's ``cached_tokens`` must be 0 wherever mmtier kept A's content to itself. Every
answer is A's first one (greedy, the same picture and prompt). Runs in the engines environment
(``./run engines``); elsewhere it is skipped with the reason."""

from __future__ import annotations

import base64
import io
import json
import sys
import time
import uuid
from collections import Counter

import pytest

try:
    import httpx
    import openai
    import vllm  # noqa: F401
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as exc:
    pytest.skip(f"needs the engines environment (vLLM, openai; ./run engines): {exc}", allow_module_level=True)

from mmtier.demo.engines import EngineServer, EngineSpec, mmtier_sizes  # noqa: E402
from tests.support.vllm_mm_models import build_llava, image, text  # noqa: E402

TOKEN_KV_BYTES = 2 * 2 * 2 * 32 * 4     # the tiny LLaVA: 2 layers, K and V, 2 heads of 32, float32
PROMPT = text(7, 80)                    # after the image: the prompt spans a few blocks of 32
MAX_TOKENS = 4


def data_url(seed: int) -> str:
    buf = io.BytesIO()
    image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def events(server: EngineServer) -> Counter:
    """mmtier's hits and misses on the server's ``/metrics``, by ``(event, modality)``."""
    body = httpx.get(server.base_url + "/metrics", timeout=30).text
    got: Counter = Counter()
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == "vllm:mmtier_cache_events_total" and s.labels.get("event") in ("hits", "misses"):
                got[s.labels["event"], s.labels["modality"]] += int(s.value)
    return got


class Client:
    def __init__(self, server: EngineServer, model: str):
        self.server, self.model = server, model
        self.api = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300)
        self._fillers = 0

    def chat(self, salt: str, content: list, max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
        r = self.api.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
            temperature=0.0, extra_body={"cache_salt": salt})
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    def image_chat(self, salt: str) -> tuple[str, int]:
        return self.chat(salt, [{"type": "image_url", "image_url": {"url": data_url(11)}},
                                {"type": "text", "text": PROMPT}])

    def settled_events(self) -> Counter:
        """The counters once what the cache counted so far is on ``/metrics``: the connector
        reports at most every second, so a text chat under a salt of its own (no hit possible)
        steps the engine after a second, and the counters are read when its report is in (its
        own events are misses and puts of text only)."""
        before = events(self.server)
        time.sleep(1.2)
        self._fillers += 1            # a salt never sent before, in this server or the one before it
        self.chat(f"filler-{uuid.uuid4().hex}", [{"type": "text", "text": text(100 + self._fillers, 40)}], 1)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            now = events(self.server)
            if now != before:
                return now
            time.sleep(0.3)
        return events(self.server)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The scenario of the module doc; what each step saw, by name."""
    work = tmp_path_factory.mktemp("serve_tenants")
    model = str(build_llava(work / "llava"))
    spec = EngineSpec("tenants", model=model, kv_blocks=64, max_model_len=1024, images_per_prompt=1,
                      token_kv_bytes=TOKEN_KV_BYTES, python=sys.executable, shutdown_timeout_s=None,
                      mmtier=mmtier_sizes(work / "disk", device_bytes=8 << 20, host_bytes=8 << 20,
                                          disk_bytes=256 << 20))
    seen: dict[str, dict] = {}

    def step(name: str, client: Client, salt: str) -> None:
        e0 = client.settled_events()
        answer, cached = client.image_chat(salt)
        encoded = client.server.encoded()
        e1 = client.settled_events()
        e1.subtract(e0)
        seen[name] = {"answer": answer, "cached": cached, "encoded": encoded,
                      "hits": sum(n for (ev, _), n in e1.items() if ev == "hits"),
                      "image_misses": sum(n for (ev, m), n in e1.items() if ev == "misses" and m != "text"),
                      "events": {f"{ev}|{m}": n for (ev, m), n in e1.items() if n}}

    for run, steps in (("first", (("a1", "tenant-a"), ("a2", "tenant-a"), ("b1", "tenant-b"))),
                       ("restart", (("c_restart", "tenant-c"), ("a_restart", "tenant-a"),
                                    ("b_restart", "tenant-b")))):
        server = EngineServer(spec, work / f"{run}.log").start()
        try:
            server.wait_ready()
            server.encoded()                          # installs the tower's counter
            client = Client(server, spec.name)
            for name, salt in steps:
                step(name, client, salt)
            if run == "first":
                time.sleep(2.0)                       # past the write-behind's lag (1 s): a plain stop
            (work / "seen.json").write_text(json.dumps(seen, indent=1))
        except BaseException:
            print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            server.stop()                             # SIGTERM, vLLM's default shutdown: no close runs
    return seen


def test_another_tenant_gets_no_kv_and_no_hit_from_mmtier_in_one_server(served):
    a1, a2, b1 = served["a1"], served["a2"], served["b1"]
    assert a1["encoded"] == 1 and a1["cached"] == 0 and a1["hits"] == 0
    assert a2["cached"] > 0                           # the same tenant: vLLM's prefix cache hits
    assert b1["cached"] == 0, served                  # what a salt vLLM has not seen gives
    assert b1["hits"] == 0 and b1["image_misses"] > 0, served   # mmtier was asked and found nothing of B's


def test_after_a_restart_over_the_disk_tier_only_the_same_tenant_hits(served):
    c, a, b = served["c_restart"], served["a_restart"], served["b_restart"]
    assert c["encoded"] == 1, served                  # C's tower ran: no encoder output of A's came to it
    assert c["cached"] == 0 and c["hits"] == 0 and c["image_misses"] > 0, served
    assert a["cached"] > 0 and a["hits"] > 0, served  # A's prompt from mmtier's disk tier
    assert b["cached"] > 0 and b["hits"] > 0, served  # and B's own, saved by its request before


def test_every_answer_is_the_first_one(served):
    answers = {k: v["answer"] for k, v in served.items() if "answer" in v}
    assert len(answers) == 6 and len(set(answers.values())) == 1, answers
