"""Real vLLM engines (vLLM's CPU build) set up the way a vLLM user turns mmtier on, with vLLM
itself as the oracle: ``python -m tests.support.vllm_dropin_scenarios NAME ARGS_JSON`` prints one
``RESULT {...}`` line.

- ``oracle``: in one process (vLLM's in-process executor), a plain engine, a plain engine with
  its own prefix cache, and an engine with mmtier, each over one prompt twice. It returns the
  greedy tokens and top logprobs of each, whether the KV mmtier stored and the KV mmtier loaded
  into vLLM's blocks are bit-equal to the KV the plain engine computed for those blocks (read
  from vLLM's own KV tensors, at the block ids vLLM's scheduler gave the request), and the
  attention ISA vLLM's CPU backend chose in each engine.
- ``sizes_only``: the connector given only sizes (flat keys, or nothing at all) starts, hits
  and answers as plain vLLM; a preset whose shape is not the engine's is refused at startup.
- ``evicted``: vLLM's prefix cache on and a block pool smaller than the working set: a prompt
  pushed out of vLLM's cache by fillers comes back from mmtier (vLLM's own counters: local and
  external prefix-cache hits per request), tokens equal plain vLLM with its prefix cache.
- ``threads``: vLLM's multiprocessing executor in bfloat16: the OpenMP threads vLLM's CPU build
  binds with mmtier's connector, without a connector and with one that does nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.support.vllm_models import BLOCK, cache_fields  # noqa: E402
from tests.support.vllm_scenarios import close, engine, metric, mm, prompt, prompt_keys  # noqa: E402

LOGPROBS = 4


class Spy:
    """What vLLM decided, read from its own objects in this process (in-process executor): the
    block ids its scheduler gave each new request, and the attention ISA its CPU backend chose."""

    def __init__(self):
        self.blocks: dict[str, list[int]] = {}
        self.isa: list[str] = []
        import vllm.v1.attention.backends.cpu_attn as cpu_attn

        self._cpu_attn, self._isa = cpu_attn, cpu_attn._get_attn_isa

        def isa(*args, **kw):
            out = self._isa(*args, **kw)
            self.isa.append(out)
            return out

        cpu_attn._get_attn_isa = isa

    def watch(self, llm) -> None:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        schedule = sched.schedule

        def spy(*args, **kw):
            out = schedule(*args, **kw)
            for new in out.scheduled_new_reqs:
                self.blocks[new.req_id] = list(new.block_ids[0])
            return out

        sched.schedule = spy

    def close(self) -> None:
        self._cpu_attn._get_attn_isa = self._isa


def kv_caches(llm):
    """vLLM's own KV tensors, one per attention layer (in-process executor)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.kv_caches


def blocks_kv(llm, blocks: list[int], head_dim: int):
    """K and V ``[layers, len(blocks) * block, heads, head_dim]`` of vLLM's blocks, copied."""
    import torch

    from mmtier.engines.vllm.copy import kv_views

    ks, vs = [], []
    for layer in kv_caches(llm):
        k, v = kv_views(layer, head_dim)
        idx = torch.tensor(blocks)
        ks.append(k.index_select(0, idx).flatten(0, 1).clone())
        vs.append(v.index_select(0, idx).flatten(0, 1).clone())
    return torch.stack(ks), torch.stack(vs)


