"""A long multimodal context across device, host and disk: one decode step against its floors.

``python -m benchmarks.kernels.long_context [--preset NAME] [--tokens N|max] [--layers all|1] [--repeats N]
[--device cuda] [--cluster] [--quick]``

Without ``--preset`` two rows run, each writing its own JSON:

- ``long_context.json``: a real model's shape, ``qwen2.5-vl-7b`` from ``configs/`` (28 layers,
  4 KV heads, head dim 128, bfloat16: 56 KiB per token), all layers; device and host tiers of a
  quarter of the bytes each (at most 1 GiB), the rest on disk. ``--tokens max`` takes the
  largest count the disk holds (its free bytes less ``--reserve-gib``, which also stays the
  cache's own disk free floor): the default on a GPU. On the CPU the default is 32,768 tokens
  (1.9 GB per step, a run of about a minute); the committed CPU figures are ``--tokens 760959
  --reserve-gib 8`` (43.8 GB per step, what a disk with 63 GB free held at ``--reserve-gib
  20``): ingestion (3-3.5 minutes, bound by the fsync'd spills) and six decode steps (1.8-2.7
  minutes each under a load of 6-13: held by the CPU the step gets, beside the cold disk reads
  of 41.8 GB) take 20 minutes of wall time on the shared 2-core machine;
- ``long_context_1layer.json``: 2,000,000 tokens of one layer, one KV head, head dim 64, fp32
  (512 B per token), 30 % device, 30 % host, 40 % disk.

``--dtype float8_e4m3fn`` (or ``float8_e5m2``) runs a real preset's row in fp8 pages, as an
engine with an fp8 KV cache keeps them (``--kv-cache-dtype fp8``): K and V stored as value /
``FP8_SCALE`` (a per-tensor scale in the config), half bf16's bytes (28 KiB per token at
Qwen2.5-VL-7B's shape: 2,097,152 tokens are 56 GiB), the oracle over the dequantized values;
it writes ``long_context_fp8.json``. ``--host-gib`` sizes the host tier (less goes to disk).
``--compare`` runs the preset's dtype and then fp8 at the same tokens, one after the other
(``long_context_fp8_vs_bf16.json``: bytes per token, decode time, floor ratios and errors side
by side, fp8's over bf16's). Every row checks first that the disk holds what its device and
host tiers do not, with ``--reserve-gib`` left free, and says what it needs when it does not;
its spill directory is a temporary one, removed at the end.

Each builds one sequence of interleaved text, images (576 tokens), audio clips (1500 tokens per
30 s; presets without audio skip it) and video segments, then measures one decode step: every
layer's attention over every token, computed where the pages live and merged by log-sum-exp.

- ``--repeats`` pairs (5), after one untimed step (a decode loop's steady state): each pair
  measures every resource's bandwidth (device and host: a streaming read; disk: a cold read of
  the tier's own files, up to 2 GiB, page cache dropped first, the faster of a buffered and an
  ``O_DIRECT`` read, as the tier's layer reads go direct where they can) and, on the CPU, the attention
  path's own rate over in-memory pages (in CPU seconds per intra-op thread, which other jobs on
  the machine do not inflate), then one decode with the tier's files dropped from the page
  cache (wall seconds; ``decode_cpu_s`` beside: the process's CPU seconds, split into
  ``decode_user_s`` and ``decode_sys_s``). The bandwidths swing between runs on a shared
  machine; the pairing keeps each decode beside the floor measured with it.
- ``decode_over_overlap_floor`` (headline): decode over the largest of the independent
  resources' times -- memory (device + host bytes on the CPU; device and host apart on a GPU),
  disk, and on the CPU the compute (all bytes at the attention path's rate) -- i.e. against a
  perfect overlap of reads and compute; ``decode_over_summed_floor`` beside it (the resources
  one after another). Each is the median of the pairs' ratios, best and worst and every pair
  beside it.
- ``max_rel_err`` against a float64 oracle over the gathered K/V of sampled query heads of one
  layer (the last).
- ingestion: tokens/s written through the tiers, against the disk's measured write bandwidth.

``--cluster``: the same context over a local multi-node Ray cluster on loopback (one layer);
``extrapolated_decode_s_all_layers`` multiplies its decode by the model's layers and by the
model's bytes per token and layer over the measured shape's (``tiny`` stands for Llama-3-8B):
an extrapolation that assumes decode stays bandwidth-bound, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

# OpenMP threads that wait for work sleep instead of spinning (read when torch loads). On a
# machine shared with other jobs a spinning thread burns the core another job's thread (or this
# process's own disk reader) needs, and a parallel region waits on a descheduled thread: decode
# steps measured 5-20x slower in wall time (and CPU time) under a load average of 10 with the
# default policy. The cost on an idle machine: waking sleeping threads slows a path made of many
# short parallel regions (the kernels benchmark, which keeps the default, measured its worst
# paged/contiguous ratio 2.5 instead of 1.4 idle with this setting). A serving process on
# shared cores wants it; one with cores to itself does not.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from benchmarks._common import add_out_arg, print_table, ratio_figures, spread, write_results
from benchmarks.kernels.floors import (
    Floors,
    cpu_attention_rate,
    disk_read_bandwidth,
    disk_write_bandwidth,
    drop_file_cache,
    read_bandwidth,
)
from mmtier import CacheConfig, ModalitySpec, TieredKVCache
from mmtier.attention.streaming import READERS
from mmtier.config import FP8_DTYPES
from mmtier.core.groups import Tier

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = {   # per-layer KV shape: (kv heads, head dim, query heads, dtype, layers of the model)
    "tiny": (1, 64, 4, "float32", 32),
    "llama-3-8b": (8, 128, 32, "bfloat16", 32),
    "qwen2.5-vl-7b": (4, 128, 28, "bfloat16", 28),
}
MEDIA = {"vision": 576, "audio": 1500, "video": 1024}
TIER_BYTES = 1 << 30          # device and host tiers of a preset run (the rest goes to disk)
PROBE_BYTES = 2 << 30         # the disk bandwidth probe's cold read
CPU_PRESET_TOKENS = 32_768    # a real preset's default on a CPU (see the module's docstring)


FP8_SCALE = 1 / 64            # the fp8 rows' per-tensor K and V scale (stored = value / scale)


def token_bytes(preset: str, layers: int, dtype: str | None = None) -> int:
    hkv, dim, _, preset_dtype, _ = PRESETS[preset]
    return 2 * hkv * dim * getattr(torch, dtype or preset_dtype).itemsize * layers


def max_tokens(directory: Path, preset: str, layers: int, reserve: int, dtype: str | None = None) -> int:
    """The most tokens whose K/V fit the disk under ``directory`` with ``reserve`` bytes left
    free (the device and host tiers hold some too: they are not counted, a margin)."""
    free = shutil.disk_usage(directory).free - reserve
    if free <= 0:
        raise SystemExit(f"{directory}: {shutil.disk_usage(directory).free >> 30} GiB free, "
                         f"under the {reserve >> 30} GiB reserve")
    return int(free * 0.95) // token_bytes(preset, layers, dtype)


def check_disk(directory: Path, tokens: int, preset: str, layers: int, reserve: int, dtype: str | None,
               in_memory: int) -> None:
    """Refuse up front, saying what the run needs, when the disk under ``directory`` cannot take
    the tokens' K/V beyond what the device and host tiers hold (``in_memory`` bytes) with
    ``reserve`` bytes left free."""
    need = max(0, tokens * token_bytes(preset, layers, dtype) - in_memory) + (1 << 30)   # + Arrow files, probes
    free = shutil.disk_usage(directory).free
    if free - need < reserve:
        raise SystemExit(
            f"{directory}: {tokens:,} tokens of {preset} x {layers} layers in {dtype or PRESETS[preset][3]} need "
            f"{need / 2**30:.1f} GiB on disk and {reserve / 2**30:.1f} GiB left free: "
            f"{(need + reserve) / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free "
            f"(--tokens max takes what fits; MMTIER_BENCH_DIR names another disk)")


def build_config(tokens: int, preset: str, layers: int, device: str, spill_dir: Path,
                 reserve: int, dtype: str | None = None, host_bytes: int = TIER_BYTES) -> CacheConfig:
    """``tiny``: one layer, tiers of 30 / 30 / 40 % of the bytes. A real preset: its ``configs/``
    file (modalities, page sizes, policy) with ``layers`` layers, 1 GiB device tier and a
    ``host_bytes`` host tier. ``dtype``: the pages' (default: the preset's); fp8 pages carry
    ``FP8_SCALE`` as their per-tensor K and V scale."""
    total = tokens * token_bytes(preset, layers, dtype)
    fp8 = {"k_scale": FP8_SCALE, "v_scale": FP8_SCALE} if dtype in FP8_DTYPES else {}
    path = CONFIGS / f"{preset}.yaml"
    if preset == "tiny" or not path.exists():
        hkv, dim, _, preset_dtype, _ = PRESETS[preset]
        return CacheConfig(
            model=f"long-context-{preset}", num_layers=layers, num_kv_heads=hkv, head_dim=dim,
            dtype=dtype or preset_dtype, **fp8,
            modalities={"text": ModalitySpec(page_size=16, share=0.25),
                        "vision": ModalitySpec(page_size=64, share=0.25),
                        "audio": ModalitySpec(page_size=60, share=0.25),
                        "video": ModalitySpec(page_size=128, share=0.25)},
            device=device, device_bytes=max(8 << 20, int(total * 0.30)),
            host_bytes=max(8 << 20, int(total * 0.30)),
            disk_dir=spill_dir, disk_bytes=4 * total, disk_free_floor_bytes=reserve,
            max_inflight_bytes=64 << 20)
    import yaml

    CacheConfig.from_yaml(path)                      # the preset as shipped is valid
    base = yaml.safe_load(path.read_text())         # its own fields only (no filled defaults)
    # each pool (a share of a tier) must take its modality's largest group whole
    tier = min(TIER_BYTES, max(4 * max(MEDIA.values()) * token_bytes(preset, layers, dtype), total // 4))
    host = min(host_bytes, max(tier, total // 4))
    base.update(dtype=dtype or base["dtype"], **fp8)
    base.update(num_layers=layers, device=device, device_bytes=tier, host_bytes=host, disk_dir=spill_dir,
                disk_bytes=2 * total + (1 << 30), disk_free_floor_bytes=reserve, max_inflight_bytes=64 << 20)
    return CacheConfig(**base)


def plan_segments(tokens: int, seed: int, kinds: tuple[str, ...] = ("text", "vision", "audio", "video")
                  ) -> list[tuple[str, int]]:
    """Interleaved (modality, tokens): text turns between media items, until ``tokens``."""
    rng = random.Random(seed)
    weights = {"text": 4, "vision": 3, "audio": 1, "video": 1}
    kinds = tuple(k for k in weights if k in kinds)
    out, total = [], 0
    while total < tokens:
        kind = rng.choices(kinds, weights=[weights[k] for k in kinds])[0]
        n = rng.randint(40, 400) if kind == "text" else MEDIA[kind]
        n = min(n, tokens - total)
        out.append((kind, n))
        total += n
    return out


BANK_ELEMS = 96 << 20          # random normals that K/V are cut from (192 MiB in 16 bits)


def feed(cache, seq, plan, gen, shape, keep=(0, 0), put_opts=lambda i: {}, attach_opts=None):
    """Append the plan's text and put + attach its media (random K/V of ``shape`` = (layers, KV
    heads, head dim, dtype)); returns the K and V of layer and KV head ``keep`` it fed, in order,
    for the oracle (the rest is not kept: a real model's context outgrows memory).

    Each K and V is a window at a random offset of one bank of random normals drawn once:
    drawing tens of GB of normals would take most of the ingestion time of a run at what the
    disk holds, and the cache's work (copies, checksums, files) does not depend on the values."""
    layers, hkv, dim, tdtype = shape
    row = layers * hkv * dim                         # elements per token
    elems = min(BANK_ELEMS, max(2 * row * sum(n for _, n in plan), 4 * row * max(n for _, n in plan)))
    fp8 = tdtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    # fp8: the values a KV cache stores, value / scale; the oracle gets them dequantized
    bank = (torch.randn(elems, generator=gen, dtype=torch.float32) / (FP8_SCALE if fp8 else 1)).to(tdtype)
    ks, vs = [], []
    for i, (kind, n) in enumerate(plan):
        size = row * n
        at = torch.randint(0, elems - size + 1, (2,), generator=gen).tolist()
        k = bank[at[0]:at[0] + size].view(layers, n, hkv, dim)
        v = bank[at[1]:at[1] + size].view(layers, n, hkv, dim)
        if kind == "text":
            cache.append(seq, "text", k, v)
        else:
            key = cache.content_key(kind, f"{kind}-{i}".encode(), tenant="bench")
            cache.put(key, k, v, **put_opts(i))
            cache.attach(seq, key, **(attach_opts or {}))
        ks.append(k[keep[0], :, keep[1]].clone())        # as stored (fp8: oracle_error dequantizes)
        vs.append(v[keep[0], :, keep[1]].clone())
    return ks, vs


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def measure_floors(cache, table, per_tier: dict, q: torch.Tensor, device: str,
                   spill: Path) -> tuple[Floors, dict[str, float]]:
    """Every resource's seconds for this step's bytes, bandwidths measured now."""
    dev, host, disk = per_tier[Tier.DEVICE], per_tier[Tier.HOST], per_tier[Tier.DISK]
    bw_dev = read_bandwidth(min(dev or (64 << 20), 512 << 20), device)
    bw_host = read_bandwidth(min(host or (64 << 20), 512 << 20), "cpu")
    # the disk's floor is the faster of a buffered and a direct read (the tier reads direct
    # where the file system allows it), each measured now
    bw_buffered = disk_read_bandwidth(spill, min(disk, PROBE_BYTES)) if disk else None
    bw_direct = _direct_bandwidth(spill, min(disk, PROBE_BYTES)) if disk else None
    bw_disk = max(bw_buffered or 0, bw_direct or 0) or None
    res: dict[str, float] = {}
    if device == "cpu":        # one memory: both tiers stream through the same channels
        res["memory"] = (dev + host) / ((bw_dev + bw_host) / 2)
    else:
        res["device"], res["host"] = dev / bw_dev, host / bw_host
    if disk:
        res["disk"] = disk / bw_disk
    compute = None
    if device == "cpu":
        compute = sum(per_tier.values()) / cpu_attention_rate(cache, table, q)
    return Floors(res, compute), {"device_read_gbps": bw_dev / 1e9, "host_read_gbps": bw_host / 1e9,
                                  "disk_read_gbps": (bw_disk or 0) / 1e9,
                                  "disk_read_buffered_gbps": (bw_buffered or 0) / 1e9,
                                  "disk_read_direct_gbps": (bw_direct or 0) / 1e9}


def _direct_bandwidth(spill: Path, nbytes: int) -> float | None:
    """The faster of one direct reader and ``READERS`` side by side (as the disk tier reads)."""
    try:
        return max(disk_read_bandwidth(spill, nbytes, direct=True),
                   disk_read_bandwidth(spill, nbytes, direct=True, readers=READERS))
    except OSError:              # the file system refuses O_DIRECT: the buffered read is the floor
        return None


def run(tokens: int, preset: str, layers: int, device: str, seed: int, oracle_heads: int,
        repeats: int, reserve: int, dtype: str | None = None, host_bytes: int = TIER_BYTES,
        write_behind: bool | None = None) -> dict:
    """One row; ``write_behind``: the cache's write-behind to disk on / off (``None``: the
    config's default; ``benchmarks.cache.durability_paths`` runs both in turn)."""
    hkv, dim, hq, preset_dtype, model_layers = PRESETS[preset]
    dtype = dtype or preset_dtype
    tdtype = getattr(torch, dtype)
    qdtype = torch.bfloat16 if dtype in FP8_DTYPES else tdtype     # an fp8 cache's model computes in bf16
    load_at_start = os.getloadavg()[0]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    base = Path(os.environ.get("MMTIER_BENCH_DIR", "/var/tmp"))
    with tempfile.TemporaryDirectory(prefix="mmtier-long-", dir=base) as tmp:
        spill = Path(tmp) / "spill"
        cfg = build_config(tokens, preset, layers, device, spill, reserve, dtype, host_bytes)
        if write_behind is not None:
            cfg = CacheConfig(**{**cfg.model_dump(), "write_behind": write_behind})
        check_disk(base, tokens, preset, layers, reserve, dtype, (cfg.device_bytes or 0) + cfg.host_bytes)
        plan = plan_segments(tokens, seed, tuple(cfg.modalities))
        rng = random.Random(seed)
        check_layer, check_head = layers - 1, rng.randrange(hkv)
        group = hq // hkv
        heads = rng.sample(range(check_head * group, (check_head + 1) * group), min(oracle_heads, group))
        t0 = time.perf_counter()
        with TieredKVCache(cfg) as cache:
            seq = cache.create_sequence(tenant="bench")
            ks, vs = feed(cache, seq, plan, gen, (layers, hkv, dim, tdtype), keep=(check_layer, check_head))
            cache.flush()
            ingest_s = time.perf_counter() - t0
            table = cache.sequence(seq)
            assert table.length == tokens
            per_tier = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}
            tok_tier = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}
            for s in table.segments:
                per_tier[s.group.tier] += s.group.nbytes
                tok_tier[s.group.tier] += s.group.num_tokens
            total_bytes = sum(per_tier.values())
            qs = torch.randn(layers, 1, hq, dim, generator=gen).to(qdtype).to(device)

            def step() -> torch.Tensor:
                last = None
                for layer in range(layers):
                    last = cache.attention(seq, layer, qs[layer])
                return last

            step()                    # one step first, as in a decode loop (buffers, code paths)
            runs, floors, decodes, cpu_s, user_s, sys_s = [], [], [], [], [], []
            out = torch.full_like(qs[0], float("nan"))
            for _ in range(repeats):
                fl, bws = measure_floors(cache, table, per_tier, qs[0], device, spill)
                drop_file_cache(spill)
                _sync(device)
                t1, c1, o1 = time.perf_counter(), time.process_time(), os.times()
                out = step()
                _sync(device)
                decodes.append(time.perf_counter() - t1)
                cpu_s.append(time.process_time() - c1)
                o2 = os.times()
                user_s.append(o2.user - o1.user)
                sys_s.append(o2.system - o1.system)
                floors.append(fl)
                runs.append(bws)
            bw_write = disk_write_bandwidth(Path(tmp), min(total_bytes, 256 << 20))
            err = oracle_error(qs[check_layer].cpu(), out.cpu(), ks, vs, heads, check_head)
            stats = cache.stats()
    figures: dict[str, object] = {
        "tokens": tokens, "preset": preset, "device": device, "layers": layers,
        "model_layers": model_layers, "dtype": dtype,
        **({"fp8_scale": f"per tensor, K and V {FP8_SCALE}"} if dtype in FP8_DTYPES else {}),
        "host_tier_bytes": cfg.host_bytes, "device_tier_bytes": cfg.device_bytes,
        "per_token_bytes": token_bytes(preset, layers, dtype),
        "per_token_bytes_per_layer": token_bytes(preset, 1, dtype),
        "step_bytes": total_bytes, "segments": len(plan),
        "device_tokens": tok_tier[Tier.DEVICE], "host_tokens": tok_tier[Tier.HOST],
        "disk_tokens": tok_tier[Tier.DISK],
        "device_bytes_read": per_tier[Tier.DEVICE], "host_bytes_read": per_tier[Tier.HOST],
        "disk_bytes_read": per_tier[Tier.DISK],
        "repeats": repeats,
        "summary": f"ratios: median of {repeats} (floor, decode) pairs, best and worst beside",
    }
    figures.update(ratio_figures("decode_over_overlap_floor", decodes, [f.overlap_s for f in floors], False))
    figures.update(ratio_figures("decode_over_summed_floor", decodes, [f.summed_s for f in floors], False))
    mid = sorted(range(repeats), key=lambda i: decodes[i] / floors[i].overlap_s)[repeats // 2]
    figures.update({
        "decode_s": spread(decodes).median, "decode_s_best": spread(decodes).best,
        "decode_s_worst": spread(decodes).worst,
        "decode_cpu_s": spread(cpu_s).median, "decode_user_s": spread(user_s).median,
        "decode_sys_s": spread(sys_s).median, "load_avg_1min_at_start": load_at_start,
        "load_avg_1min_at_end": os.getloadavg()[0],
        "overlap_floor_s": floors[mid].overlap_s, "summed_floor_s": floors[mid].summed_s,
        "overlap_floor_bound": floors[mid].bound,
        **{f"floor_{k}_s": v for k, v in floors[mid].resources.items()},
        "floor_compute_s": floors[mid].compute_s,
        **{k: spread([r[k] for r in runs], True).median for k in runs[0]},
        "disk_write_gbps": bw_write / 1e9,
        "runs": "; ".join(f"decode {d:.3f} s / overlap floor {f.overlap_s:.3f} s ({f.bound}) / summed "
                          f"{f.summed_s:.3f} s, disk {r['disk_read_gbps']:.2f} GB/s"
                          for d, f, r in zip(decodes, floors, runs)),
        "max_rel_err": err, "oracle": f"layer {check_layer}, query heads {heads}, float64",
        "ingest_s": ingest_s, "ingest_tokens_per_s": tokens / ingest_s,
        "ingest_over_disk_write": (total_bytes / ingest_s) / bw_write,
        "spills": stats.counters.get("spills", 0),
        "write_behind": cfg.write_behind, "durable_writes": stats.counters.get("durable_writes", 0),
        "durable_bytes": stats.counters.get("durable_bytes", 0),
        "durable_dropped": stats.counters.get("durable_dropped", 0),
    })
    return figures


def run_cluster(tokens: int, preset: str, seed: int, oracle_heads: int, nodes: int, repeats: int) -> dict:
    """The same context spread over a local multi-node Ray cluster on loopback: media groups are
    put round-robin on the nodes' pools, text on the sequence's home pool; one decode step runs
    a partial attention on every actor holding parts (remote, where the pages live) and merges
    them by log-sum-exp in the client. All nodes share this machine's cores and memory, so the
    floor is the total bytes over this machine's measured read bandwidth, measured beside each
    of ``repeats`` decodes. One layer is measured; the whole-model figure scales it by the
    layers and by the real model's bytes per token and layer over the measured shape's
    (``tiny`` stands for Llama-3-8B's 4 KiB), so it assumes decode stays bandwidth-bound."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster

    import mmtier.cluster as mma
    from mmtier.cluster import ClusterSettings

    hkv, dim, hq, dtype, model_layers = PRESETS[preset]
    tdtype = getattr(torch, dtype)
    layer_bytes = token_bytes(preset, 1)
    per_node = int(tokens * layer_bytes * 1.3 / nodes) + (64 << 20)
    cfg = CacheConfig(
        model=f"long-context-{preset}", num_layers=1, num_kv_heads=hkv, head_dim=dim, dtype=dtype,
        modalities={"text": ModalitySpec(page_size=16, share=0.25),
                    "vision": ModalitySpec(page_size=64, share=0.25),
                    "audio": ModalitySpec(page_size=60, share=0.25),
                    "video": ModalitySpec(page_size=128, share=0.25)},
        device="cpu", device_bytes=per_node * 4)
    settings = ClusterSettings(call_timeout_s=600.0, copy_after_remote_uses=0)
    gen = torch.Generator().manual_seed(seed)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"lc_node_0": 1}, "object_store_memory": 256 << 20,
        "include_dashboard": False})
    for i in range(1, nodes):
        cluster.add_node(num_cpus=1, resources={f"lc_node_{i}": 1}, object_store_memory=256 << 20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="mmtier", include_dashboard=False)
    try:
        mma.start(cfg, settings)
        cc = mma.connect(settings)
        node_ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        plan = plan_segments(tokens, seed)
        t0 = time.perf_counter()
        seq = cc.create_sequence("bench", node=node_ids[0])
        ks, vs = feed(cc, seq, plan, gen, (1, hkv, dim, tdtype),
                      put_opts=lambda i: {"node": node_ids[i % len(node_ids)]},
                      attach_opts={"transfer": "remote"})
        ingest_s = time.perf_counter() - t0
        total_bytes = tokens * layer_bytes
        q = torch.randn(1, hq, dim, generator=gen).to(tdtype)
        cc.attention(seq, 0, q)       # one untimed step first
        times, floors = [], []
        out = torch.full_like(q, float("nan"))
        for _ in range(repeats):
            floors.append(total_bytes / read_bandwidth(min(total_bytes, 512 << 20), "cpu"))
            t1 = time.perf_counter()
            out = cc.attention(seq, 0, q)
            times.append(time.perf_counter() - t1)
        heads = random.Random(seed).sample(range(hq // hkv), min(oracle_heads, hq // hkv))
        err = oracle_error(q, out, ks, vs, heads, 0)
        remote = cc.counters.get("remote_attentions", 0)
        cc.release(seq)
        cc.close()
    finally:
        mma.shutdown(settings)
        ray.shutdown()
        cluster.shutdown()
    decode_s = spread(times).median
    model = "llama-3-8b" if preset == "tiny" else preset
    model_layer_bytes = token_bytes(model, 1)
    return {
        "tokens": tokens, "preset": preset, "device": "cpu", "cluster_nodes": nodes,
        "per_token_bytes_per_layer": layer_bytes, "segments": len(plan),
        "bytes_read": total_bytes, "host_read_gbps": total_bytes / spread(floors).median / 1e9,
        "decode_s": decode_s, "decode_s_best": spread(times).best, "decode_s_worst": spread(times).worst,
        "floor_s": spread(floors).median,
        **ratio_figures("decode_over_floor", times, floors, False),
        "max_rel_err": err, "remote_attentions": remote,
        "ingest_s": ingest_s, "ingest_tokens_per_s": tokens / ingest_s,
        "extrapolated_model": f"{model} ({PRESETS[model][4]} layers, {model_layer_bytes} B per token and layer)",
        "extrapolated_decode_s_all_layers": decode_s * PRESETS[model][4] * model_layer_bytes / layer_bytes,
    }


ORACLE_ROWS = 1 << 18          # keys per float64 chunk of the oracle (memory stays bounded)


def oracle_error(q, out, ks, vs, heads: list[int], kv_head: int) -> float:
    """Max relative error over the query ``heads`` (all of one KV head's group), float64 over
    that KV head's gathered K/V (``ks``/``vs``: ``[n, D]`` per segment, as stored: fp8 rows
    are dequantized here, value x ``FP8_SCALE``), a chunk of keys at a time."""
    k, v = torch.cat(ks), torch.cat(vs)       # [T, D] in the pages' dtype
    scale = FP8_SCALE if k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 1.0
    dim = k.shape[1]
    chunks = range(0, k.shape[0], ORACLE_ROWS)
    worst = 0.0
    del kv_head                       # ks / vs hold only that head
    for h in heads:
        qh = q[0, h].double()
        s = torch.cat([(k[c:c + ORACLE_ROWS].double() * scale) @ qh for c in chunks]) * dim ** -0.5
        p = torch.softmax(s, dim=0)
        ref = sum(p[c:c + ORACLE_ROWS] @ (v[c:c + ORACLE_ROWS].double() * scale) for c in chunks)
        worst = max(worst, float((out[0, h].double() - ref).abs().max() / ref.abs().max()))
    return worst


COMPARED = ("per_token_bytes", "step_bytes", "disk_bytes_read", "decode_s", "decode_cpu_s", "overlap_floor_s",
            "overlap_floor_bound", "decode_over_overlap_floor", "decode_over_overlap_floor_best",
            "decode_over_overlap_floor_worst", "decode_over_summed_floor", "floor_compute_s", "floor_disk_s",
            "disk_read_gbps", "max_rel_err", "ingest_s", "load_avg_1min_at_end")


def compare(tokens: int, preset: str, layers: int, args, repeats: int, reserve: int) -> dict:
    """The preset's dtype and fp8 at the same tokens, one after the other (each with its own
    floor + decode pairs): their figures side by side and fp8's over the other's."""
    fp8 = args.dtype if args.dtype in FP8_DTYPES else "float8_e4m3fn"
    host = int(args.host_gib * (1 << 30))
    rows = {}
    for dtype in (PRESETS[preset][3], fp8):
        rows[dtype] = run(tokens, preset, layers, args.device, args.seed, args.oracle_heads, repeats, reserve,
                          dtype, host)
    base, low = rows[PRESETS[preset][3]], rows[fp8]
    out: dict = {"tokens": tokens, "preset": preset, "layers": layers, "repeats": repeats,
                 "dtypes": f"{PRESETS[preset][3]} then {fp8}, one run after the other",
                 "fp8_scale": f"per tensor, K and V {FP8_SCALE}"}
    for name in COMPARED:
        out[f"{PRESETS[preset][3]}_{name}"] = base[name]
        out[f"fp8_{name}"] = low[name]
    for name in ("per_token_bytes", "decode_s", "decode_cpu_s", "overlap_floor_s"):
        out[f"fp8_over_{PRESETS[preset][3]}_{name}"] = low[name] / base[name]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="one row of this shape (default: both rows, qwen2.5-vl-7b and tiny)")
    ap.add_argument("--tokens", default=None,
                    help="a count, or 'max' (what the disk holds); default: a real preset max on a "
                         f"GPU, {CPU_PRESET_TOKENS:,} on the CPU; tiny 2,000,000")
    ap.add_argument("--layers", default=None, help="'all' (the preset's; default) or a count; tiny: 1")
    ap.add_argument("--reserve-gib", type=float, default=4.0, help="disk left free (and the cache's floor)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16", *FP8_DTYPES),
                    help="the pages' dtype (default: the preset's); fp8 rows write long_context_fp8.json")
    ap.add_argument("--compare", action="store_true",
                    help="fp8 against the preset's dtype at the same tokens, one run after the other "
                         "(--dtype: the fp8 format, default float8_e4m3fn): long_context_fp8_vs_bf16.json")
    ap.add_argument("--host-gib", type=float, default=TIER_BYTES / 2**30,
                    help="host tier of a real preset's row (default 1; less goes to disk)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--oracle-heads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=None, help="floor + decode pairs (5; quick 2)")
    ap.add_argument("--quick", action="store_true", help="12k tokens of 2 of the preset's layers, 50k of tiny")
    ap.add_argument("--cluster", action="store_true",
                    help="spread the context over a local multi-node Ray cluster on loopback")
    ap.add_argument("--nodes", type=int, default=3, help="nodes of the --cluster run")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 5)
    reserve = int(args.reserve_gib * (1 << 30))
    base = Path(os.environ.get("MMTIER_BENCH_DIR", "/var/tmp"))
    presets = [args.preset] if args.preset else ["tiny"] if args.cluster else ["qwen2.5-vl-7b", "tiny"]
    out: dict = {}
    for preset in presets:
        layers = 1 if preset == "tiny" or args.cluster else PRESETS[preset][4]
        if args.layers not in (None, "all"):
            layers = int(args.layers)
        if args.quick:             # seconds: a few layers of the preset, a small tiny row
            tokens = 50_000 if preset == "tiny" else 12_000
            layers = layers if preset == "tiny" or args.layers not in (None, "all") else 2
        elif args.tokens == "max" or (args.tokens is None and preset != "tiny" and args.device != "cpu"):
            tokens = max_tokens(base, preset, layers, reserve, args.dtype)
        elif args.tokens is None and preset != "tiny":
            tokens = CPU_PRESET_TOKENS
        else:
            tokens = int(args.tokens or 2_000_000)
        if args.compare:
            figures = compare(tokens, preset, layers, args, repeats, reserve)
            name = "long_context_fp8_vs_bf16"
        elif args.cluster:
            figures = run_cluster(tokens, preset, args.seed, args.oracle_heads, args.nodes, repeats)
            name = "long_context_cluster"
        else:
            figures = run(tokens, preset, layers, args.device, args.seed, args.oracle_heads, repeats, reserve,
                          args.dtype, int(args.host_gib * (1 << 30)))
            name = "long_context_1layer" if preset == "tiny" else "long_context"
            if args.dtype in FP8_DTYPES:
                name += "_fp8"
        print_table(f"long context ({preset}): {tokens:,} tokens, one decode step of {layers} layer(s)",
                    list(figures.items()))
        path = write_results(name, figures, args.out)
        print(f"wrote {path}")
        out[name] = figures
    return out


if __name__ == "__main__":
    main()
