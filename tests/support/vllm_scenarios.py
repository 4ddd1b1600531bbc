"""Real vLLM engines (vLLM's CPU build) with and without mmtier's connector, one scenario per
process: ``python -m tests.support.vllm_scenarios NAME ARGS_JSON`` prints one ``RESULT {...}`` line.

Each scenario starts real ``vllm.LLM`` engines (scheduler, model runner, KV connector loop; the
default multiprocessing executor unless it says otherwise) over a tiny model saved by
``tests/support/vllm_models.py``, with vLLM's own prefix caching off so that every cached token comes
from mmtier, and reports greedy tokens and vLLM's own count of cached tokens
(``RequestOutput.num_cached_tokens``) for the test to compare with a plain engine's. vLLM is
imported here only (the pytest process needs none), and the ``__main__`` guard is what vLLM's
spawned processes require."""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.support.vllm_models import BLOCK, VOCAB, cache_fields  # noqa: E402

CONNECTOR = "mmtier.engines.vllm.connector"
# vLLM's own prefix caching in every engine a scenario starts (with and without mmtier): the
# scenario's ``prefix_caching`` argument sets it (``main``), so each scenario runs both ways
PREFIX_CACHING = False


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def engine(model: str, *, mmtier: dict | None = None, executor: str = "mp", dtype: str = "float32",
           kv_role: str = "kv_both", **kw):
    """A real engine. ``executor``: ``"mp"`` (vLLM's default: engine core and worker in
    processes of their own) or ``"uni"`` (everything in this process)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if executor == "mp" else "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if mmtier is not None:
        kv = KVTransferConfig(kv_connector="MMTierConnector", kv_connector_module_path=CONNECTOR,
                              kv_role=kv_role, kv_connector_extra_config=mmtier)
    args = dict(skip_tokenizer_init=True, enforce_eager=True, block_size=BLOCK, max_model_len=2048,
                dtype=dtype, enable_prefix_caching=PREFIX_CACHING, seed=0, max_num_seqs=8, disable_log_stats=False,
                kv_transfer_config=kv, distributed_executor_backend=executor)
    args.update(kw)
    return LLM(model, **args)


def close(llm) -> None:
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()
    from mmtier.engines.connector_cache import close_shared

    close_shared()


def generate(llm, prompts: list[list[int]], max_tokens: int = 12, **kw) -> list[dict]:
    """Greedy tokens and vLLM's cached-token count of each prompt, submitted as one batch."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False, **kw)
    return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0} for o in outs]


def one_by_one(llm, prompts: list[list[int]], **kw) -> list[dict]:
    """Each prompt alone, after the previous one finished (so its saves are in the cache)."""
    out = []
    for p in prompts:
        out += generate(llm, [p], **kw)
        time.sleep(0.3)                 # the worker's writer thread stores off the step
    return out


def metric(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name)


def prompt_keys(fields: dict, tokens: list[int]) -> list:
    """The keys the connector gives a text prompt's groups (tenant "acme", block-sized chunks),
    made by a keys-only cache of the same config."""
    from mmtier.cache import TieredKVCache
    from mmtier.config import CacheConfig
    from mmtier.engines.connector_cache import lookup_only
    from mmtier.engines.vllm.plan import plan_request

    with TieredKVCache(lookup_only(CacheConfig(**fields))) as keys:
        plan = plan_request(keys, tokens, [], block_size=BLOCK, tenant="acme", chunk_blocks=1)
        return [seg.key for seg in plan.segments]


def mm(fields: dict, **extra) -> dict:
    return {"mmtier_cache": fields, "mmtier_tenant": "acme", "mmtier_chunk_blocks": 1, **extra}


