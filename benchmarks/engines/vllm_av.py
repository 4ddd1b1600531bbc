"""Time to first token of a repeated audio prompt and a repeated video prompt on real vLLM
engines (vLLM's CPU build, its default multiprocessing executor), three engines side by side:

- ``recompute``: vLLM alone, prefix caching off: the prompt and its item are computed again;
- ``vllm_prefix``: vLLM's own prefix cache, which still holds the prompt;
- ``mmtier``: vLLM + mmtier's KV and encoder-cache connectors with vLLM's prefix caching off,
  which is where vLLM stands once it has evicted the prompt: what is not computed is mmtier's.

Models: the tiny Qwen2-Audio (a clip of a second, 25 tokens) and the tiny Qwen2-VL (16 frames,
32 tokens) of the engine tests, 400 words before the item and 300 after. Every round takes a
fresh item and fresh words; each engine sees the prompt once, then again (timed: ``generate``
of one token); engines take turns going first, and the figures are medians of the per-round
ratios. ``.venv-engines/bin/python -m benchmarks.engines.vllm_av [--rounds N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from benchmarks._common import add_out_arg, write_results  # noqa: E402


def media_rounds(medium: str, model: str, rounds: int) -> dict[str, list[float]]:
    from vllm import SamplingParams
    from vllm.config import ECTransferConfig

    from mmtier.serve.tiny_audio import SAMPLE_RATE, audio_prompt, clip
    from mmtier.serve.tiny_models import text
    from mmtier.serve.tiny_video import frames, video_prompt
    from tests.support.vllm_av_scenarios import ARGS, EC_CONNECTOR
    from tests.support.vllm_scenarios import engine

    sizes = {"mmtier_host_bytes": "256MiB", "mmtier_tenant": "bench"}
    ec = ECTransferConfig(ec_connector="MMTierECConnector", ec_connector_module_path=EC_CONNECTOR,
                          ec_role="ec_both", ec_connector_extra_config=dict(sizes))
    kw = dict(ARGS, limit_mm_per_prompt={medium: 1}, max_num_batched_tokens=2048)
    engines = {"recompute": engine(model, executor="mp", **kw),
               "vllm_prefix": engine(model, executor="mp", enable_prefix_caching=True, **kw),
               "mmtier": engine(model, mmtier={**sizes, "mmtier_chunk_blocks": 1}, executor="mp",
                                ec_transfer_config=ec, **kw)}
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    rows: dict[str, list[float]] = {name: [] for name in engines}
    rows.update({f"{name}_cached": [] for name in engines})
    rows["prompt_tokens"] = []
    names = list(engines)
    for r in range(rounds):
        wrap, item = ((audio_prompt, (clip(500 + r), SAMPLE_RATE)) if medium == "audio"
                      else (video_prompt, frames(500 + r, 16)))
        req = {"prompt": wrap(text(100 + r, 400), text(200 + r, 300)), "multi_modal_data": {medium: item}}
        for name in names[r % len(names):] + names[:r % len(names)]:
            engines[name].generate([req], sp, use_tqdm=False)
            time.sleep(0.5)                      # the connector's writer stores off the step
            t0 = time.perf_counter()
            out = engines[name].generate([req], sp, use_tqdm=False)
            rows[name].append(time.perf_counter() - t0)
            rows[f"{name}_cached"].append(out[0].num_cached_tokens or 0)
        rows["prompt_tokens"].append(len(out[0].prompt_token_ids))
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    return rows


def ratio(num: list[float], den: list[float]) -> float:
    return round(statistics.median(a / b for a, b in zip(num, den, strict=True)), 3)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lm", default=None, metavar="LAYERSxHIDDEN",
                    help="a larger language model for both (e.g. 8x512, the shape of benchmarks/engines/vllm_engine.py); "
                         "results then go to vllm_av_LAYERSxHIDDEN.json")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    size = {}
    if args.lm:
        layers, hidden = (int(x) for x in args.lm.lower().split("x"))
        size = {"layers": layers, "hidden": hidden}
    from mmtier.serve.tiny_audio import ensure_tiny_qwen2_audio
    from mmtier.serve.tiny_video import ensure_tiny_qwen2_vl

    work = Path(tempfile.mkdtemp(prefix="mmtier-vllm-av-"))
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    figures: dict = {"rounds": args.rounds, "load_before_1min": float(load_before[0]),
                     "language_model": args.lm or "2x128"}
    sides = ("recompute", "vllm_prefix", "mmtier")
    for medium, model in (("audio", ensure_tiny_qwen2_audio(work, **size)), ("video", ensure_tiny_qwen2_vl(work, **size))):
        rows = media_rounds(medium, str(model), args.rounds)
        figures[f"{medium}_prompt_tokens"] = rows["prompt_tokens"][0]
        for n in sides:
            figures[f"{medium}_{n}_ttft_median_s"] = round(statistics.median(rows[n]), 4)
            figures[f"{medium}_{n}_cached_median"] = statistics.median(rows[f"{n}_cached"])
        figures[f"{medium}_mmtier_over_recompute"] = ratio(rows["mmtier"], rows["recompute"])
        figures[f"{medium}_mmtier_over_vllm_prefix"] = ratio(rows["mmtier"], rows["vllm_prefix"])
        figures[f"{medium}_vllm_prefix_over_recompute"] = ratio(rows["vllm_prefix"], rows["recompute"])
    figures["load_after_1min"] = float(Path("/proc/loadavg").read_text().split()[0])
    print(figures)
    write_results(f"vllm_av_{args.lm.lower()}" if args.lm else "vllm_av", figures, args.out)
    return figures


if __name__ == "__main__":
    main()