def run(llm, spy: Spy, prompts: list[list[int]]) -> list[dict]:
    """Each prompt alone, greedy, with its top logprobs and the block ids vLLM gave it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=LOGPROBS)
    rows = []
    for p in prompts:
        before = set(spy.blocks)
        o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        new = [r for r in spy.blocks if r not in before]
        rows.append({"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
                     "logprobs": [sorted((int(t), float(lp.logprob)) for t, lp in d.items())
                                  for d in o.outputs[0].logprobs],
                     "blocks": spy.blocks[new[-1]] if new else []})
        time.sleep(0.3)                 # the worker's writer thread stores off the step
    return rows


def oracle(model: str, tmp: str, dtype: str = "float32") -> dict:
    import torch

    from mmtier.engines import connector_cache

    p = prompt(30, 400)
    full = (len(p) - 1) // BLOCK                     # 12 blocks: what a hit covers
    spy = Spy()
    out: dict = {"full_blocks": full}
    try:
        plain = engine(model, executor="uni", dtype=dtype)
        spy.watch(plain)
        out["plain"] = run(plain, spy, [p])
        want_k, want_v = blocks_kv(plain, out["plain"][0]["blocks"][:full], cache_fields(None)["head_dim"])
        out["plain_isa"] = sorted(set(spy.isa))
        close(plain)
        spy.isa.clear()

        own = engine(model, executor="uni", dtype=dtype, enable_prefix_caching=True)
        spy.watch(own)
        out["prefix_cache"] = run(own, spy, [p, p])
        out["prefix_cache_isa"] = sorted(set(spy.isa))
        close(own)
        spy.isa.clear()

        from tests.support.noop_connector import transfer_config

        noop = engine(model, executor="uni", dtype=dtype, kv_transfer_config=transfer_config())
        spy.watch(noop)
        out["noop"] = run(noop, spy, [p])
        close(noop)
        spy.isa.clear()

        fields = cache_fields(None, dtype=dtype)
        llm = engine(model, executor="uni", dtype=dtype, mmtier=mm(fields))
        spy.watch(llm)
        out["mmtier"] = run(llm, spy, [p, p])
        out["mmtier_isa"] = sorted(set(spy.isa))
        (cache,) = connector_cache._CACHES.values()
        keys = prompt_keys(fields, p)[:full]
        got = [cache.read_group(key) for key in keys]
        stored_k = torch.cat([k for k, _ in got], dim=1)
        stored_v = torch.cat([v for _, v in got], dim=1)
        out["stored_bit_equal"] = bool(torch.equal(stored_k, want_k) and torch.equal(stored_v, want_v))
        load_k, load_v = blocks_kv(llm, out["mmtier"][1]["blocks"][:full], fields["head_dim"])
        out["loaded_bit_equal"] = bool(torch.equal(load_k, want_k) and torch.equal(load_v, want_v))
        out["loaded_blocks_differ_from_first"] = out["mmtier"][1]["blocks"][:full] != out["mmtier"][0]["blocks"][:full]
        out["kv_nonzero"] = bool(want_k.abs().sum() > 0 and want_v.abs().sum() > 0)
        close(llm)
    finally:
        spy.close()
    return out


def sizes_only(model: str, tmp: str) -> dict:
    """The connector given only sizes: flat keys (4 pages on the device, no host tier, the rest
    spilled to a disk tier), then no extra config
    at all; a preset of another model's shape refused at startup."""
    ps = [prompt(80, 301), prompt(81, 301), prompt(82, 301)]
    disk = Path(tmp) / "disk"
    out: dict = {}
    flat = {"mmtier_device_bytes": "160KiB", "mmtier_host_bytes": 0, "mmtier_disk_dir": str(disk),
            "mmtier_disk_bytes": "256MiB", "mmtier_disk_free_floor_bytes": 0, "mmtier_chunk_blocks": 1}
    llm = engine(model, mmtier=flat)
    out["flat"] = one_by_one_rows(llm, [ps[0], ps[1], ps[2], ps[0]])    # ps[1] ends on disk whole
    close(llm)
    out["files"] = len(list(disk.glob("*.arrow")))
    again = engine(model, mmtier={**flat})                  # restarted: hits from the disk tier
    out["flat_restart"] = one_by_one_rows(again, [ps[1]])
    close(again)
    bare = engine(model, mmtier={})
    out["bare"] = one_by_one_rows(bare, [ps[0], ps[0]])
    close(bare)
    plain = engine(model)
    out["plain"] = one_by_one_rows(plain, ps)
    close(plain)
    wrong = dict(cache_fields(None), num_kv_heads=4)
    try:
        engine(model, executor="uni", mmtier=mm(wrong))
        out["wrong_shape"] = None
    except Exception as exc:  # noqa: BLE001 - the startup failure vLLM surfaces, whatever wraps it
        out["wrong_shape"] = f"{type(exc).__name__}: {exc}"
    return out


def one_by_one_rows(llm, prompts):
    from tests.support.vllm_scenarios import one_by_one

    return one_by_one(llm, prompts)


