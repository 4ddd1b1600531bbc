"""Real transformers model code through the cache: TTFT and time per output token, and one
batched attention call against one call per sequence.

``python -m benchmarks.engines.hf_generate [--quick] [--runs N] [--out DIR]``

Models (random weights, built from configs, float32, on the CPU):

- ``tiny``: the tests' tiny LLaVA (2 decoder layers, hidden 96, 6 query / 2 KV heads, 16-token
  image);
- ``7b``: a LLaVA whose two decoder layers have Qwen2.5-VL-7B's attention shapes (hidden 3584,
  28 query heads, 4 KV heads, head dim 128); its MLP width (3584), vocabulary (1024) and vision
  tower (tiny CLIP, 64 image tokens) are cut so a CPU run takes seconds: the KV per token is the
  real model's, the FLOPs per token are not.

Arms, side by side in one run and interleaved run by run, greedy, one request:

- ``dynamic``: ``generate`` with transformers' ``DynamicCache`` and sdpa (recomputes all);
- ``cold``: ``Session.generate`` on an empty mmtier cache (the vision tower runs, every prompt
  span is prefilled and sealed);
- ``warm``: the same request again on a cache that holds its prefix and image (no vision tower,
  only the last text span is prefilled).

TTFT: from the call until the first generated token exists (a streamer stamps it); TPOT: the
time per later token. Medians of ``--runs`` runs (best and worst beside). ``batch_over_single``:
decode attention of 32 sequences of one 7b layer (``--context`` tokens each) as 32
``attention`` calls over one ``attention_batch`` call (best of 5 rounds, median beside).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks import _common
from benchmarks._common import print_table


class Stamps:
    """A ``generate`` streamer that records when each token arrives (the first ``put`` is the
    prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return None


def llava_7b_shapes():
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, image_size=32, patch_size=4, projection_dim=64)
    text = LlamaConfig(vocab_size=1024, hidden_size=3584, intermediate_size=3584, num_hidden_layers=2,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                       max_position_embeddings=4096)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=1023,
                      vision_feature_layer=-1, pad_token_id=0)
    return LlavaForConditionalGeneration(cfg).eval()


def request(model, prompt: int, seed: int):
    """``prompt`` text tokens before the image, 8 after it; the image's bytes and pixels."""
    cfg = model.config
    vision = cfg.vision_config
    n_img = (vision.image_size // vision.patch_size) ** 2
    g = torch.Generator().manual_seed(seed)
    vocab = cfg.text_config.vocab_size
    ids = torch.cat([torch.randint(1, vocab - 8, (1, prompt), generator=g),
                     torch.full((1, n_img), cfg.image_token_id),
                     torch.randint(1, vocab - 8, (1, 8), generator=g)], 1)
    pixels = torch.randn(1, 3, vision.image_size, vision.image_size, generator=g)
    return ids, pixels, b"image-%d" % seed


def timed(fn, new_tokens: int) -> tuple[float, float, torch.Tensor]:
    stamps = Stamps()
    t0 = time.perf_counter()
    seqs = fn(stamps)
    ttft = stamps.times[1] - t0
    tpot = (stamps.times[-1] - stamps.times[1]) / max(1, len(stamps.times) - 2)
    return ttft, tpot, seqs


def bench_model(label: str, build, prompt: int, new_tokens: int, runs: int) -> dict:
    from mmtier import TieredKVCache
    from mmtier.engines import transformers as mt
    from mmtier.engines.transformers.session import Media, Session

    torch.manual_seed(0)
    ref = build()
    model = mt.enable(build())
    model.load_state_dict(ref.state_dict())
    ids, pixels, data = request(ref, prompt, 1)
    image = Media(data, {"pixel_values": pixels})
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens)      # greedy in every arm
    arms = {"dynamic": [], "cold": [], "warm": []}
    answers = {}

    def dynamic(stamps):
        return ref.generate(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                            streamer=stamps, do_sample=False, **gen)

    def session_arm(warm: bool):
        cache = TieredKVCache(mt.config_for(model, device_bytes=256 << 20))
        session = Session(model, cache, tenant="bench")
        if warm:
            session.generate(ids, [image], **gen)                 # fills the cache, untimed
        return cache, lambda stamps: session.generate(ids, [image], streamer=stamps, **gen).sequences

    for r in range(runs + 1):                     # run 0 warms code paths up, untimed
        order = ["dynamic", "cold", "warm"]
        for arm in order[r % 3:] + order[:r % 3]:
            cache = None
            if arm == "dynamic":
                fn = dynamic
            else:
                cache, fn = session_arm(arm == "warm")
            try:
                ttft, tpot, seqs = timed(fn, new_tokens)
            finally:
                if cache is not None:
                    cache.close()
            answers.setdefault(arm, seqs)
            if r:
                arms[arm].append((ttft, tpot))
    same = all(torch.equal(answers["dynamic"], a) for a in answers.values())
    out = {f"{label}_tokens_match": same, f"{label}_prompt_tokens": ids.shape[1]}
    for arm, vals in arms.items():
        for i, what in enumerate(("ttft", "tpot")):
            xs = [v[i] for v in vals]
            out[f"{label}_{arm}_{what}_s"] = statistics.median(xs)
            out[f"{label}_{arm}_{what}_best_s"] = min(xs)
            out[f"{label}_{arm}_{what}_worst_s"] = max(xs)
    for what in ("ttft", "tpot"):
        dyn = out[f"{label}_dynamic_{what}_s"]
        out[f"{label}_cold_over_dynamic_{what}"] = out[f"{label}_cold_{what}_s"] / dyn
        out[f"{label}_warm_over_dynamic_{what}"] = out[f"{label}_warm_{what}_s"] / dyn
    return out


