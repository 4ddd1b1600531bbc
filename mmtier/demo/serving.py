"""``mmtier demo`` (the default): multi-turn multimodal chats sent with the ``openai`` client to
the OpenAI-compatible path users serve with — Ray Serve LLM over vLLM engines that carry both
mmtier connectors — on an embedded local Ray bound to 127.0.0.1.

What it does, in order:

1. builds the app of ``configs/serve-llm-cpu.yaml`` (``mmtier.serve.llm_app``): mmtier's ingress
   (API keys -> tenants, each tenant's vLLM ``cache_salt`` set by the server), the tiny
   random-weight LLaVA built and saved if missing, mmtier's cluster (registry, node store) that
   the engines' connectors join, and beside it the *same engine without mmtier* (a second model
   id, ``<model>-plain``: no connectors; vLLM's own prefix caching is off in both, so every
   cached token is mmtier's);
2. runs a seeded workload: several tenants (one API key each), a few conversations each, several
   turns; turns carry text and images (PNG or JPEG data URLs: a per-tenant catalogue plus an
   image every tenant sends, so repeats are frequent); each request carries the whole history
   (OpenAI's API is stateless), conversations interleave;
3. sends every turn to both models, streamed (``stream_options.include_usage``): time to first
   token is the first content chunk; greedy answers (temperature 0) must be equal; the history
   goes on with the answer;
4. reports cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``) on first and
   later turns, time to first token with and without mmtier, the images (and image tokens)
   the prompts carried, what mmtier's cluster holds at the end (groups and bytes per tier and
   modality), and the check; a flat JSON report. Encoder runs are not counted here (the
   engines' processes do not report them to the client); the two-replica test counts them
   through Ray Serve LLM's ``collective_rpc`` (``tests/serve_worker_ext.py``).

Runs in the engines environment (``./run demo`` creates it: vLLM's CPU build here)."""

from __future__ import annotations

import base64
import io
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..stats.machine import machine

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "serve-llm-cpu.yaml"


@dataclass(frozen=True)
class ServingDemoSpec:
    tenants: int = 2
    conversations: int = 2              # per tenant
    turns: int = 4
    max_tokens: int = 8
    p_image: float = 0.6                # a turn carries an image
    user_words: int = 160
    seed: int = 0

    @classmethod
    def quick(cls, seed: int = 0, **kw) -> ServingDemoSpec:
        return cls(**{"tenants": 2, "conversations": 1, "turns": 2, **kw, "seed": seed})


@dataclass
class Turn:
    words: str
    image: int | None                   # image seed (None: text only)
    fmt: str = "PNG"


@dataclass
class Conversation:
    tenant: str
    key: str
    turns: list[Turn]
    messages: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)


def workload(spec: ServingDemoSpec) -> list[Conversation]:
    """Seeded conversations: a tenant's images come from its own small catalogue or from the
    image every tenant sends (seed 0), so an image recurs across turns and conversations."""
    from ..serve.tiny_models import text

    rng = random.Random(spec.seed)
    convs = []
    for t in range(spec.tenants):
        tenant = f"tenant-{t}"
        for _c in range(spec.conversations):
            turns = []
            for _i in range(spec.turns):
                img = None
                if rng.random() < spec.p_image:
                    img = 0 if rng.random() < 0.3 else 1 + 10 * t + rng.randrange(2)
                turns.append(Turn(text(rng.randrange(1 << 30), spec.user_words), img,
                                  "JPEG" if rng.random() < 0.3 else "PNG"))
            convs.append(Conversation(tenant, f"sk-demo-{t}", turns))
    return convs


def _data_url(seed: int, fmt: str) -> str:
    from ..serve.tiny_models import image

    buf = io.BytesIO()
    image(seed).save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def app_config(spec: ServingDemoSpec, disk_dir: str) -> tuple[dict, str, str]:
    """The CPU config with the demo's tenants, room for every image of a conversation, a disk
    tier, and the same engine without mmtier beside it: ``(doc, model, plain_model)``."""
    import copy

    from ..serve.llm_app import load_serve_config

    doc = load_serve_config(CONFIG)
    args = doc["applications"][0]["args"]
    ingress = args["ingress_cls_config"]["ingress_extra_kwargs"]
    ingress["api_keys"] = {f"sk-demo-{t}": f"tenant-{t}" for t in range(spec.tenants)}
    llm = args["llm_configs"][0]
    kw = llm["engine_kwargs"]
    kw["limit_mm_per_prompt"] = {"image": spec.turns}
    kw["max_model_len"] = max(int(kw.get("max_model_len", 1024)),
                              spec.turns * (spec.user_words + 64 + spec.max_tokens + 8) + 64)
    for conn in ("kv_transfer_config", "ec_transfer_config"):
        extra = kw[conn][f"{conn[:2]}_connector_extra_config"]
        extra["mmtier_cache"] = {**extra["mmtier_cache"], "disk_dir": disk_dir, "disk_bytes": 256 << 20}
    plain = copy.deepcopy(llm)
    model = llm["model_loading_config"]["model_id"]
    plain["model_loading_config"]["model_id"] = f"{model}-plain"
    for conn in ("kv_transfer_config", "ec_transfer_config"):
        plain["engine_kwargs"].pop(conn, None)
    args["llm_configs"] = [llm, plain]
    media = ingress.setdefault("media", {})
    media[f"{model}-plain"] = list(media.get(model, ["image"]))
    return doc, model, f"{model}-plain"


