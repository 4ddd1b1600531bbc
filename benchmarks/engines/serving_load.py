"""Serving under load: an open-loop generator replays multi-turn multimodal conversations against
two vLLM OpenAI API servers on 127.0.0.1 (``python -m vllm.entrypoints.openai.api_server`` from
the engines environment, ``mmtier.demo.engines``), both with vLLM's own prefix cache on and a KV
block pool that holds a fraction of the conversations:

- ``plain``: vLLM alone;
- ``mmtier``: the same engine with mmtier's KV and encoder-cache connectors (sizes only: a page
  pool, a host tier and a disk tier).

The trace: conversations that open with one shared system prompt, turns of text with images
from a small catalogue (an image recurs across turns and users) and greedy answers of a length
drawn per turn (log-normal around ``answer_median`` tokens, clipped to ``answer_range``: chat
answers run to hundreds of tokens), sampled from the tiny tokenizer's words only so that the
next turn's prompt, which carries the answer the engine generated, repeats its ids. Requests have
Poisson arrival times of rate ``r`` in the interleaved order (every conversation's turn 1, then
every turn 2, ...); a later turn is sent at its arrival time or when its previous answer ends,
whichever is later (a chat cannot ask before it has the answer), so a rate is an offered rate
that a slow engine also lowers for itself. Bounded in count (``--requests``) and time
(``--max-seconds``: what has not finished by then counts as not completed). Each rate replays
fresh conversations (its own words and images), first on one engine and then on the other (the
order alternates by rate), both servers up throughout.

Per rate and engine: requests/s completed, prompt and output tokens/s, p50 / p99 time to first token (a
request not completed counts as infinitely late), hit ratio (cached / prompt tokens, vLLM's
``usage.prompt_tokens_details.cached_tokens``: its own prefix cache and mmtier's together).
The sustainable rate at a p99 bound is the highest rate tried whose p99 TTFT is within the bound
(every request completed); the headline is mmtier's over plain's. A PNG plot under
``benchmarks/results/`` (matplotlib, where it imports).

Run it from the base environment (the engines start from ``.venv-engines``):
``.venv/bin/python -m benchmarks.engines.serving_load [--rates 0.25,0.5,1,2] [--quick]``.

``--durability`` compares mmtier with its write-behind to the disk tier off (``mmtier_wb_off``)
and on (``mmtier``, the default) on the same trace instead (``serving_load_durability.json``):
the cost of being durable, with each engine's durable writes, bytes per request and the
save-to-durable lag read from its workers' caches (``/collective_rpc``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import add_out_arg, write_results

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class LoadSpec:
    # 8 conversations of 4 turns with answers of 128-512 tokens (median 192): a working set of
    # ~3x vLLM's pool (4,096 tokens: two or three chats resident while they decode), later turns
    # carry a history of 500-1,900 tokens. The rates are low: on this machine's 2 cores the
    # answers' decode, not the prompts, sets what an engine completes
    rates: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)
    conversations: int = 8
    turns: int = 4
    requests: int = 32                  # per rate and engine, at most (every conversation's turns)
    max_seconds: float = 180.0          # per rate and engine
    p99_bound_s: float = 2.0
    system_words: int = 200
    user_words: int = 60
    answer_median: int = 192
    answer_range: tuple[int, int] = (128, 512)
    p_image: float = 0.5
    images: int = 6
    kv_blocks: int = 128                # vLLM's pool: 4,096 tokens
    device_bytes: int = 512 << 20
    host_bytes: int = 1 << 30

    @classmethod
    def quick(cls) -> LoadSpec:
        return cls(rates=(1.0,), conversations=3, turns=2, requests=6, max_seconds=90.0, p99_bound_s=60.0,
                   system_words=60, user_words=40, images=2, kv_blocks=40, answer_median=48, answer_range=(40, 64))


@dataclass(frozen=True)
class Turn:
    user: dict                          # the user's message (text, maybe an image)
    answer_tokens: int                  # the answer's length, drawn per turn


def trace(spec: LoadSpec, seed: int) -> tuple[dict, list[list[Turn]]]:
    """One rate's conversations: the shared system message and each conversation's turns."""
    from mmtier.demo.serving import answer_length, data_url
    from mmtier.serve.tiny_models import text

    rng = random.Random(seed)
    system = {"role": "system", "content": text(10_000, spec.system_words)}      # shared by every rate
    convs = []
    for _ in range(spec.conversations):
        turns = []
        for i in range(spec.turns):
            content: list[dict] = []
            if i == 0 or rng.random() < spec.p_image:
                img = 1000 * seed + 1 + min(int(rng.expovariate(0.6)), spec.images - 1)
                content.append({"type": "image_url", "image_url": {"url": data_url(img, "PNG")}})
            content.append({"type": "text", "text": text(rng.randrange(1 << 30), spec.user_words)})
            turns.append(Turn({"role": "user", "content": content}, answer_length(spec, rng)))
        convs.append(turns)
    return system, convs


def interleaved(convs: list[list[Turn]], limit: int) -> list[tuple[int, int]]:
    """(conversation, turn) in the order requests arrive: every turn 1, then every turn 2, ...,
    the first ``limit`` of them."""
    order = [(c, i) for i in range(max((len(t) for t in convs), default=0)) for c in range(len(convs))
             if i < len(convs[c])]
    return order[:limit]


async def one_request(client, url: str, model: str, messages: list[dict], max_tokens: int, t_send: float) -> dict:
    from mmtier.demo.serving import WORD_IDS

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "allowed_token_ids": WORD_IDS}
    first, usage, parts = None, None, []
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0].get("delta", {}).get("content") if chunk.get("choices") else None
            if delta:
                if first is None:
                    first = time.perf_counter() - t_send
                parts.append(delta)
            if chunk.get("usage"):
                usage = chunk["usage"]
    done = time.perf_counter()
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft_s": first if first is not None else done - t_send, "done": done, "text": "".join(parts),
            "prompt_tokens": (usage or {}).get("prompt_tokens", 0), "cached_tokens": details.get("cached_tokens") or 0,
            "output_tokens": (usage or {}).get("completion_tokens", 0)}


async def run_rate(base_url: str, model: str, convs: tuple[dict, list[list[Turn]]], rate: float,
                   spec: LoadSpec, seed: int) -> dict:
    """Request k arrives at the k-th Poisson time of ``rate`` and is sent then or when its
    conversation's previous answer ends (its prompt carries that answer); what has not finished
    by ``max_seconds`` is cancelled and counts as not completed, with the turns after it."""
    import httpx

    system, turns = convs
    order = interleaved(turns, spec.requests)
    rng = random.Random(seed)
    t, arrival = 0.0, {}
    for pos in order:
        arrival[pos] = t
        t += rng.expovariate(rate)
    results: dict[tuple[int, int], dict] = {}
    limits = httpx.Limits(max_connections=len(turns) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec.max_seconds + 30), limits=limits) as client:
        t0 = time.perf_counter()

        async def chat(c: int) -> None:
            messages = [system]
            for i, turn in enumerate(turns[c]):
                if (c, i) not in arrival:
                    return
                await asyncio.sleep(max(0.0, t0 + arrival[(c, i)] - time.perf_counter()))
                messages = messages + [turn.user]
                try:
                    r = await one_request(client, base_url + "/v1/chat/completions", model, messages,
                                          turn.answer_tokens, time.perf_counter())
                except (httpx.HTTPError, ValueError) as exc:      # counted as not completed, with the rest
                    results[(c, i)] = {"error": repr(exc)}
                    return
                results[(c, i)] = r
                messages = messages + [{"role": "assistant", "content": r["text"]}]

        tasks = [asyncio.create_task(chat(c)) for c in range(len(turns))]
        _, pending = await asyncio.wait(tasks, timeout=spec.max_seconds)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    ok = [r for r in results.values() if "error" not in r]
    errors = [r["error"] for r in results.values() if "error" in r]
    span = (max(r["done"] for r in ok) - t0) if ok else float("nan")
    ttfts = sorted([r["ttft_s"] for r in ok] + [math.inf] * (len(order) - len(ok)))
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {"rate": rate, "sent": len(order), "completed": len(ok), "errors": errors[:3],
            "completed_per_s": len(ok) / span if ok else 0.0, "prompt_tokens_per_s": prompt / span if ok else 0.0,
            "output_tokens_per_s": sum(r["output_tokens"] for r in ok) / span if ok else 0.0,
            "output_tokens": sum(r["output_tokens"] for r in ok),
            "ttft_p50_s": _quantile(ttfts, 0.5), "ttft_p99_s": _quantile(ttfts, 0.99),
            "hit_ratio": sum(r["cached_tokens"] for r in ok) / prompt if prompt else 0.0,
            "prompt_tokens": prompt, "offered_span_s": max(arrival.values(), default=0.0)}


def peak_throughput(per_engine: dict[str, list[dict]], ref: str = "plain", test: str = "mmtier") -> dict:
    """The most requests/s each engine completed at any rate (where the offered load outran
    it: its capacity on this machine), and ``test``'s over ``ref``'s: a figure that does not hang
    on the grid of rates tried, as the sustainable rate does."""
    peak = {name: max((r["completed_per_s"] for r in rows), default=0.0) for name, rows in per_engine.items()}
    return {f"peak_completed_per_s_{ref}": peak[ref], f"peak_completed_per_s_{test}": peak[test],
            f"peak_completed_{test}_over_{ref}": peak[test] / peak[ref] if peak[ref] else math.nan}


def _quantile(xs: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted ``xs`` (inf where a request did not complete)."""
    if not xs:
        return math.nan
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def sustainable(rows: list[dict], bound: float) -> float:
    """The highest rate whose p99 TTFT is within ``bound`` with every request completed (0: none)."""
    good = [r["rate"] for r in rows if r["ttft_p99_s"] <= bound and r["completed"] == r["sent"]]
    return max(good, default=0.0)


