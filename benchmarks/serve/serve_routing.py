"""Affinity routing against Serve's default, on two Ray Serve LLM replicas sharing through mmtier.

    .venv-engines/bin/python -m benchmarks.serve.serve_routing [--rounds 2] [--conversations 3] [--turns 3]

The app of ``tests/support/serve_llm_cluster.py``: a ``ray.cluster_utils.Cluster`` of a head and two
nodes, one replica on each (vLLM's CPU build, the tiny LLaVA, mmtier's KV and encoder-cache
connectors joined to the cluster, vLLM's own prefix cache off). The trace: several multi-turn
conversations, each opening with its own image (a data URL) that every later turn carries in
its history, the turns of the conversations interleaved (turn 1 of each, then turn 2 of each,
...), one request at a time, streamed with the ``openai`` client over loopback. The trace is
replayed ``--rounds`` times under each router, with fresh images and text per pass so nothing
carries over; round i of one router is paired with round i of the other. The routers run one
after the other, not interleaved: Serve 2.60 rolls a changed router out as new replicas (new
engines), so each switch is a restart (``ServeCluster.route``: the app deleted, then deployed
again), and both phases start on freshly started engines:

- ``affinity``: ``mmtier.serve.affinity_router.MMTierAffinityRouter`` (the replica on the node
  holding the request's media, then its prefix);
- ``default``: Serve's power of two choices (ties broken at random).

Per router and round: the hit ratio (``usage.prompt_tokens_details.cached_tokens`` over prompt
tokens, every request), the median time to first streamed chunk (all requests, and turns after
the first), the groups the replicas pulled from the other node, the images encoded, and the
router's own work per request (its keys and registry lookup, timed here before each request is
sent, under both routers alike: ``router_work_p50_s``). Headlines:
medians over the rounds and the per-round ratios affinity / default. Under both routers the
replicas share through the cluster, so a conversation's later turns hit wherever they land;
what affinity saves is the pulls (and their time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from benchmarks._common import (
    add_out_arg,
    print_table,
    ratio_figures,
    write_results,
)

ROUTERS = ("affinity", "default")


def conversations(seed: int, n: int, turns: int) -> list[list[list[dict]]]:
    """``n`` conversations of ``turns`` user messages each (the first with the conversation's
    image): per conversation, the user contents in order."""
    from tests.support.serve_llm_cluster import data_url
    from tests.support.vllm_mm_models import image, text

    out = []
    for c in range(n):
        s = seed * 1000 + c * 10
        first = [{"type": "text", "text": text(s, 40)},
                 {"type": "image_url", "image_url": {"url": data_url(image(s))}},
                 {"type": "text", "text": text(s + 1, 40)}]
        out.append([first] + [text(s + 1 + t, 30) for t in range(1, turns)])
    return out


def decision_s(keyer, registry, messages: list[dict]) -> float:
    """Seconds the affinity router's own work takes for a request, measured here (not on the
    serving path): its keys (``RequestKeyer``) and the one registry lookup."""
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest

    from tests.support.serve_llm_cluster import MODEL_ID

    t0 = time.perf_counter()
    keys = keyer.submit(ChatCompletionRequest(model=MODEL_ID, messages=messages, max_tokens=1)).result(60)
    registry.lookup(keys.addresses()).get(30)
    return time.perf_counter() - t0


def replay(app, trace, max_tokens: int, keyer=None) -> dict:
    """One pass of the interleaved trace, one streamed request at a time (with ``keyer``: each
    request's routing work timed before it is sent)."""
    from openai import OpenAI

    from tests.support.serve_llm_cluster import MODEL_ID

    client = OpenAI(base_url=app.base + "/v1", api_key="none", timeout=300.0, max_retries=0)
    app.encoded()                                     # reset the encoder counts
    pulled0 = sum(v["pulled"] for v in app.encoded().values())
    history: list[list[dict]] = [[] for _ in trace]
    rows = []
    for turn in range(max(len(c) for c in trace)):
        for c, conv in enumerate(trace):
            if turn >= len(conv):
                continue
            history[c].append({"role": "user", "content": conv[turn]})
            decide = decision_s(keyer, app.registry(), history[c]) if keyer is not None else None
            t0 = time.perf_counter()
            ttft, parts, usage = None, [], None
            stream = client.chat.completions.create(
                model=MODEL_ID, messages=history[c], max_tokens=max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True})
            for chunk in stream:
                if ttft is None and chunk.choices:
                    ttft = time.perf_counter() - t0
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
            history[c].append({"role": "assistant", "content": "".join(parts)})
            details = usage.prompt_tokens_details
            rows.append({"turn": turn, "ttft": ttft, "prompt": usage.prompt_tokens, "decide": decide,
                         "cached": details.cached_tokens if details else 0})
    after = app.encoded()
    return {"hit_ratio": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows),
            "ttft_p50_s": statistics.median(r["ttft"] for r in rows),
            "ttft_later_p50_s": statistics.median(r["ttft"] for r in rows if r["turn"] > 0),
            "pulled_groups": sum(v["pulled"] for v in after.values()) - pulled0,
            "encoded_images": sum(v["encoded"] for v in after.values()),
            "requests": len(rows), "prompt_tokens": sum(r["prompt"] for r in rows),
            "router_work_p50_s": statistics.median(r["decide"] for r in rows) if keyer is not None else 0.0}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--first", choices=ROUTERS, default=ROUTERS[0], help="the router run first")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    from tests.support.serve_llm_cluster import ServeCluster

    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    from mmtier.serve.request_keys import RequestKeyer

    runs: dict[str, list[dict]] = {r: [] for r in ROUTERS}
    order = [args.first] + [r for r in ROUTERS if r != args.first]
    seeds = iter(range(1, 1000))
    with tempfile.TemporaryDirectory(prefix="mmtier-serve-routing-") as tmp:
        app = ServeCluster(tmp, router=order[0], max_ongoing=4)
        try:
            keyer = RequestKeyer(app.config)         # the router's work, timed under both routers
            for router in order:
                if app.router != router:
                    app.route(router)
                for _ in range(args.rounds):
                    trace = conversations(next(seeds), args.conversations, args.turns)
                    runs[router].append(replay(app, trace, args.max_tokens, keyer))
        finally:
            app.close()
    fig: dict = {"rounds": args.rounds, "conversations": args.conversations, "turns": args.turns,
                 "requests_per_pass": runs[ROUTERS[0]][0]["requests"], "max_tokens": args.max_tokens,
                 "load": "one request in flight; two replicas (vLLM CPU build), one per node; routers in turn",
                 "order": " then ".join(order),
                 "cpu_load_avg_1min_start": load_start}
    for r in ROUTERS:
        for k in ("hit_ratio", "ttft_p50_s", "ttft_later_p50_s", "pulled_groups", "encoded_images",
                  "router_work_p50_s"):
            fig[f"{k}_{r}"] = statistics.median(x[k] for x in runs[r])
    a, d = runs["affinity"], runs["default"]
    fig.update(ratio_figures("ttft_affinity_over_default", [x["ttft_p50_s"] for x in a],
                             [x["ttft_p50_s"] for x in d], higher_is_better=False))
    fig.update(ratio_figures("ttft_later_affinity_over_default", [x["ttft_later_p50_s"] for x in a],
                             [x["ttft_later_p50_s"] for x in d], higher_is_better=False))
    if all(x["hit_ratio"] > 0 for x in d):
        fig.update(ratio_figures("hit_ratio_affinity_over_default", [x["hit_ratio"] for x in a],
                                 [x["hit_ratio"] for x in d], higher_is_better=True))
    fig["wall_s"] = time.perf_counter() - t_start
    path = write_results("serve_routing", fig, args.out)
    print_table("serve routing: affinity vs Serve's default", [(k, v) for k, v in sorted(fig.items())
                                                                  if not k.endswith("_pairs")])
    print(f"wrote {path}")
    return fig


if __name__ == "__main__":
    main()
