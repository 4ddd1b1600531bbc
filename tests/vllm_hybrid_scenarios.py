"""Hybrid models through mmtier's vLLM connector with vLLM's hybrid allocator on, one scenario
per process: ``python -m tests.vllm_hybrid_scenarios NAME ARGS_JSON`` prints ``RESULT {...}``.

``gemma3``: a tiny Gemma 3 (sliding-window layers of 64 tokens and full-attention layers: two
KV cache groups), vLLM's default multiprocessing executor, vLLM's own prefix cache on over a
56-block pool. One engine with mmtier runs a prompt, four fillers that push it out of vLLM's
own cache, the prompt again (a hit from mmtier: its sliding layers get the last window), then a
batch that makes vLLM preempt; a second engine over the same disk directory (a restart) runs the
prompt; a byte of one of its groups is flipped and a third engine runs it again (that request
is recomputed); a plain engine under the same pool gives the oracle tokens.

``qwen3_next``: a tiny Qwen3-Next (Gated DeltaNet + full attention) with mmtier's connector is
refused at start-up with the reason (recurrent state is not stored), not vLLM's error about
unifying KV cache specs."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.engine_runs import scenario_main
from tests.vllm_models import build_gemma3, build_qwen3_next, gemma3_fields
from tests.vllm_scenarios import (
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
    model = str(build_qwen3_next(Path(tmp) / "qwen3-next"))
    started = time.monotonic()
    try:
        llm = engine(model, mmtier={"mmtier_device_bytes": 32 << 20}, executor="uni", dtype="bfloat16",
                     enable_prefix_caching=True)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the reason
        return {"refused": True, "type": type(exc).__name__, "message": str(exc),
                "seconds": time.monotonic() - started}
    close(llm)
    return {"refused": False}


SCENARIOS = {f.__name__: f for f in (gemma3, qwen3_next)}


if __name__ == "__main__":
    sys.exit(scenario_main(SCENARIOS, sys.argv[1:]))