# ---------------------------------------------------------------------------- scenarios
def hits(model: str, tmp: str, executor: str = "mp") -> dict:
    """A repeat, a shared prefix and a changed token, then the same prompts on a plain engine."""
    p = prompt(1, 301)
    shared = p[:230] + prompt(2, 71)
    changed = list(p)
    changed[100] = (changed[100] + 1) % VOCAB or 3
    prompts = [p, p, shared, changed]
    llm = engine(model, mmtier=mm(cache_fields(None)), executor=executor)
    got = one_by_one(llm, prompts)
    close(llm)
    plain = engine(model, executor=executor)
    want = one_by_one(plain, prompts)
    close(plain)
    return {"mmtier": got, "plain": want}


def preemption(model: str, tmp: str, executor: str = "mp") -> dict:
    """A KV cache too small for the batch: vLLM preempts and resumes while mmtier holds the
    prefixes. The same batch on a plain engine under the same pressure, and on a roomy one."""
    prompts = [prompt(10 + i, 301) for i in range(6)]
    out: dict = {}
    for name, kw in (("mmtier", {"mmtier": mm(cache_fields(None))}), ("plain", {})):
        llm = engine(model, num_gpu_blocks_override=32, max_model_len=768, executor=executor, **kw)
        warm = one_by_one(llm, prompts[:3], max_tokens=4) if name == "mmtier" else []
        out[name] = generate(llm, prompts, max_tokens=160)
        out[name + "_preemptions"] = metric(llm, "vllm:num_preemptions")
        if name == "mmtier" and executor == "uni":       # the scheduler's connector is here
            out["counts"] = dict(llm.llm_engine.engine_core.engine_core.scheduler.connector.counts)
        out[name + "_warm"] = warm
        close(llm)
    roomy = engine(model, executor=executor)
    out["roomy"] = generate(roomy, prompts, max_tokens=160)
    close(roomy)
    return out


def chunked(model: str, tmp: str) -> dict:
    """Prompts longer than ``max_num_batched_tokens``: prefilled in chunks, saved across steps."""
    p, q = prompt(20, 700), prompt(21, 520)
    prompts = [p, p, q, q]
    out = {}
    for name, kw in (("mmtier", {"mmtier": mm(cache_fields(None))}), ("plain", {})):
        llm = engine(model, max_num_batched_tokens=128, enable_chunked_prefill=True, **kw)
        out[name] = one_by_one(llm, prompts)
        close(llm)
    return out


def bf16(model: str, tmp: str) -> dict:
    """bf16 weights, activations and pages."""
    p = prompt(30, 400)
    out = {}
    for name, kw in (("mmtier", {"mmtier": mm(cache_fields(None, dtype="bfloat16"))}), ("plain", {})):
        llm = engine(model, dtype="bfloat16", **kw)
        out[name] = one_by_one(llm, [p, p])
        close(llm)
    return out


def corrupt(model: str, tmp: str) -> dict:
    """An engine saves to disk and stops; a stored group's file is flipped; a new engine over
    the same directory loads the rest, recomputes the corrupt group's blocks, tokens equal."""
    disk = Path(tmp) / "spill"
    p = prompt(40, 301)
    fields = cache_fields(disk, device_pages=4)           # the device holds 4 pages: the rest spill
    first = engine(model, mmtier=mm(fields))
    saved = one_by_one(first, [p, prompt(41, 301), prompt(42, 301)])
    close(first)
    files = sorted(disk.glob("*.arrow"))
    victim = next(disk.glob(f"text-{prompt_keys(fields, p)[4].hex}-*.arrow"))   # p's 5th block
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    again = engine(model, mmtier=mm(fields))
    got = one_by_one(again, [p])
    close(again)
    plain = engine(model)
    want = one_by_one(plain, [p])
    close(plain)
    quarantined = sorted(x.name for x in (disk / "quarantine").glob("*")) if (disk / "quarantine").exists() else []
    return {"saved": saved, "mmtier": got, "plain": want, "files": len(files),
            "victim": victim.name, "quarantined": quarantined}


