"""Time to first token of a repeated long prompt on a real vLLM engine (vLLM's CPU build here,
the default multiprocessing executor), four ways side by side:

- ``recompute``: vLLM alone, prefix caching off: the whole prompt is prefilled again;
- ``vllm_prefix``: vLLM's own prefix cache (in its KV blocks; lost when the engine stops);
- ``mmtier_device``: vLLM + mmtier's connector, the prompt's groups loaded from mmtier's pool;
- ``mmtier_disk_restart``: a new engine process over the disk directory an earlier engine
  spilled to (its warm restart), the groups read from Arrow files (the page cache dropped first:
  ``benchmarks.file_faults.drop_cache``).

The image part does the same with an image prompt on the engine tests' tiny LLaVA (CLIP tower,
64 image tokens; text around it), the mmtier engine carrying both connectors (its KV connector
loads the prompt's KV, the image's included; the encoder-cache connector spares the tower where
the KV does not cover the image).

Every round takes a fresh random prompt; each engine sees it once (stored, or recomputed) and
then again (timed: ``generate`` of one token). Engines take turns going first, rounds pair
their figures, and the ratios are medians of the per-round ratios. Run it in the engines
environment: ``.venv-engines/bin/python -m benchmarks.vllm_engine [--rounds N] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# The image part's LLaVA needs its shim and registration in every process vLLM spawns, and a
# spawned process imports this module: so they are installed here, at import.
import tests.vllm_mm_scenarios  # noqa: E402, F401
from benchmarks._common import add_out_arg, write_results  # noqa: E402
from benchmarks.file_faults import drop_cache  # noqa: E402

SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64)
BLOCK = 32


def build_model(path: Path, dtype: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPE, max_position_embeddings=8192, tie_word_embeddings=False,
                      initializer_range=0.05, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path)
    return path


def cache_fields(disk_dir: Path | None, dtype: str, device_bytes: int) -> dict:
    return dict(model="bench-llama-vllm", num_layers=SHAPE["num_hidden_layers"],
                num_kv_heads=SHAPE["num_key_value_heads"], head_dim=SHAPE["head_dim"], dtype=dtype,
                modalities={"text": {"page_size": BLOCK}}, device="cpu", device_bytes=device_bytes,
                host_bytes=0, disk_dir=None if disk_dir is None else str(disk_dir),
                disk_bytes=8 << 30, disk_free_floor_bytes=0)


def engine(model: Path, dtype: str, mmtier: dict | None = None, prefix: bool = False, *,
           extra: dict | None = None, **kw):
    """``mmtier``: a whole cache config (``mmtier_cache``); ``extra``: the connector's extra
    config as given (sizes only); ``kw``: more of ``LLM``'s arguments."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if mmtier is not None or extra is not None:
        kv = KVTransferConfig(kv_connector="MMTierConnector", kv_role="kv_both",
                              kv_connector_module_path="mmtier.integrations.vllm",
                              kv_connector_extra_config=extra if extra is not None else {"mmtier_cache": mmtier})
    args = dict(skip_tokenizer_init=True, enforce_eager=True, block_size=BLOCK, max_model_len=8192, dtype=dtype,
                enable_prefix_caching=prefix, seed=0, kv_transfer_config=kv, max_num_batched_tokens=8192)
    return LLM(str(model), **{**args, **kw})


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def ttft(llm, tokens: list[int]) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    ttft.cached = out[0].num_cached_tokens or 0
    return dt


def image_rounds(work: Path, rounds: int) -> dict[str, list[float]]:
    """TTFT of a repeated image prompt (fresh image and text each round) on three engines."""
    from vllm import SamplingParams

    from tests.vllm_mm_models import build_llava, image, image_prompt, text
    from tests.vllm_mm_scenarios import mm_engine

    model = str(build_llava(work / "llava"))
    engines = {"image_recompute": mm_engine(model, executor="mp"),
               "image_vllm_prefix": mm_engine(model, executor="mp", enable_prefix_caching=True),
               "image_mmtier": mm_engine(model, kv=True, ec=True, executor="mp")}
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    rows: dict[str, list[float]] = {name: [] for name in engines}
    rows["image_prompt_tokens"] = []
    names = list(engines)
    for r in range(rounds):
        req = {"prompt": image_prompt(text(100 + r, 400), text(200 + r, 300)),
               "multi_modal_data": {"image": image(300 + r)}}
        for name in names[r % len(names):] + names[:r % len(names)]:
            engines[name].generate([req], sp, use_tqdm=False)
            time.sleep(0.5)
            t0 = time.perf_counter()
            out = engines[name].generate([req], sp, use_tqdm=False)
            rows[name].append(time.perf_counter() - t0)
        rows["image_prompt_tokens"].append(len(out[0].prompt_token_ids))
    for llm in engines.values():
        close(llm)
    return rows