def batch_over_single(context: int, rounds: int = 5, device: str = "cpu") -> dict:
    """32 decode queries of one layer with Qwen2.5-VL-7B's attention shapes."""
    from mmtier import CacheConfig, ModalitySpec, TieredKVCache

    batch, hq, hkv, dim = 32, 28, 4, 128
    cfg = CacheConfig(model="bench-7b-layer", num_layers=1, num_kv_heads=hkv, head_dim=dim, dtype="float32",
                      modalities={"text": ModalitySpec(page_size=16)}, device=device,
                      device_bytes=batch * (context + 16) * hkv * dim * 2 * 4 + (8 << 20))
    with TieredKVCache(cfg) as cache:
        seqs = []
        for _ in range(batch):
            seq = cache.create_sequence()
            k = torch.randn(1, context, hkv, dim, device=device)
            cache.append(seq, "text", k, torch.randn_like(k))
            seqs.append(seq)
        q = torch.randn(batch, hq, dim, device=device)
        indptr = torch.arange(batch + 1, dtype=torch.int32)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        batched = cache.attention_batch(seqs, 0, q, indptr)
        single = torch.cat([cache.attention(s, 0, q[i:i + 1]) for i, s in enumerate(seqs)])
        err = float((batched - single).abs().max())
        t_batch, t_single = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            cache.attention_batch(seqs, 0, q, indptr)
            sync()
            t_batch.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i, s in enumerate(seqs):
                cache.attention(s, 0, q[i:i + 1])
            sync()
            t_single.append(time.perf_counter() - t0)
    return {"batch_device": device, "batch_sequences": batch, "batch_context_tokens": context,
            "batch_call_s": min(t_batch), "single_calls_s": min(t_single),
            "batch_over_single": min(t_single) / min(t_batch),
            "batch_over_single_median": statistics.median(t_single) / statistics.median(t_batch),
            "batch_max_abs_diff": err}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens, shorter contexts")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per arm (>= 5)")
    ap.add_argument("--context", type=int, default=None, help="tokens per sequence in batch_over_single")
    ap.add_argument("--models", default=None, help="comma-separated: tiny, 7b (default both; quick: tiny)")
    ap.add_argument("--device", default="cpu", help="device of batch_over_single's cache (cuda:N: Triton)")
    _common.add_out_arg(ap)
    args = ap.parse_args(argv)
    runs = max(5, args.runs or 5)
    new_tokens = 6 if args.quick else 16
    figures: dict = {"quick": args.quick, "runs": runs, "new_tokens": new_tokens,
                     "threads": torch.get_num_threads()}
    from tests.support.hf_models import tiny_llava

    models = {"tiny": (tiny_llava, 32 if args.quick else 128), "7b": (llava_7b_shapes, 64 if args.quick else 256)}
    for label in (args.models or ("tiny" if args.quick else "tiny,7b")).split(","):
        if label not in models:
            raise SystemExit(f"--models: unknown {label!r}; choose from {sorted(models)}")
        build, prompt = models[label]
        figures.update(bench_model(label, build, prompt, new_tokens, runs))
    figures.update(batch_over_single(args.context or (256 if args.quick else 1024), device=args.device))
    path = _common.write_results("hf_generate", figures, args.out)
    print_table("transformers through mmtier: TTFT / TPOT (median s) and batched attention",
                [(k, v) for k, v in figures.items()])
    print(f"\nwrote {path}")
    return figures


if __name__ == "__main__":
    main()