def _stream(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed, greedy chat completion: its text, usage and time to the first content."""
    t0 = time.perf_counter()
    first = None
    parts, usage = [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=0.0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - t0
    cached = 0
    if usage is not None and usage.prompt_tokens_details is not None:
        cached = usage.prompt_tokens_details.cached_tokens or 0
    return {"text": "".join(parts), "ttft_s": first if first is not None else total, "total_s": total,
            "prompt_tokens": usage.prompt_tokens if usage else 0, "cached_tokens": cached}


@dataclass
class ServingDemoReport:
    spec: ServingDemoSpec
    figures: dict
    mismatches: list[str]

    @property
    def passed(self) -> bool:
        return not self.mismatches


def run_serving_demo(spec: ServingDemoSpec, progress: bool = True, port: int | None = None) -> ServingDemoReport:
    """Start the app on a fresh local Ray, run the workload against both models, stop it."""
    import openai
    import ray

    from ..serve.llm_app import start_llm_app, stop_llm_app

    convs = workload(spec)
    t_all = time.perf_counter()
    # Ray's logical CPUs, not the cores: each engine's placement group takes one, the ingress a
    # quarter, mmtier's node store and pool theirs; a 2-core machine would leave the ingress
    # unscheduled. The engines' threads share the cores either way.
    ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), _node_ip_address="127.0.0.1",
             include_dashboard=False, namespace="mmtier", log_to_driver=False)
    app = None
    with tempfile.TemporaryDirectory(prefix="mmtier-demo-") as disk:
        try:
            doc, model, plain = app_config(spec, disk)
            app = start_llm_app(doc, port=port or _free_port())
            start_s = time.perf_counter() - t_all
            clients = {c.key: openai.OpenAI(base_url=app.base_url, api_key=c.key, max_retries=0, timeout=600)
                       for c in convs}
            order = [(c, i) for i in range(spec.turns) for c in convs]      # conversations interleave
            for n, (conv, i) in enumerate(order):
                turn = conv.turns[i]
                content: list[dict] = []
                if turn.image is not None:
                    content.append({"type": "image_url", "image_url": {"url": _data_url(turn.image, turn.fmt)}})
                content.append({"type": "text", "text": turn.words})
                conv.messages.append({"role": "user", "content": content})
                client = clients[conv.key]
                got = _stream(client, model, conv.messages, spec.max_tokens)
                ref = _stream(client, plain, conv.messages, spec.max_tokens)
                conv.records.append({"turn": i, "image": turn.image, "mmtier": got, "plain": ref,
                                     "images_in_prompt": sum(t.image is not None for t in conv.turns[: i + 1])})
                conv.messages.append({"role": "assistant", "content": got["text"]})
                if progress:
                    print(f"[demo] {n + 1}/{len(order)} {conv.tenant} turn {i}: cached {got['cached_tokens']}"
                          f"/{got['prompt_tokens']} ttft {got['ttft_s'] * 1e3:.0f} ms vs "
                          f"{ref['ttft_s'] * 1e3:.0f} ms plain, equal {got['text'] == ref['text']}", flush=True)
            held = _cluster_holdings()
        finally:
            if app is not None:
                stop_llm_app(app)
            ray.shutdown()
    mismatches = [f"{c.tenant} turn {r['turn']}: {r['mmtier']['text']!r} != {r['plain']['text']!r}"
                  for c in convs for r in c.records if r["mmtier"]["text"] != r["plain"]["text"]]
    figures = _figures(spec, convs, held, start_s, time.perf_counter() - t_all, mismatches, model)
    return ServingDemoReport(spec, figures, mismatches)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_holdings() -> dict:
    """What mmtier's cluster holds at the end: groups and bytes per tier and modality, summed
    over its actors (the node store the engines write through to, and its pool)."""
    from .. import actors

    with actors.connect(actors.ClusterSettings()) as cc:
        stats = cc.stats()
    out: dict = {}
    for tier, per in stats.tiers.items():
        for modality, u in per.items():
            out[f"cluster_{tier}_groups__{modality}"] = u.groups
            out[f"cluster_{tier}_bytes__{modality}"] = u.bytes
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _figures(spec, convs, held, start_s, elapsed, mismatches, model) -> dict:
    from ..serve.tiny_models import IMAGE_TOKENS

    recs = [r for c in convs for r in c.records]
    first = [r for r in recs if r["turn"] == 0]
    later = [r for r in recs if r["turn"] > 0]
    f: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
        "load_1min": os.getloadavg()[0], "path": "openai -> Ray Serve LLM -> vLLM (both mmtier connectors)",
        "model": model, "tenants": spec.tenants, "conversations": spec.tenants * spec.conversations,
        "turns": spec.turns, "requests": 2 * len(recs), "max_tokens": spec.max_tokens,
        "app_start_s": start_s, "elapsed_s": elapsed,
        "check_turns": len(recs), "check_mismatches": len(mismatches),
    }
    for name, sel in (("first_turns", first), ("later_turns", later), ("all_turns", recs)):
        prompt = sum(r["mmtier"]["prompt_tokens"] for r in sel)
        f[f"prompt_tokens__{name}"] = prompt
        f[f"cached_tokens__{name}"] = sum(r["mmtier"]["cached_tokens"] for r in sel)
        f[f"cached_tokens_plain__{name}"] = sum(r["plain"]["cached_tokens"] for r in sel)
        f[f"cached_fraction__{name}"] = f[f"cached_tokens__{name}"] / prompt if prompt else 0.0
        f[f"ttft_s_mmtier__{name}"] = _median([r["mmtier"]["ttft_s"] for r in sel])
        f[f"ttft_s_plain__{name}"] = _median([r["plain"]["ttft_s"] for r in sel])
    paired = [r["mmtier"]["ttft_s"] / r["plain"]["ttft_s"] for r in later if r["plain"]["ttft_s"] > 0]
    f["later_turns_ttft_mmtier_over_plain"] = _median(paired)
    f["images_sent"] = sum(r["images_in_prompt"] for r in recs)
    f["image_tokens_sent"] = f["images_sent"] * IMAGE_TOKENS
    f.update(held)
    return f


def format_serving_report(r: ServingDemoReport, json_path: Path | None = None) -> str:
    f = r.figures
    lines = [
        f"mmtier demo (OpenAI API): {f['tenants']} tenants, {f['conversations']} conversations, "
        f"{f['turns']} turns, {f['max_tokens']} tokens per answer; {f['path']}",
        f"model: {f['model']} (tiny random-weight LLaVA), beside it {f['model']}-plain: the same engine "
        "without mmtier; vLLM's own prefix caching off in both",
        "",
        f"{'':<14}{'prompt tok':>11}{'cached':>8}{'cached %':>9}{'TTFT mmtier':>13}{'TTFT plain':>12}",
    ]
    for name in ("first_turns", "later_turns", "all_turns"):
        lines.append(f"{name.replace('_', ' '):<14}{f[f'prompt_tokens__{name}']:>11}{f[f'cached_tokens__{name}']:>8}"
                     f"{100 * f[f'cached_fraction__{name}']:>8.1f}%{f[f'ttft_s_mmtier__{name}'] * 1e3:>11.0f}ms"
                     f"{f[f'ttft_s_plain__{name}'] * 1e3:>10.0f}ms")
    lines += [
        f"later turns, median paired TTFT with mmtier over without: {f['later_turns_ttft_mmtier_over_plain']:.2f}",
        f"images sent in prompts (history included): {f['images_sent']} ({f['image_tokens_sent']} image tokens)",
        "mmtier's cluster at the end: " + ", ".join(
            f"{k.removeprefix('cluster_')}={v}" for k, v in sorted(f.items())
            if k.startswith("cluster_") and "_groups__" in k) or "(nothing)",
        "",
        f"correctness: {f['check_turns'] - f['check_mismatches']}/{f['check_turns']} answers equal the engine "
        f"without mmtier: {'PASSED' if r.passed else 'FAILED'}",
    ]
    lines += [f"  {m}" for m in r.mismatches[:5]]
    lines.append(f"app start {f['app_start_s']:.1f} s; whole run {f['elapsed_s']:.1f} s; load {f['load_1min']:.1f}")
    if json_path is not None:
        lines.append(f"report: {json_path}")
    return "\n".join(lines)