def plot(per_engine: dict[str, list[dict]], bound: float, path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name, rows in per_engine.items():
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [min(r["ttft_p99_s"], 1e3) for r in rows], "o-", label=f"{name} p99")
        axes[0].plot(rates, [min(r["ttft_p50_s"], 1e3) for r in rows], "x--", label=f"{name} p50")
        axes[1].plot(rates, [r["completed_per_s"] for r in rows], "o-", label=name)
        axes[2].plot(rates, [r["hit_ratio"] for r in rows], "o-", label=name)
    axes[0].axhline(bound, color="red", lw=0.8, label=f"p99 bound {bound:g} s")
    axes[0].set(xlabel="offered rate (req/s)", ylabel="TTFT (s)", yscale="log", title="time to first token")
    axes[1].set(xlabel="offered rate (req/s)", ylabel="completed req/s", title="throughput")
    axes[2].set(xlabel="offered rate (req/s)", ylabel="cached / prompt tokens", title="hit ratio", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# the engine pairs a run compares: (reference, measured); ``durability`` is mmtier with its
# write-behind to the disk tier off vs on (the default), the cost of being durable
PAIRS = {"plain": ("plain", "mmtier"), "durability": ("mmtier_wb_off", "mmtier")}


def durable_figures(counters: list[dict], completed: int) -> dict:
    """The write-behind's figures over one engine's caches: writes, bytes per completed request,
    drops, and the save-to-durable lag (p50 of the busiest cache, p99 and max over all)."""
    total = {k: sum(c.get(k, 0) for c in counters) for k in ("durable_writes", "durable_bytes", "durable_dropped",
                                                                 "durable_write_errors")}
    busiest = max(counters, key=lambda c: c.get("durable_writes", 0), default={})
    return {**total, "durable_bytes_per_request": total["durable_bytes"] / completed if completed else math.nan,
            "durable_lag_p50_ms": busiest.get("durable_lag_p50_ms", 0),
            "durable_lag_p99_ms": max((c.get("durable_lag_p99_ms", 0) for c in counters), default=0),
            "durable_lag_max_ms": max((c.get("durable_lag_max_ms", 0) for c in counters), default=0)}


def main(argv: list[str] | None = None) -> dict:
    from mmtier.demo.engines import EngineServer, EngineSpec, mmtier_sizes
    from mmtier.demo.model import ensure_demo_llava

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", help="offered rates, req/s, comma-separated (default 0.25,0.5,1,2)")
    ap.add_argument("--requests", type=int, help="requests per rate and engine, at most")
    ap.add_argument("--max-seconds", type=float, help="time bound per rate and engine")
    ap.add_argument("--p99-bound", type=float, help="p99 TTFT bound of the sustainable rate, seconds")
    ap.add_argument("--quick", action="store_true", help="one rate, a few requests (a check that it runs)")
    ap.add_argument("--durability", action="store_true",
                    help="compare mmtier with its write-behind off and on (serving_load_durability.json) "
                         "instead of plain vLLM and mmtier")
    ap.add_argument("--engines-python", default=str(ROOT / ".venv-engines" / "bin" / "python"),
                    help="the engines environment's interpreter (vLLM)")
    ap.add_argument("--log", type=Path, help="the engines' log (default OUT/serving_load_engines.log)")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    spec = LoadSpec.quick() if args.quick else LoadSpec()
    over = {"rates": tuple(float(x) for x in args.rates.split(",")) if args.rates else None,
            "requests": args.requests, "max_seconds": args.max_seconds, "p99_bound_s": args.p99_bound}
    spec = LoadSpec(**{**spec.__dict__, **{k: v for k, v in over.items() if v is not None}})
    ref, test = PAIRS["durability" if args.durability else "plain"]
    result_name = "serving_load_durability" if args.durability else "serving_load"
    engines_python = args.engines_python if Path(args.engines_python).exists() else sys.executable
    log = args.log or args.out / f"{result_name}_engines.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    # a SIGTERM (timeout, kill) unwinds through the servers' stop: no engine outlives the run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    model = str(ensure_demo_llava())
    per_engine: dict[str, list[dict]] = {ref: [], test: []}
    durable: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="mmtier-load-disk-") as disk:
        common = dict(model=model, kv_blocks=spec.kv_blocks, max_model_len=spec.kv_blocks * 32 - 64,
                      images_per_prompt=spec.turns, max_num_seqs=16, python=engines_python)

        def sizes(name: str, **extra) -> dict:
            return {**mmtier_sizes(Path(disk) / name, device_bytes=spec.device_bytes, host_bytes=spec.host_bytes),
                    **extra}

        specs = {"plain": EngineSpec("plain", **common),
                 "mmtier": EngineSpec("mmtier", mmtier=sizes("mmtier"), **common),
                 "mmtier_wb_off": EngineSpec("mmtier_wb_off", mmtier=sizes("mmtier_wb_off", mmtier_write_behind=False),
                                             **common)}
        servers = {name: EngineServer(specs[name], log) for name in (ref, test)}
        try:
            for s in servers.values():
                s.start()
            for name, s in servers.items():
                s.wait_ready()
                warm = LoadSpec(**{**spec.__dict__, "conversations": 1, "turns": 1, "requests": 1,
                                   "rates": (1.0,)})          # first-request costs off the clock
                asyncio.run(run_rate(s.base_url, name, trace(warm, seed=999), 1.0, warm, seed=0))
            started_s = time.perf_counter() - t_start
            # the warm-up's writes are not the trace's
            before = {name: durable_figures(s.cache_counters(), 1) for name, s in servers.items()} \
                if args.durability else {}
            for k, rate in enumerate(spec.rates):
                requests = trace(spec, seed=k + 1)
                names = (ref, test) if k % 2 == 0 else (test, ref)
                for name in names:
                    row = asyncio.run(run_rate(servers[name].base_url, name, requests, rate, spec, seed=k))
                    per_engine[name].append(row)
                    print(f"[{result_name}] {name:13s} rate {rate:5.2f}/s: {row['completed']}/{row['sent']} done, "
                          f"{row['completed_per_s']:.2f} req/s, {row['prompt_tokens_per_s']:.0f} prompt tok/s, "
                          f"TTFT p50 {row['ttft_p50_s']:.2f} s p99 {row['ttft_p99_s']:.2f} s, "
                          f"hit {row['hit_ratio']:.2f}", flush=True)
            if args.durability:
                for name, s in servers.items():
                    done = sum(r["completed"] for r in per_engine[name])
                    after = durable_figures(s.cache_counters(), done)
                    for k in ("durable_writes", "durable_bytes", "durable_dropped", "durable_write_errors"):
                        after[k] -= before[name][k]
                    after["durable_bytes_per_request"] = after["durable_bytes"] / done if done else math.nan
                    durable[name] = after
        finally:
            for s in servers.values():
                s.stop()
    for rows in per_engine.values():
        rows.sort(key=lambda r: r["rate"])
    sus = {name: sustainable(rows, spec.p99_bound_s) for name, rows in per_engine.items()}
    png = plot(per_engine, spec.p99_bound_s, args.out / f"{result_name}.png")
    figures: dict = {
        "rates": ",".join(f"{r:g}" for r in spec.rates), "conversations_per_rate": spec.conversations,
        "turns": spec.turns, "requests_per_rate": min(spec.requests, spec.conversations * spec.turns),
        "max_seconds_per_rate": spec.max_seconds, "p99_bound_s": spec.p99_bound_s,
        "vllm_kv_tokens": spec.kv_blocks * 32, "mmtier_device_bytes": spec.device_bytes,
        "mmtier_host_bytes": spec.host_bytes, "answer_tokens_median": spec.answer_median,
        "answer_tokens_min": spec.answer_range[0], "answer_tokens_max": spec.answer_range[1],
        "engines_start_s": started_s,
        "load_1min_before": load_before[0], "load_1min_after": os.getloadavg()[0],
        f"sustainable_rate_{ref}": sus[ref], f"sustainable_rate_{test}": sus[test],
        f"sustainable_{test}_over_{ref}": (sus[test] / sus[ref]) if sus[ref] else math.nan,
        # what each engine generated at its own sustainable rate (0: no rate was sustained)
        **{f"output_tokens_per_s_at_sustainable_{name}": next(
            (r["output_tokens_per_s"] for r in rows if r["rate"] == sus[name]), 0.0) for name, rows in per_engine.items()},
        "plot": str(png) if png is not None else "(matplotlib not in this environment)",
        "engines_log": str(log),
    }
    for name, rows in per_engine.items():
        for r in rows:
            tag = f"{name}__r{r['rate']:g}"
            for key in ("completed_per_s", "prompt_tokens_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
                        "hit_ratio"):
                figures[f"{key}_{tag}"] = r[key]
            figures[f"completed_{tag}"] = f"{r['completed']}/{r['sent']}"
            if r["errors"]:
                figures[f"errors_{tag}"] = "; ".join(r["errors"])
    pairs = list(zip(per_engine[test], per_engine[ref]))
    for q in ("p50", "p99"):
        ratios = [a[f"ttft_{q}_s"] / b[f"ttft_{q}_s"] for a, b in pairs
                  if b[f"ttft_{q}_s"] > 0 and math.isfinite(a[f"ttft_{q}_s"]) and math.isfinite(b[f"ttft_{q}_s"])]
        if q == "p50" or args.durability:
            figures[f"ttft_{q}_{test}_over_{ref}_median"] = statistics.median(ratios) if ratios else math.nan
    if args.durability:
        out_ratio = [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in pairs if b["output_tokens_per_s"] > 0]
        figures[f"output_tokens_per_s_{test}_over_{ref}_median"] = statistics.median(out_ratio) if out_ratio else math.nan
        for name, d in durable.items():
            figures.update({f"{k}_{name}": v for k, v in d.items()})
    figures.update(peak_throughput(per_engine, ref, test))
    figures["wall_s"] = time.perf_counter() - t_start
    for k, v in figures.items():
        print(f"{k:52s} {v:.4f}" if isinstance(v, float) else f"{k:52s} {v}")
    write_results(result_name, figures, args.out)
    return figures


if __name__ == "__main__":
    main()