def evicted(model: str, tmp: str, dtype: str = "float32") -> dict:
    """vLLM's prefix cache on, 24 blocks of 32 tokens (a 301-token prompt takes 10): A, four
    fillers that push A out of vLLM's cache, A again, a prompt sharing A's first 230 tokens.
    Per request: tokens, vLLM's cached tokens, and its own counters' local and external hits."""
    a = prompt(90, 301)
    fillers = [prompt(91 + i, 301) for i in range(4)]
    shared = a[:230] + prompt(99, 71)
    prompts = [a, *fillers, a, shared]
    out: dict = {}
    for name, kw in (("mmtier", {"mmtier": mm(cache_fields(None, dtype=dtype))}), ("plain", {})):
        llm = engine(model, dtype=dtype, enable_prefix_caching=True, num_gpu_blocks_override=24,
                     max_model_len=640, **kw)
        rows = []
        for p in prompts:
            local0 = metric(llm, "vllm:prefix_cache_hits")
            ext0 = metric(llm, "vllm:external_prefix_cache_hits")
            row = one_by_one_rows(llm, [p])[0]
            row["local"] = metric(llm, "vllm:prefix_cache_hits") - local0
            row["external"] = metric(llm, "vllm:external_prefix_cache_hits") - ext0
            rows.append(row)
        out[name] = rows
        close(llm)
    return out


def threads(tmp: str) -> dict:
    """vLLM's multiprocessing executor (its default) and bfloat16, where the number of OpenMP
    threads moves the numerics: a tiny Gemma 3 (sliding-window and full-attention layers,
    vLLM's hybrid allocator and prefix cache on), one 301-token prompt, greedy with the top
    logprobs, in a plain engine, an engine whose KV connector does nothing (vLLM binds it one
    core fewer where it can, ``mmtier.engines.vllm.threads``) and an engine with mmtier's
    connector given only sizes; the prompt twice in the plain engine (the second from vLLM's own
    prefix cache) and in mmtier's, vLLM's own cache reset between (the second from mmtier); the
    threads and CPUs of each engine's worker (``DemoWorker.mmtier_threads``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.support.noop_connector import transfer_config
    from tests.support.vllm_models import build_gemma3

    def rows_of(llm, prompts):
        sp = SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=LOGPROBS)
        rows = []
        for q in prompts:
            o = llm.generate([TokensPrompt(prompt_token_ids=q)], sp, use_tqdm=False)[0]
            rows.append({"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
                         "logprobs": [sorted((int(t), float(lp.logprob)) for t, lp in d.items())
                                      for d in o.outputs[0].logprobs]})
            time.sleep(0.3)             # the worker's writer thread stores off the step
        return rows

    model = str(build_gemma3(Path(tmp) / "gemma3"))
    p = prompt(80, 301)
    kw = dict(dtype="bfloat16", enable_prefix_caching=True, num_gpu_blocks_override=56, max_model_len=640,
              worker_extension_cls="mmtier.demo.worker_ext.DemoWorker")
    out: dict = {}
    plain = engine(model, **kw)
    out["plain"], out["plain_hit"] = rows_of(plain, [p, p])       # a miss, then vLLM's own hit
    out["plain_threads"] = plain.collective_rpc("mmtier_threads")[0]
    close(plain)
    noop = engine(model, kv_transfer_config=transfer_config(), **kw)
    out["noop"] = rows_of(noop, [p])[0]
    out["noop_threads"] = noop.collective_rpc("mmtier_threads")[0]
    close(noop)
    llm = engine(model, mmtier={"mmtier_device_bytes": 64 << 20}, **kw)
    out["mmtier"] = rows_of(llm, [p])[0]
    out["mmtier_threads"] = llm.collective_rpc("mmtier_threads")[0]
    llm.reset_prefix_cache()
    out["mmtier_hit"] = rows_of(llm, [p])[0]
    close(llm)
    return out


SCENARIOS = {f.__name__: f for f in (oracle, sizes_only, evicted, threads)}


def main(argv: list[str]) -> int:
    name, args = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    result = SCENARIOS[name](**args)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
