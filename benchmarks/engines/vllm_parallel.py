"""Time to first token of a repeated prompt that vLLM's own prefix cache has let go, on a
tensor-parallel engine (vLLM's CPU build, ``tensor_parallel_size=2``, a worker process per
rank), two engines side by side:

- ``recompute``: vLLM with its prefix cache on, a KV block pool too small to keep the prompt
  once fillers went through: the repeat is prefilled again;
- ``mmtier``: the same engine with mmtier's connector given only sizes (the shape read from
  vLLM: each worker keeps its own heads of every group): the repeat is loaded from mmtier.

Each round takes a fresh prompt A: A, then fillers that push A out of vLLM's blocks, then A
again (timed: ``generate`` of one token). The engines take turns going first; the ratio is the
median of the per-round ratios. Run it in the engines environment:
``.venv-engines/bin/python -m benchmarks.engines.vllm_parallel [--rounds N] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from benchmarks._common import add_out_arg, write_results  # noqa: E402
from benchmarks.engines import vllm_engine  # noqa: E402
from benchmarks.engines.vllm_engine import BLOCK, SHAPE, build_model, close, ttft  # noqa: E402

TP = 2
FILLERS = 3


def engine(model: Path, dtype: str, blocks: int, max_len: int, sizes: dict | None = None):
    """A TP=2 engine with vLLM's prefix cache on; ``sizes``: mmtier's connector given only them."""
    return vllm_engine.engine(model, dtype, prefix=True, extra=sizes, max_model_len=max_len,
                              tensor_parallel_size=TP, num_gpu_blocks_override=blocks,
                              distributed_executor_backend="mp")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="1 round of 512 tokens (a check that it runs)")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.prompt = 1, 512
    work = Path(tempfile.mkdtemp(prefix="mmtier-vllm-tp-bench-"))
    model = build_model(work / "model", args.dtype)
    # vLLM's pool: two prompts' blocks (the fillers push A out); mmtier's pool keeps every round
    blocks = 2 * (args.prompt // BLOCK + 2)
    rng = random.Random(0)

    def fresh() -> list[int]:
        return [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(args.prompt)]

    t_start = time.perf_counter()
    sizes = {"mmtier_device_bytes": "512MiB", "mmtier_host_bytes": 0}
    max_len = args.prompt + 2 * BLOCK
    engines = {"recompute": engine(model, args.dtype, blocks, max_len),
               "mmtier": engine(model, args.dtype, blocks, max_len, sizes=sizes)}
    rows: dict[str, list[float]] = {name: [] for name in engines}
    cached: dict[str, list[int]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(args.rounds):
        a, fillers = fresh(), [fresh() for _ in range(FILLERS)]
        for name in names[r % 2:] + names[:r % 2]:
            llm = engines[name]
            ttft(llm, a)
            for f in fillers:
                ttft(llm, f)
            time.sleep(0.5)                         # mmtier's writer threads store off the step
            rows[name].append(ttft(llm, a))
            cached[name].append(ttft.cached)
    for llm in engines.values():
        close(llm)
    figures = {
        "rounds": args.rounds, "prompt_tokens": args.prompt, "dtype": args.dtype, "tensor_parallel_size": TP,
        "vllm_blocks": blocks, "model_shape": ",".join(f"{k}={v}" for k, v in SHAPE.items()),
        **{f"ttft_{name}_s": statistics.median(v) for name, v in rows.items()},
        **{f"cached_tokens_{name}": statistics.median(v) for name, v in cached.items()},
        "mmtier_over_recompute": statistics.median(
            m / c for m, c in zip(rows["mmtier"], rows["recompute"], strict=True)),
        "load_avg_1m": os.getloadavg()[0],
        "wall_s": time.perf_counter() - t_start,
    }
    for k, v in figures.items():
        print(f"{k:36s} {v:.4f}" if isinstance(v, float) else f"{k:36s} {v}")
    write_results("vllm_parallel", figures, args.out)
    return figures


if __name__ == "__main__":
    main()