def lora(model: str, tmp: str) -> dict:
    """Two LoRA adapters on one prompt: what one saved never hits for the other."""
    from vllm.lora.request import LoRARequest

    from tests.support.vllm_models import build_lora

    a = build_lora(model, Path(tmp) / "lora-a", seed=1)
    b = build_lora(model, Path(tmp) / "lora-b", seed=2)
    reqs = {"a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}
    p = prompt(50, 301)
    order = ["a", "a", "b", "b", None]
    out = {}
    for name, kw in (("mmtier", {"mmtier": mm(cache_fields(None))}), ("plain", {})):
        llm = engine(model, enable_lora=True, max_lora_rank=8, max_loras=2, **kw)
        rows = []
        for which in order:
            rows += generate(llm, [p], lora_request=reqs[which] if which else None)
            time.sleep(0.3)
        out[name] = rows
        close(llm)
    out["order"] = order
    return out


def shared_disk(model: str, tmp: str) -> dict:
    """Two engine processes over one node's disk directory: A spills what it saves there; B,
    started (and restarted) beside it, hits A's files; neither removes the other's."""
    disk = Path(tmp) / "node-disk"
    fields = cache_fields(disk, device_pages=4)
    ps = [prompt(60 + i, 301) for i in range(3)]
    a = engine(model, mmtier=mm(fields))
    a_first = one_by_one(a, ps)
    files = sorted(f.name for f in disk.glob("*.arrow"))
    b = engine(model, mmtier=mm(fields))
    b_first = one_by_one(b, ps[:2])
    close(b)
    b = engine(model, mmtier=mm(fields))                  # B restarted, A still running
    b_again = one_by_one(b, ps[:1])
    close(b)
    a_again = one_by_one(a, ps[2:])
    left = sorted(f.name for f in disk.glob("*.arrow"))
    close(a)
    plain = engine(model)
    want = one_by_one(plain, ps)
    close(plain)
    return {"a_first": a_first, "b_first": b_first, "b_again": b_again, "a_again": a_again,
            "plain": want, "files_after_a": files, "files_at_end": left,
            "quarantined": sorted(x.name for x in (disk / "quarantine").glob("*"))
            if (disk / "quarantine").exists() else []}


def cluster(model: str, tmp: str) -> dict:
    """Two engine processes with ``mmtier_cluster`` on a fresh local Ray: B hits what A saved
    (through the node store and the registry; no shared directory), tokens equal."""
    import ray

    from mmtier import cluster as mma
    from mmtier.cluster.settings import ClusterSettings
    from mmtier.config import CacheConfig

    settings = ClusterSettings(namespace="mmtier-vllm-engines", device_resource="no_such_device",
                               call_timeout_s=30.0)
    secret = os.urandom(32).hex()
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace=settings.namespace)
    mma.start(CacheConfig(**cache_fields(Path(tmp) / "store"), key_secret=secret), settings)
    link = {"namespace": settings.namespace, "call_timeout_s": 30.0,
            "address": ray.get_runtime_context().gcs_address}
    ps = [prompt(70, 301), prompt(71, 301)]
    try:
        a = engine(model, mmtier=mm(cache_fields(None), mmtier_cluster=link))
        a_out = one_by_one(a, ps)
        time.sleep(2.0)                                   # A's write-through and publish
        b = engine(model, mmtier=mm(cache_fields(None), mmtier_cluster=link))
        b_out = one_by_one(b, ps)
        close(b)
        close(a)
    finally:
        mma.shutdown(settings)
        ray.shutdown()
    plain = engine(model)
    want = one_by_one(plain, ps)
    close(plain)
    return {"a": a_out, "b": b_out, "plain": want}


SCENARIOS = {f.__name__: f for f in (hits, preemption, chunked, bf16, corrupt, lora, shared_disk, cluster)}


def main(argv: list[str]) -> int:
    global PREFIX_CACHING
    name, args = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    PREFIX_CACHING = bool(args.pop("prefix_caching", False))
    result = SCENARIOS[name](**args)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
