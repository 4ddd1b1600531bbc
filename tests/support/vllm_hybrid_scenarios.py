"""Hybrid models through mmtier's vLLM connector with vLLM's hybrid allocator on, one scenario
per process: ``python -m tests.support.vllm_hybrid_scenarios NAME ARGS_JSON`` prints ``RESULT {...}``.

``gemma3``: a tiny Gemma 3 at the family's pattern (5 sliding-window layers of 64 tokens : 1
full-attention layer: six KV cache groups), vLLM's default multiprocessing executor, vLLM's own
prefix cache on over an 84-block pool (vLLM sizes every group for the longest request). One
engine with mmtier runs a prompt, four fillers that push it out of vLLM's own cache, the prompt
again (a hit from mmtier: its sliding layers get the last window), then a batch that makes vLLM
preempt; a second engine over the same disk directory (a restart) runs the prompt; a byte of one
of its groups is flipped and a third engine runs it again (that request is recomputed); a plain
engine under the same pool gives the oracle tokens.

``qwen3_next``: a tiny Qwen3-Next at the family's 3 Gated DeltaNet : 1 full attention pattern
(three recurrent KV cache groups, one attention group): a hit restores the attention KV and the
recurrent state, through a restart and a corrupt state (see its doc).

``pattern``: one family's real layer pattern (``PATTERNS``), vLLM in this process (its KV cache
groups read off its scheduler): a prompt, vLLM's own prefix-cache hit, vLLM's cache reset and
the prompt from mmtier, then a restarted engine over the same disk directory."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.support.engine_runs import scenario_main
from tests.support.vllm_models import (
    build_gemma3_family,
    build_gpt_oss,
    build_granite_h,
    build_qwen3_next,
    gemma3_fields,
)
from tests.support.vllm_scenarios import (
    close,
    engine,
    generate,
    metric,
    mm,
    one_by_one,
    prompt,
    prompt_keys,
)

POOL = dict(num_gpu_blocks_override=84, max_model_len=416, enable_prefix_caching=True)


def _hybrid_on(llm) -> bool:
    return llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False


def gemma3(tmp: str) -> dict:
    model = str(build_gemma3_family(Path(tmp) / "gemma3"))
    disk = Path(tmp) / "disk"
    fields = gemma3_fields(disk, layers=6)
    p = prompt(80, 301)
    fillers = [prompt(81 + i, 301) for i in range(4)]
    batch = [prompt(90 + i, 200) for i in range(8)]
    out: dict = {}

    llm = engine(model, mmtier=mm(fields), **POOL)
    out["hybrid_on"] = _hybrid_on(llm)
    out["first"] = one_by_one(llm, [p, *fillers, p])
    out["batch"] = generate(llm, batch, max_tokens=200)
    out["preemptions"] = metric(llm, "vllm:num_preemptions")
    close(llm)

    again = engine(model, mmtier=mm(fields), **POOL)           # restarted over the same disk
    out["restart"] = one_by_one(again, [p])
    close(again)

    victim = next(disk.glob(f"text-{prompt_keys(fields, p)[4].hex}-*.arrow"))   # p's 5th block
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 3] ^= 0xFF                  # within K's bytes (the middle may be padding)
    victim.write_bytes(bytes(raw))
    third = engine(model, mmtier=mm(fields), **POOL)
    out["corrupt"] = one_by_one(third, [p])
    close(third)
    quarantine = disk / "quarantine"
    out["quarantined"] = sorted(x.name for x in quarantine.glob("*")) if quarantine.exists() else []
    out["victim"] = victim.name

    plain = engine(model, **POOL)
    out["plain_hybrid_on"] = _hybrid_on(plain)
    out["plain"] = one_by_one(plain, [p, *fillers, p])
    out["plain_batch"] = generate(plain, batch, max_tokens=200)
    out["plain_preemptions"] = metric(plain, "vllm:num_preemptions")
    close(plain)
    return out


def qwen3_next(tmp: str) -> dict:
    """A tiny Qwen3-Next in bf16, vLLM's prefix cache on (its ``align`` mode for the recurrent
    layers), the connector given only sizes: a prompt, vLLM's own cache reset, the prompt again
    (KV and the Gated DeltaNet layers' state from mmtier); a restart over the disk directory;
    the stored states flipped on disk (the load fails, vLLM recomputes); a plain engine; and
    the connector with vLLM's prefix caching off (refused with the reason)."""
    model = str(build_qwen3_next(Path(tmp) / "qwen3-next"))
    disk = Path(tmp) / "disk"
    extra = {"mmtier_device_bytes": 32 << 20, "mmtier_disk_dir": str(disk), "mmtier_disk_bytes": 256 << 20,
             "mmtier_tenant": "acme"}
    kw = dict(dtype="bfloat16", enable_prefix_caching=True, num_gpu_blocks_override=24, max_model_len=512)
    p = prompt(100, 300)
    batch = [prompt(110 + i, 200) for i in range(5)]
    out: dict = {}

    def run(llm) -> dict:
        """Greedy tokens with their logprobs: a state restored wrong moves the logprobs of this
        tiny model before its tokens (its Gated DeltaNet gates forget fast)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=1)
        r = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        time.sleep(0.3)                        # the worker's writer thread stores off the step
        o = r.outputs[0]
        return {"tokens": list(o.token_ids), "cached": r.num_cached_tokens or 0,
                "logprobs": [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)]}

    def batch_run(llm) -> list[dict]:
        """The batch at once (more than the pool holds: vLLM preempts): tokens and, per
        position, the two best logprobs (where they nearly tie, bf16 recomputes that split
        otherwise may choose the other)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=150, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=2)
        rows = []
        for r in llm.generate([TokensPrompt(prompt_token_ids=b) for b in batch], sp, use_tqdm=False):
            o = r.outputs[0]
            rows.append({"tokens": list(o.token_ids),
                         "top2": [sorted((v.logprob for v in d.values()), reverse=True)[:2] for d in o.logprobs]})
        return rows

    def twice(llm, reset: bool) -> list[dict]:
        first = run(llm)
        if reset:
            llm.reset_prefix_cache()           # vLLM's own cache lets go of the prompt
        return [first, run(llm)]

    llm = engine(model, mmtier=extra, **kw)
    out["hybrid_on"] = _hybrid_on(llm)
    out["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
    out["mmtier"] = twice(llm, reset=True)
    out["batch"] = batch_run(llm)                              # more than 24 blocks: vLLM preempts
    out["preemptions"] = metric(llm, "vllm:num_preemptions")
    close(llm)
    out["state_files"] = sorted(f.name.split("-")[0] for f in disk.glob("state*.arrow"))

    again = engine(model, mmtier=extra, **kw)                   # restarted over the same disk
    out["restart"] = [run(again)]
    close(again)

    for f in disk.glob("state1-*.arrow"):                       # every stored state, flipped
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
    third = engine(model, mmtier=extra, **kw)
    out["corrupt"] = [run(third)]
    close(third)
    quarantine = disk / "quarantine"
    out["quarantined"] = sorted(x.name.split("-")[0] for x in quarantine.glob("*")) if quarantine.exists() else []

    plain = engine(model, **kw)
    out["plain"] = twice(plain, reset=False)       # a miss, then vLLM's own prefix-cache hit
    out["plain_batch"] = batch_run(plain)
    out["plain_preemptions"] = metric(plain, "vllm:num_preemptions")
    close(plain)

    try:
        off = engine(model, mmtier={"mmtier_device_bytes": 32 << 20}, executor="uni", dtype="bfloat16",
                     enable_prefix_caching=False)
        close(off)
        out["off"] = {"refused": False}
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the reason
        out["off"] = {"refused": True, "type": type(exc).__name__, "message": str(exc)}
    return out


# family -> (builder, engine arguments): each at its released models' layer pattern
PATTERNS = {
    "qwen3_next": (build_qwen3_next, dict(dtype="bfloat16")),
    "gemma3": (build_gemma3_family, dict(dtype="float32")),
    "gpt_oss": (build_gpt_oss, dict(dtype="bfloat16")),
    "granite_h": (build_granite_h, dict(dtype="bfloat16")),
}


def _groups(llm) -> list[dict]:
    """vLLM's KV cache groups (the engine in this process): each one's spec class, layer count
    and sliding window."""
    cfg = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return [{"kind": type(g.kv_cache_spec).__name__, "layers": len(g.layer_names),
             "window": getattr(g.kv_cache_spec, "sliding_window", None)} for g in cfg.kv_cache_groups]


def pattern(tmp: str, family: str) -> dict:
    """``family``'s tiny model, vLLM's prefix cache on, the connector given only sizes, one
    engine in this process: a prompt (a miss, saved), the prompt again (vLLM's own prefix-cache
    hit: the oracle), vLLM's cache reset and the prompt again (mmtier's hit), then a second
    engine over the same disk directory (mmtier's hit from disk)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    build, kw = PATTERNS[family]
    model = str(build(Path(tmp) / family))
    disk = Path(tmp) / "disk"
    extra = {"mmtier_device_bytes": 32 << 20, "mmtier_disk_dir": str(disk), "mmtier_disk_bytes": 256 << 20,
             "mmtier_tenant": "acme"}
    kw = dict(kw, enable_prefix_caching=True, num_gpu_blocks_override=256, max_model_len=1024)
    p = prompt(120, 300)
    sp = SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=1)

    def run(llm) -> dict:
        r = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        time.sleep(0.3)                        # the worker's writer thread stores off the step
        o = r.outputs[0]
        return {"tokens": list(o.token_ids), "cached": r.num_cached_tokens or 0,
                "logprobs": [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)]}

    def hits(llm) -> int:
        return llm.llm_engine.engine_core.engine_core.scheduler.connector.counts["hit_tokens"]

    out: dict = {}
    llm = engine(model, mmtier=extra, executor="uni", **kw)
    out["hybrid_on"] = _hybrid_on(llm)
    out["groups"] = _groups(llm)
    out["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
    out["miss"], out["vllm_hit"] = run(llm), run(llm)
    out["hits_before_reset"] = hits(llm)
    llm.reset_prefix_cache()                   # vLLM's own cache lets go of the prompt
    out["mmtier_hit"] = run(llm)
    out["hits"] = hits(llm)
    close(llm)
    again = engine(model, mmtier=extra, executor="uni", **kw)    # restarted over the same disk
    out["restart"] = run(again)
    out["restart_hits"] = hits(again)
    close(again)
    return out


SCENARIOS = {f.__name__: f for f in (gemma3, qwen3_next, pattern)}


if __name__ == "__main__":
    sys.exit(scenario_main(SCENARIOS, sys.argv[1:]))
