"""Hybrid models through mmtier's vLLM connector with vLLM's hybrid allocator on, one scenario
per process: ``python -m tests.support.vllm_hybrid_scenarios NAME ARGS_JSON`` prints ``RESULT {...}``.

``gemma3``: a tiny Gemma 3 (sliding-window layers of 64 tokens and full-attention layers: two
KV cache groups), vLLM's default multiprocessing executor, vLLM's own prefix cache on over a
56-block pool. One engine with mmtier runs a prompt, four fillers that push it out of vLLM's
own cache, the prompt again (a hit from mmtier: its sliding layers get the last window), then a
batch that makes vLLM preempt; a second engine over the same disk directory (a restart) runs the
prompt; a byte of one of its groups is flipped and a third engine runs it again (that request
is recomputed); a plain engine under the same pool gives the oracle tokens.

``qwen3_next``: a tiny Qwen3-Next (Gated DeltaNet + full attention): a hit restores the
attention KV and the recurrent state, through a restart and a corrupt state (see its doc)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.support.engine_runs import scenario_main
from tests.support.vllm_models import build_gemma3, build_qwen3_next, gemma3_fields
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

POOL = dict(num_gpu_blocks_override=56, max_model_len=640, enable_prefix_caching=True)


def _hybrid_on(llm) -> bool:
    return llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False


def gemma3(tmp: str) -> dict:
    model = str(build_gemma3(Path(tmp) / "gemma3"))
    disk = Path(tmp) / "disk"
    fields = gemma3_fields(disk)
    p = prompt(80, 301)
    fillers = [prompt(81 + i, 301) for i in range(4)]
    batch = [prompt(90 + i, 200) for i in range(5)]
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
    raw[len(raw) // 2] ^= 0xFF
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


SCENARIOS = {f.__name__: f for f in (gemma3, qwen3_next)}


if __name__ == "__main__":
    sys.exit(scenario_main(SCENARIOS, sys.argv[1:]))
