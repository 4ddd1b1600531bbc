"""Real-engine scenarios of mmtier's vLLM connector in engines of several workers (tensor
parallel) and on hybrid models; each runs in a process of its own
(``python -m tests.support.vllm_parallel_scenarios NAME ARGS_JSON``, as ``tests/support/vllm_scenarios.py``)
and prints one ``RESULT {...}`` line. The plain engine of the same settings is the oracle."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # a rank per core, not pinned

# the LLaVA's shim and registration, in this process and every one vLLM spawns (they import it)
import tests.support.vllm_mm_scenarios as vms  # noqa: E402
from tests.support import vllm_scenarios as vs  # noqa: E402
from tests.support.vllm_models import KV_HEADS, VOCAB, cache_fields  # noqa: E402

TP = 2


def shard_keys(fields: dict, keys: list, tag: str) -> list:
    """The keys a worker of shard ``tag`` stores ``keys``' groups under (``KeyMaker.shard``)."""
    from mmtier.cache import TieredKVCache
    from mmtier.config import CacheConfig
    from mmtier.engines.connector_cache import lookup_only

    with TieredKVCache(lookup_only(CacheConfig(**fields))) as cache:
        return [cache.shard_key(k, tag) for k in keys]


def tp2(model: str, tmp: str) -> dict:
    """A tensor-parallel engine (2 workers, one KV head each), 32 blocks of vLLM's, a device
    pool of 4 pages per worker over a disk directory:

    - a repeat, a shared prefix, a changed token (one by one);
    - a batch too big for the 32 blocks: vLLM preempts and resumes;
    - closed; one of worker 1's files of the prompt's 5th block flipped; a new engine over the
      directory: the prompt again (worker 1 fails that group: vLLM recomputes its blocks on
      both), then the shared prefix, whose leading run is now 4 groups on worker 1 and 7 on
      worker 0: the scheduler says 4;
    - the same on a plain engine of the same settings."""
    disk = Path(tmp) / "spill"
    fields = dict(cache_fields(disk, device_pages=4), num_kv_heads=KV_HEADS // TP)   # a worker's heads
    p = vs.prompt(1, 301)
    shared = p[:230] + vs.prompt(2, 71)
    changed = list(p)
    changed[100] = (changed[100] + 1) % VOCAB or 3
    batch = [vs.prompt(10 + i, 301) for i in range(6)]
    kw = dict(tensor_parallel_size=TP, num_gpu_blocks_override=32, max_model_len=768)
    out: dict = {}
    llm = vs.engine(model, mmtier=vs.mm(fields), **kw)
    out["mmtier"] = vs.one_by_one(llm, [p, p, shared, changed])
    out["mmtier_batch"] = vs.generate(llm, batch, max_tokens=160)
    out["mmtier_preemptions"] = vs.metric(llm, "vllm:num_preemptions")
    vs.close(llm)
    keys = vs.prompt_keys(fields, p)
    files = {f.name for f in disk.glob("*.arrow")}
    out["unsharded_files"] = sum(any(n.startswith(f"text-{k.hex}-") for n in files) for k in keys)
    out["shard_files"] = []
    for rank in range(TP):
        mine = shard_keys(fields, keys, f"tp{rank}/{TP}.pp0/1")
        out["shard_files"].append(sum(any(n.startswith(f"text-{k.hex}-") for n in files) for k in mine))
    victim_key = shard_keys(fields, keys[4:5], f"tp1/{TP}.pp0/1")[0]
    victim = next(disk.glob(f"text-{victim_key.hex}-*.arrow"))
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    again = vs.engine(model, mmtier=vs.mm(fields), **kw)
    out["restart"] = vs.one_by_one(again, [p, shared])
    vs.close(again)
    out["victim"] = victim.name
    quarantine = disk / "quarantine"
    out["quarantined"] = sorted(x.name for x in quarantine.glob("*")) if quarantine.exists() else []
    plain = vs.engine(model, **kw)
    out["plain"] = vs.one_by_one(plain, [p, p, shared, changed])
    out["plain_batch"] = vs.generate(plain, batch, max_tokens=160)
    out["plain_preemptions"] = vs.metric(plain, "vllm:num_preemptions")
    vs.close(plain)
    return out


def tp2_ec(model: str, tmp: str) -> dict:
    """The encoder-cache connector in a tensor-parallel engine (2 workers, the tiny LLaVA):
    vLLM computes the whole encoder output on every rank, so each rank keeps it under the
    item's own key. Images A, B, C, D, then A again (vLLM's own encoder cache lets A go): the
    vision tower runs on both ranks for each new image and on neither for A again; tokens equal
    a plain engine of the same settings. The connector is given only sizes."""
    from vllm.config import ECTransferConfig

    p = vms.prompts()["same"]
    reqs = [vms.request(p, vms.image(i)) for i in (1, 2, 3, 4, 1)]
    kw = dict(vms.MM_ARGS, tensor_parallel_size=TP, executor="mp")
    ec = ECTransferConfig(ec_connector="MMTierECConnector", ec_connector_module_path=vms.EC_CONNECTOR,
                          ec_role="ec_both",
                          ec_connector_extra_config={"mmtier_device_bytes": 16 << 20, "mmtier_tenant": "acme",
                                                     "mmtier_disk_dir": str(Path(tmp) / "ec"),
                                                     "mmtier_embed_modality": "vision_embed"})
    out: dict = {}
    llm = vs.engine(model, ec_transfer_config=ec, **kw)
    out["ec"] = vms.run(llm, reqs, vms.EncoderCalls(llm))
    vs.close(llm)
    out["ec_files"] = len(list((Path(tmp) / "ec").glob("vision_embed-*.arrow")))
    plain = vs.engine(model, **kw)
    out["plain"] = vms.run(plain, reqs, vms.EncoderCalls(plain))
    vs.close(plain)
    return out


SCENARIOS = {f.__name__: f for f in (tp2, tp2_ec)}


def main(argv: list[str]) -> int:
    name, args = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    vs.PREFIX_CACHING = bool(args.pop("prefix_caching", False))
    result = SCENARIOS[name](**args)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
