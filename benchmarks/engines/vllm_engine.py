"""Time to first token of a repeated long prompt on a real vLLM engine (vLLM's CPU build here,
the default multiprocessing executor), four ways side by side:

- ``recompute``: vLLM alone, prefix caching off: the whole prompt is prefilled again;
- ``vllm_prefix``: vLLM's own prefix cache (in its KV blocks; lost when the engine stops);
- ``mmtier_device``: vLLM + mmtier's connector, the prompt's groups loaded from mmtier's pool;
- ``mmtier_disk_restart``: a new engine process over the disk directory an earlier engine
  spilled to (its warm restart), the groups read from Arrow files (the page cache dropped first:
  ``benchmarks.file_faults.drop_cache``).

The hybrid part (``--hybrid``: that part alone, into ``vllm_engine_hybrid.json``) does it on a
Gemma 3 of the same size whose layers alternate sliding-window (512 tokens) and full attention,
vLLM's hybrid allocator on (two KV cache groups; mmtier's connector implements ``SupportsHMA``):

- ``hybrid_recompute``: vLLM alone, prefix caching off;
- ``hybrid_vllm_prefix``: vLLM's own prefix cache hit;
- ``hybrid_mmtier``: vLLM + mmtier, its prefix cache on but reset before the repeat (vLLM's own
  cache lost the prompt, as pressure on its pool would make it): the repeat waits while mmtier's
  reader thread writes each layer through its own group's block table (a sliding layer gets the
  last window only), then prefills the rest.

Every repeat's greedy tokens are checked against ``hybrid_recompute``'s (the timed first token,
then 8 more tokens untimed; ``greedy_mismatches``). The hybrid part runs in float32 (as the
engine tests' Gemma 3): in bfloat16 random weights meet near-ties that the engines' differing
summation orders settle either way (a fresh prompt's decode on an engine with the connector
and one without differs by ~0.06 in log-probability in bfloat16, not at all in float32).

The image part does the same with an image prompt on the engine tests' tiny LLaVA (CLIP tower,
64 image tokens; text around it), the mmtier engine carrying both connectors (its KV connector
loads the prompt's KV, the image's included; the encoder-cache connector spares the tower where
the KV does not cover the image).

Every round takes a fresh random prompt; each engine sees it once (stored, or recomputed) and
then again (timed: ``generate`` of one token). Engines take turns going first, rounds pair
their figures, and the ratios are medians of the per-round ratios. Run it in the engines
environment: ``.venv-engines/bin/python -m benchmarks.engines.vllm_engine [--rounds N] [--quick]``.
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
import tests.support.vllm_mm_scenarios  # noqa: E402, F401
from benchmarks._common import add_out_arg, ratio_figures, write_results  # noqa: E402
from benchmarks.file_faults import drop_cache  # noqa: E402

SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64)
BLOCK = 32
HYBRID_WINDOW = 512               # the Gemma 3's sliding layers: a quarter of a 2,048-token prompt
CHECK_TOKENS = 8                  # greedy tokens compared after each hybrid round (untimed)


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


def build_gemma3(path: Path, dtype: str) -> Path:
    """A Gemma 3 of ``SHAPE``, its layers sliding-window (``HYBRID_WINDOW``) and full attention in
    turn; every weight drawn from N(0, 0.1) (``tests.support.vllm_models._randomized``: Gemma's own
    initializers give weights that repeat one token)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tests.support.vllm_models import _randomized

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    layers = ["sliding_attention", "full_attention"] * (SHAPE["num_hidden_layers"] // 2)
    cfg = Gemma3TextConfig(**SHAPE, max_position_embeddings=8192, sliding_window=HYBRID_WINDOW, layer_types=layers,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    _randomized(Gemma3ForCausalLM(cfg).to(getattr(torch, dtype)), 0.1).save_pretrained(path)
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
                              kv_connector_module_path="mmtier.engines.vllm.connector",
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
    ttft.tokens = list(out[0].outputs[0].token_ids)
    return dt


def greedy(llm, tokens: list[int], n: int) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)
    greedy.cached = out[0].num_cached_tokens or 0
    return list(out[0].outputs[0].token_ids)


def hybrid_on(llm) -> bool:
    """vLLM kept its hybrid allocator on (a KV cache group per kind of layer)."""
    return llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False


def forget(llm) -> None:
    """vLLM's own prefix cache lets every prompt go (``reset_prefix_cache``; mmtier's connector
    is left alone). vLLM refuses while a request holds blocks: a request whose load is still
    being written keeps them a moment after it finished."""
    for _ in range(100):
        if llm.reset_prefix_cache():
            return
        time.sleep(0.05)
    raise RuntimeError("vLLM did not reset its prefix cache: blocks still held after 5 s")


def loadavg() -> str:
    """The machine's 1, 5 and 15 minute load (other jobs share its two cores)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def hybrid(work: Path, rounds: int, prompt: int, dtype: str) -> dict:
    """TTFT of a repeat on the Gemma 3 (three engines, the hybrid allocator on), paired rounds."""
    import random

    load_before = loadavg()
    model = build_gemma3(work / "gemma3", dtype)
    size = 2 if dtype == "bfloat16" else 4
    token_bytes = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * size
    roomy = (rounds + 2) * (prompt + BLOCK) * token_bytes * 2
    fields = {**cache_fields(None, dtype, roomy), "model": "bench-gemma3-vllm"}
    rng = random.Random(1)
    prompts = [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(prompt)] for _ in range(rounds)]

    t_start = time.perf_counter()
    engines = {"hybrid_recompute": engine(model, dtype),
               "hybrid_vllm_prefix": engine(model, dtype, prefix=True),
               "hybrid_mmtier": engine(model, dtype, mmtier=fields, prefix=True)}
    on = {name: hybrid_on(llm) for name, llm in engines.items()}
    if not on["hybrid_mmtier"]:
        raise RuntimeError("vLLM turned its hybrid allocator off with mmtier's connector: not the case measured")
    rows: dict[str, list[float]] = {name: [] for name in engines}
    cached: dict[str, list[int]] = {name: [] for name in engines}
    check_cached: list[int] = []
    mismatches = {name: 0 for name in engines if name != "hybrid_recompute"}
    distinct: set[int] = set()                     # the check means something: not one token repeated
    differ: list[str] = []
    names = list(engines)
    for r, p in enumerate(prompts):
        first: dict[str, list[int]] = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            llm = engines[name]
            ttft(llm, p)                           # stored (or computed) once
            time.sleep(0.5)                        # mmtier's writer thread stores off the step
            if name == "hybrid_mmtier":
                forget(llm)                        # vLLM's own cache lost the prompt: mmtier's hit
            rows[name].append(ttft(llm, p))
            cached[name].append(ttft.cached)
            first[name] = ttft.tokens
        check: dict[str, list[int]] = {}
        for name in names:                         # untimed: more greedy tokens of the repeat
            if name == "hybrid_mmtier":
                time.sleep(0.2)
                forget(engines[name])
            check[name] = first[name] + greedy(engines[name], p, CHECK_TOKENS)
            if name == "hybrid_mmtier":
                check_cached.append(greedy.cached)
        for name in mismatches:
            mismatches[name] += check[name] != check["hybrid_recompute"]
            if check[name] != check["hybrid_recompute"]:
                at = next(i for i, (a, b) in enumerate(zip(check[name], check["hybrid_recompute"])) if a != b)
                differ.append(f"round {r} {name.removeprefix('hybrid_')}: token {at} of "
                              f"{check[name]} vs recompute's {check['hybrid_recompute']}")
        distinct.update(check["hybrid_recompute"])
    for llm in engines.values():
        close(llm)
    rec = rows["hybrid_recompute"]
    return {
        "hybrid_rounds": rounds, "hybrid_prompt_tokens": prompt, "hybrid_dtype": dtype,
        "hybrid_model": f"Gemma 3, {SHAPE['num_hidden_layers']} layers sliding {HYBRID_WINDOW} / full in turn",
        "model_shape": ",".join(f"{k}={v}" for k, v in SHAPE.items()),
        **{f"hybrid_allocator_on_{name.removeprefix('hybrid_')}": v for name, v in on.items()},
        **{f"ttft_{name}_s": statistics.median(v) for name, v in rows.items()},
        **{f"cached_tokens_{name}": statistics.median(v) for name, v in cached.items()},
        "cached_tokens_hybrid_mmtier_check": statistics.median(check_cached),
        "cached_tokens_hybrid_mmtier_each": " ".join(map(str, cached["hybrid_mmtier"] + check_cached)),
        **ratio_figures("hybrid_mmtier_over_recompute", rows["hybrid_mmtier"], rec, False),
        **ratio_figures("hybrid_vllm_prefix_over_recompute", rows["hybrid_vllm_prefix"], rec, False),
        **ratio_figures("hybrid_mmtier_over_vllm_prefix", rows["hybrid_mmtier"], rows["hybrid_vllm_prefix"], False),
        **{f"greedy_mismatches_{name.removeprefix('hybrid_')}": n for name, n in mismatches.items()},
        "greedy_tokens_checked": 1 + CHECK_TOKENS, "greedy_distinct_tokens_recompute": len(distinct),
        "greedy_differences": "; ".join(differ) or "none",
        "loadavg_before": load_before, "loadavg_after": loadavg(),
        "wall_s": time.perf_counter() - t_start,
    }


def image_rounds(work: Path, rounds: int) -> dict[str, list[float]]:
    """TTFT of a repeated image prompt (fresh image and text each round) on three engines."""
    from vllm import SamplingParams

    from tests.support.vllm_mm_models import build_llava, image, image_prompt, text
    from tests.support.vllm_mm_scenarios import mm_engine

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
    ap.add_argument("--dtype", default=None, help="bfloat16 (the hybrid part: float32)")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 512 tokens (a check that it runs)")
    ap.add_argument("--no-image", action="store_true", help="skip the image-prompt part")
    ap.add_argument("--hybrid", action="store_true",
                    help="the hybrid part alone (Gemma 3, sliding-window + full attention): vllm_engine_hybrid.json")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.prompt = 2, 512
    work = Path(tempfile.mkdtemp(prefix="mmtier-vllm-bench-"))
    if args.hybrid:
        figures = hybrid(work, args.rounds, args.prompt, args.dtype or "float32")
        show(figures)
        write_results("vllm_engine_hybrid", figures, args.out)
        return figures
    args.dtype = args.dtype or "bfloat16"
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
    show(figures)
    write_results("vllm_engine", figures, args.out)
    return figures


def show(figures: dict) -> None:
    for k, v in figures.items():
        print(f"{k:40s} {v:.4f}" if isinstance(v, float) else f"{k:40s} {v}")


if __name__ == "__main__":
    main()
