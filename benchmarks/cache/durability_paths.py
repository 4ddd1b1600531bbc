"""The long-context and data-path benchmarks with the write-behind to disk on against off.

``python -m benchmarks.cache.durability_paths [--pairs N] [--rounds N] [--tokens N] [--quick]``

``CacheConfig.write_behind`` (default on with a ``disk_dir``) writes every saved group to disk
in the background (``mmtier/tiers/durability.py``). Whether that costs the paths that save and
read groups is measured here in pairs, the two settings in turn (the order alternating from pair
to pair), each ratio on / off the median of the pairs', best and worst and every pair beside it,
the load average at each run beside:

- **data path** (``connector_copy``'s save and load, now with a disk tier): one request's prompt
  (16 layers, 8 KV heads, head dim 128, fp16, 2,048 tokens in groups of 16 blocks of 16: 128
  MiB) saved from vLLM-layout blocks (``put`` straight from the engine's tensors, the CPU path)
  and loaded back into them (``read_group(out=)``), checked equal; two caches side by side, one
  with the write-behind on and one off, each with its own ``disk_dir``. A round saves fresh
  groups (timed: the write-behind starts meanwhile), waits for the write-behind to drain (its
  seconds recorded, not in the ratios: the condition is a disk that keeps up within
  ``durable_lag_s``), loads them (timed) and drops them, so no round evicts
  (eviction with a durable copy skips its write: that saving is not what is asked here).
  ``save_on_over_off`` / ``load_on_over_off``: seconds on over off (1.0 = unchanged; > 1:
  slower on).
- **long context** (``benchmarks.kernels.long_context``'s row at a size that takes seconds: a
  Qwen2.5-VL-7B shape with 2 of its layers, ``--tokens`` 32,768, device and host tiers of a
  quarter of the bytes each, the rest spilled to disk): ingestion tokens/s and one decode step
  over every tier (page cache dropped first; the write-behind drained before, by ``flush``), on
  over off: ``long_context_ingest_on_over_off`` (tokens/s, < 1: slower on; the write-behind
  runs during ingestion), ``long_context_decode_on_over_off`` (wall seconds, > 1: slower on) and
  ``long_context_decode_cpu_on_over_off`` (the step's CPU seconds, which a shared machine's
  load inflates least).
- **lag** (the write-behind's defaults, on only): the save-to-durable lag of a steady stream of
  saves, 8 MiB every 100 ms (quiet between saves: each written once the holdback
  ``durable_quiet_s`` has passed) and 1 MiB every 20 ms (never quiet: written at the latest
  when the oldest save has waited half of ``durable_lag_s``), 3 s each: p50 / p99 / max ms and
  the saves dropped.

Writes ``benchmarks/results/durability_paths.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # as long_context (shared cores)

import torch  # noqa: E402

from benchmarks._common import add_out_arg, print_table, ratio_figures, write_results  # noqa: E402
from benchmarks.kernels import long_context  # noqa: E402
from mmtier import CacheConfig, TieredKVCache  # noqa: E402
from mmtier.engines.vllm import copy as vllm_copy  # noqa: E402

MODES = (True, False)          # write-behind on, off


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class DataPath:
    """``connector_copy``'s CPU save and load of one prompt, over a cache with a disk tier."""

    def __init__(self, base: Path, quick: bool, quiet_s: float):
        L, H, D, BS = (4, 4, 64, 16) if quick else (16, 8, 128, 16)
        self.D, self.BS, self.tokens = D, BS, 512 if quick else 2048
        self.group = 16 * BS                               # the connector's default chunk
        nblk, num_blocks = self.tokens // BS, 2 * (self.tokens // BS)
        g = torch.Generator().manual_seed(0)
        self.block_ids = [int(b) for b in torch.randperm(num_blocks, generator=g)[:nblk]]

        def paged(fill: bool):
            t = torch.full((num_blocks, BS, H, 2 * D), float("nan"), dtype=torch.float16)
            if fill:
                t.copy_(torch.randn(t.shape, generator=g).to(torch.float16))
            return t.transpose(1, 2)
        self.src = [paged(True) for _ in range(L)]
        self.dst = [paged(False) for _ in range(L)]
        self.nbytes = L * self.tokens * H * 2 * D * 2
        self.caches = {}
        for on in MODES:
            cfg = CacheConfig(model="bench-connector", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float16",
                              modalities={"text": {"page_size": BS}}, device="cpu", device_bytes=3 * self.nbytes,
                              host_bytes=0, disk_dir=base / f"wb-{'on' if on else 'off'}", write_behind=on,
                              durable_quiet_s=quiet_s)
            self.caches[on] = TieredKVCache(cfg)
            self.caches[on].pools["text"].view.zero_()     # the arena resident (no first-touch faults timed)
        self._made = iter(range(1 << 30))

    def _keys(self, cache: TieredKVCache) -> list:
        r = next(self._made)
        return [cache.content_key("text", f"r{r}g{i}".encode()) for i in range(self.tokens // self.group)]

    def round(self, on: bool) -> dict[str, float]:
        """Save fresh groups, wait for the write-behind, load them back (checked), drop them."""
        cache, nb = self.caches[on], self.group // self.BS
        keys = self._keys(cache)                           # the scheduler's work, before timing

        def save():
            for i, key in enumerate(keys):
                blocks = vllm_copy.engine_blocks(self.src, self.D, self.block_ids[i * nb:(i + 1) * nb])
                cache.put(key, blocks, blocks)

        def load():
            for i, key in enumerate(keys):
                cache.read_group(key, out=vllm_copy.engine_blocks(self.dst, self.D,
                                                                  self.block_ids[i * nb:(i + 1) * nb]))
        for t in self.dst:
            t.fill_(float("nan"))
        load_avg = os.getloadavg()[0]
        out = {"save": _timed(save), "load_avg": load_avg}
        out["drain"] = _timed(cache.flush)                 # the disk keeping up (not in the ratios)
        out["load"] = _timed(load)
        if not all(torch.equal(d.transpose(1, 2)[self.block_ids], s.transpose(1, 2)[self.block_ids])
                   for d, s in zip(self.dst, self.src, strict=True)):
            raise AssertionError("load did not restore the saved bytes")
        cache.drop_unreferenced(keys)
        return out

    def counters(self, on: bool) -> dict[str, int]:
        c = self.caches[on].stats().counters
        return {k: c.get(k, 0) for k in ("durable_writes", "durable_bytes", "durable_dropped",
                                         "durable_write_errors", "durable_lag_p50_ms", "durable_lag_p99_ms")}

    def close(self) -> None:
        for c in self.caches.values():
            c.close()


def data_path(pairs: int, quick: bool, quiet_s: float = CacheConfig.model_fields["durable_quiet_s"].default) -> dict:
    with tempfile.TemporaryDirectory(prefix="mmtier-wb-", dir=os.environ.get("MMTIER_BENCH_DIR", "/var/tmp")) as tmp:
        dp = DataPath(Path(tmp), quick, quiet_s)
        try:
            for on in MODES:                               # warm-up: stages, first touch, the thread
                dp.round(on)
            runs: dict[bool, list[dict]] = {on: [] for on in MODES}
            for p in range(pairs):
                for on in (MODES if p % 2 == 0 else MODES[::-1]):
                    runs[on].append(dp.round(on))
            counters = dp.counters(True)
            nbytes, tokens = dp.nbytes, dp.tokens
        finally:
            dp.close()
    on, off = runs[True], runs[False]
    fig: dict = {"data_path_bytes": nbytes, "data_path_durable_quiet_s": quiet_s, "data_path_tokens": tokens,
                 "data_path_pairs": pairs,
                 "data_path_shape": "16 layers x 8 KV heads x 128 fp16, groups of 16 blocks of 16 tokens"
                                    if not quick else "quick: 4 x 4 x 64",
                 "data_path_save_gbs_on": nbytes / statistics.median(r["save"] for r in on) / 1e9,
                 "data_path_save_gbs_off": nbytes / statistics.median(r["save"] for r in off) / 1e9,
                 "data_path_load_gbs_on": nbytes / statistics.median(r["load"] for r in on) / 1e9,
                 "data_path_load_gbs_off": nbytes / statistics.median(r["load"] for r in off) / 1e9,
                 "data_path_drain_s_on": statistics.median(r["drain"] for r in on),
                 "data_path_drain_s_off": statistics.median(r["drain"] for r in off),
                 "data_path_loads": "; ".join(f"{r['load_avg']:.2f}" for r in on + off),
                 **{f"data_path_{k}_on": v for k, v in counters.items()}}
    # seconds on over seconds off: > 1 means slower with the write-behind on
    fig.update(ratio_figures("save_on_over_off", [r["save"] for r in on], [r["save"] for r in off], False))
    fig.update(ratio_figures("load_on_over_off", [r["load"] for r in on], [r["load"] for r in off], False))
    return fig


def lag_stream(base: Path, nbytes: int, every_s: float, seconds: float,
               quiet_s: float = CacheConfig.model_fields["durable_quiet_s"].default) -> dict[str, int]:
    """Saves of ``nbytes`` every ``every_s`` for ``seconds`` into a cache with a disk tier; its
    write-behind's lag gauges and counts once drained."""
    L, H, D = 16, 8, 128
    tokens = nbytes // (L * H * D * 2 * 2)
    n = int(seconds / every_s)
    cfg = CacheConfig(model="bench-lag", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float16",
                      modalities={"text": {"page_size": 16}}, device="cpu", device_bytes=(n + 2) * nbytes,
                      host_bytes=0, disk_dir=base, persist_on_close=False, durable_quiet_s=quiet_s)
    k = torch.randn(L, tokens, H, D).to(torch.float16)
    with TieredKVCache(cfg) as cache:
        next_at = time.monotonic()
        for i in range(n):
            time.sleep(max(0.0, next_at - time.monotonic()))
            cache.put(cache.content_key("text", f"lag{i}".encode()), k, k)
            next_at += every_s
        cache.durable.drain()
        c = cache.stats().counters
        return {name: c.get(name, 0) for name in ("durable_lag_p50_ms", "durable_lag_p99_ms", "durable_lag_max_ms",
                                                  "durable_writes", "durable_dropped")}


def lag_streams(quick: bool) -> dict:
    seconds = 1.0 if quick else 3.0
    fig: dict = {"lag_durable_lag_s": CacheConfig.model_fields["durable_lag_s"].default,
                 "lag_durable_quiet_s": CacheConfig.model_fields["durable_quiet_s"].default,
                 "lag_load_avg": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="mmtier-lag-", dir=os.environ.get("MMTIER_BENCH_DIR", "/var/tmp")) as tmp:
        for name, nbytes, every in (("8mib_100ms", 8 << 20, 0.1), ("1mib_20ms", 1 << 20, 0.02)):
            got = lag_stream(Path(tmp) / name, nbytes, every, seconds)
            fig.update({f"lag_{name}_{k}": v for k, v in got.items()})
    return fig


def long_context_pairs(pairs: int, tokens: int, layers: int, repeats: int) -> dict:
    runs: dict[bool, list[dict]] = {on: [] for on in MODES}
    for p in range(pairs):
        for on in (MODES if p % 2 == 0 else MODES[::-1]):
            runs[on].append(long_context.run(tokens, "qwen2.5-vl-7b", layers, "cpu", seed=p, oracle_heads=2,
                                             repeats=repeats, reserve=4 << 30, write_behind=on))
    on, off = runs[True], runs[False]
    for r in on + off:
        assert r["max_rel_err"] < 8e-3, r["max_rel_err"]
    first = on[0]
    fig: dict = {"long_context_tokens": tokens, "long_context_layers": layers, "long_context_pairs": pairs,
                 "long_context_repeats": repeats,
                 **{f"long_context_{k}": first[k] for k in ("step_bytes", "device_tokens", "host_tokens",
                                                             "disk_tokens")},
                 "long_context_ingest_tokens_per_s_on": statistics.median(r["ingest_tokens_per_s"] for r in on),
                 "long_context_ingest_tokens_per_s_off": statistics.median(r["ingest_tokens_per_s"] for r in off),
                 "long_context_decode_s_on": statistics.median(r["decode_s"] for r in on),
                 "long_context_decode_s_off": statistics.median(r["decode_s"] for r in off),
                 "long_context_decode_cpu_s_on": statistics.median(r["decode_cpu_s"] for r in on),
                 "long_context_decode_cpu_s_off": statistics.median(r["decode_cpu_s"] for r in off),
                 "long_context_decode_over_overlap_floor_on": statistics.median(r["decode_over_overlap_floor"] for r in on),
                 "long_context_decode_over_overlap_floor_off": statistics.median(r["decode_over_overlap_floor"] for r in off),
                 "long_context_spills_on": statistics.median(r["spills"] for r in on),
                 "long_context_spills_off": statistics.median(r["spills"] for r in off),
                 "long_context_durable_bytes_on": statistics.median(r["durable_bytes"] for r in on),
                 "long_context_durable_dropped_on": max(r["durable_dropped"] for r in on),
                 "long_context_max_rel_err": max(r["max_rel_err"] for r in on + off),
                 "long_context_loads": "; ".join(f"{r['load_avg_1min_at_start']:.2f}" for r in on + off)}
    # tokens/s: on over off (< 1 slower on); decode seconds: on over off (> 1 slower on)
    fig.update(ratio_figures("long_context_ingest_on_over_off", [r["ingest_tokens_per_s"] for r in on],
                             [r["ingest_tokens_per_s"] for r in off], True))
    fig.update(ratio_figures("long_context_decode_on_over_off", [r["decode_s"] for r in on],
                             [r["decode_s"] for r in off], False))
    # CPU seconds of the step: what other jobs on a shared machine inflate least
    fig.update(ratio_figures("long_context_decode_cpu_on_over_off", [r["decode_cpu_s"] for r in on],
                             [r["decode_cpu_s"] for r in off], False))
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=7, help="data-path pairs (on and off in turn)")
    ap.add_argument("--lc-pairs", type=int, default=5, help="long-context pairs")
    ap.add_argument("--tokens", type=int, default=32_768, help="long-context tokens")
    ap.add_argument("--layers", type=int, default=2, help="long-context layers of Qwen2.5-VL-7B's shape")
    ap.add_argument("--repeats", type=int, default=2, help="decode steps per long-context run")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a shared machine: 1)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: small shapes, 2 pairs each")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pairs, lc_pairs = (2, 1) if args.quick else (args.pairs, args.lc_pairs)
    tokens = 8192 if args.quick else args.tokens
    load_start, t0 = os.getloadavg(), time.perf_counter()
    fig = {"quick": args.quick, "threads": torch.get_num_threads(),
           "summary": "ratios on / off of seconds (ingest: of tokens/s), median of pairs run in turn, "
                      "the order alternating",
           **data_path(pairs, args.quick),
           **long_context_pairs(lc_pairs, tokens, args.layers, args.repeats),
           **lag_streams(args.quick),
           "load_avg_at_start": " / ".join(f"{x:.2f}" for x in load_start),
           "load_avg_at_end": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
           "wall_s": time.perf_counter() - t0,
           "disk_free_gib": shutil.disk_usage(os.environ.get("MMTIER_BENCH_DIR", "/var/tmp")).free / 2**30}
    print_table("write-behind on vs off: data path and long context",
                [(k, v) for k, v in fig.items() if "_over_" in k or k.startswith("lag_")
                 or k.endswith(("gbs_on", "gbs_off", "_s_on", "_s_off"))])
    write_results("durability_paths", fig, args.out)
    return fig


if __name__ == "__main__":
    main()