def main(argv: list[str] | None = None) -> dict:
    import random

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 512 tokens (a check that it runs)")
    ap.add_argument("--no-image", action="store_true", help="skip the image-prompt part")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.prompt = 2, 512
    work = Path(tempfile.mkdtemp(prefix="mmtier-vllm-bench-"))
    model = build_model(work / "model", args.dtype)
    token_bytes = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * 2
    roomy = (args.rounds + 2) * (args.prompt + BLOCK) * token_bytes * 2
    rng = random.Random(0)
    prompts = [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(args.prompt)] for _ in range(args.rounds)]
    disk = work / "spill"

    t_start = time.perf_counter()
    engines = {"recompute": engine(model, args.dtype),
               "vllm_prefix": engine(model, args.dtype, prefix=True),
               "mmtier_device": engine(model, args.dtype, mmtier=cache_fields(None, args.dtype, roomy))}
    rows: dict[str, list[float]] = {name: [] for name in engines}
    cached: dict[str, list[int]] = {name: [] for name in engines}
    names = list(engines)
    for r, p in enumerate(prompts):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            ttft(engines[name], p)                 # stored (or computed) once
            time.sleep(0.5)                        # mmtier's writer thread stores off the step
            rows[name].append(ttft(engines[name], p))
            cached[name].append(ttft.cached)
    for name in ("vllm_prefix", "mmtier_device"):
        close(engines.pop(name))

    # an engine that spills every group to disk, then a new engine process over that directory
    spill = engine(model, args.dtype, mmtier=cache_fields(disk, args.dtype, 40 * BLOCK * token_bytes))
    for p in prompts:
        ttft(spill, p)
    time.sleep(2.0)
    close(spill)
    restarted = engine(model, args.dtype, mmtier=cache_fields(disk, args.dtype, roomy))
    drop_cache(sorted(disk.glob("*.arrow")))
    rows["mmtier_disk_restart"], cached["mmtier_disk_restart"], again = [], [], []
    for r, p in enumerate(prompts):
        pair = [("mmtier_disk_restart", restarted), ("recompute", engines["recompute"])]
        for name, llm in (pair if r % 2 == 0 else pair[::-1]):
            dt = ttft(llm, p)
            if name == "recompute":
                again.append(dt)
            else:
                rows[name].append(dt)
                cached[name].append(ttft.cached)
    close(restarted)
    close(engines.pop("recompute"))

    def ratio(a: list[float], b: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(a, b, strict=True))

    image_tokens = None
    if not args.no_image:
        rows.update(image_rounds(work, args.rounds))
        image_tokens = rows.pop("image_prompt_tokens")[0]

    figures = {
        "rounds": args.rounds, "prompt_tokens": args.prompt, "dtype": args.dtype,
        "model_shape": ",".join(f"{k}={v}" for k, v in SHAPE.items()),
        **{f"ttft_{name}_s": statistics.median(v) for name, v in rows.items()},
        **{f"cached_tokens_{name}": statistics.median(v) for name, v in cached.items()},
        "mmtier_device_over_recompute": ratio(rows["mmtier_device"], rows["recompute"]),
        "vllm_prefix_over_recompute": ratio(rows["vllm_prefix"], rows["recompute"]),
        "mmtier_device_over_vllm_prefix": ratio(rows["mmtier_device"], rows["vllm_prefix"]),
        "mmtier_disk_restart_over_recompute": ratio(rows["mmtier_disk_restart"], again),
        **({} if args.no_image else {
            "image_mmtier_over_recompute": ratio(rows["image_mmtier"], rows["image_recompute"]),
            "image_vllm_prefix_over_recompute": ratio(rows["image_vllm_prefix"], rows["image_recompute"]),
            "image_prompt_tokens": image_tokens}),
        "wall_s": time.perf_counter() - t_start,
    }
    for k, v in figures.items():
        print(f"{k:40s} {v:.4f}" if isinstance(v, float) else f"{k:40s} {v}")
    write_results("vllm_engine", figures, args.out)
    return figures


if __name__ == "__main__":
    main()
