"""mmtier's data path side by side with LMCache's, on the same Llama-3-8B-shaped bf16 KV.

``python -m benchmarks.peers.peer_lmcache [--groups 16] [--rounds 5] [--peer-python .venv-lmcache/bin/python]``

LMCache (0.5.6 from PyPI) runs in its own environment (``benchmarks/peers/peers_env.sh``; ``./run peers``)
as a subprocess, ``peer_lmcache_worker.py``, that answers JSON on stdout (no pickle); mmtier runs
here (``peer_lmcache_mmtier.py``). Both make the same KV from the same seeds: groups (LMCache's
chunks) of 256 tokens of 32 layers x 8 KV heads x head dim 128, bf16, 32 MiB each (the issue
measured 40; ``--groups`` defaults to 16, 512 MiB, so that a run stays within a few minutes and a
few GiB on a shared 2-core machine). Every read is compared bitwise with the source; cold reads
come after dropping the page cache (``/proc/sys/vm/drop_caches`` as root, else
``posix_fadvise(DONTNEED)`` of each file after an fsync).

Storage level (``HostTier``, ``DiskTier`` against ``LocalCPUBackend``, ``LocalDiskBackend``):
- host put / get: each group's 32 MiB into the tier / out into a caller's buffer;
- durable write: every group to disk; LMCache writes with its 4 threads and never fsyncs, so
  its figure adds one fsync of each file and of the directory afterwards (``_fsynced``); its
  time without them is reported too (``_as_it_runs``); mmtier's writes are durable when they
  return (tmp file, fsync, rename, directory fsync);
- cold read: every group back (``DiskTier.get_many`` against ``batched_get_blocking``).

Cache level (``TieredKVCache`` against ``LMCacheEngine`` with a CPU connector of 30 lines):
- put into host memory: ``put`` of every group into a device pool (here a CPU pool) that holds
  two; each put past them finds the pool full and, under ``--put-placement`` (default: not
  named, so ``CacheConfig``'s default, ``auto``: the pool is in host memory, so a demotion would
  buy nothing), is written around it into the host tier in one copy (``demote``: pushes the
  oldest group down first, two copies), against ``store`` of the same tokens into LMCache's CPU
  backend; and against the raw copies the puts must make (K and V into page-major pages in a
  host buffer of the group's own for a put written around; into one page buffer, then one
  group's pages into host memory, for a put that demoted; the layout change by the same C row
  copy the cache uses where it is built, ``raw_copy_path``);
- get from host memory: ``read_group(key, out=(k, v))`` of the host-resident groups against
  ``retrieve``, and against the raw copy (pages into ``[layers, n, heads, head_dim]``);
- durable write to disk: ``put`` of every group through a small host tier that spills to
  disk, then ``flush`` (every spill durable), against ``store`` into LMCache's disk backend
  plus the fsyncs; compared per byte that reached the disk;
- cold read: ``read_groups`` of the disk-resident groups against ``retrieve`` from disk;
- the simple calls a user writes first: ``read_group(key)`` of each host group, and of each disk
  group after dropping the page cache, one at a time, no ``out=`` (the cache allocates the
  results), against LMCache and against the ``out=`` / ``read_groups`` calls of the same round
  (``*_simple_over_*``: time, target <= 1.2); and ``read_group(key)`` of each disk group
  against the storage layer's own read of one group at a time, cold (``DiskTier.get`` into
  token-major K and V; ``cache_cold_read_simple_over_storage_read``, per group: time, target
  <= 1.2).

Both sides run with their default settings (``CacheConfig`` and LMCache's ``from_defaults``,
sized to hold the groups): the put, ``read_group(key)`` and the durable write are the calls a
user writes first; ``read_group(key, out=)`` and ``read_groups`` are the tuned forms.

Every pair (and triple, with the raw copies) runs twice per round, in one order and then the
reverse (A B B A), ``--rounds`` (>= 5) rounds, the first order rotated each round; each ratio is the median of the per-round ratios, best, worst and
every pair beside it, with ``os.getloadavg()`` per round. ``*_over_raw_*``: the cache's seconds
over the raw copies' (target <= 1.2); ``*_over_lmcache*``: the cache's speed over LMCache's
(bytes per second; target >= 1.0). Then the reliability probes on both: a flipped byte, a file
truncated to half, a restart over the same directory, and the disk budget after ``remove()``.
Writes ``benchmarks/results/peer_lmcache.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks._common import add_out_arg, print_table, ratio_figures, write_results
from benchmarks.peers.peer_lmcache_mmtier import RAW_PATH, MMTierSide

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "peer_lmcache_worker.py"

# (figure, mmtier op, LMCache op or None, raw op or None)
PAIRS = [
    ("tier_host_put", "tier_host_put", "tier_host_put", None),
    ("tier_host_get", "tier_host_get", "tier_host_get", None),
    ("tier_durable_write", "tier_disk_put", "tier_disk_put", None),
    ("tier_cold_read", "tier_disk_cold_read", "tier_disk_cold_read", None),
    ("cache_put_host", "cache_put_host", "cache_put_host", "raw_put_copies"),
    ("cache_get_host", "cache_get_host", "cache_get_host", "raw_get_copy"),
    ("cache_durable_write", "cache_put_disk", "cache_put_disk", None),
    ("cache_cold_read", "cache_cold_read", "cache_cold_read", None),
    # the simple calls (read_group(key) one group at a time, no out=) against LMCache and, in
    # the third slot, against the batched / out= call of the same groups
    ("cache_get_host_simple", "cache_get_host_simple", "cache_get_host", "cache_get_host"),
    ("cache_cold_read_simple", "cache_cold_read_simple", "cache_cold_read", "cache_cold_read"),
    # read_group(key) of each disk group against the storage layer's own read of a group, cold
    ("cache_cold_read_one", "cache_cold_read_simple", None, "tier_disk_cold_read_one"),
    ("host_checksums", "checksums", None, None),          # what the verified reads cost
]
SIMPLE = {"cache_get_host_simple": "cache_get_host", "cache_cold_read_simple": "cache_cold_read"}


class Peer:
    """The LMCache worker process: one JSON command a line in, one JSON answer a line out."""

    def __init__(self, python: str, log: Path):
        self._log = open(log, "w")
        self.proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, cwd=str(ROOT))

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"LMCache worker died during {op!r} (see {self._log.name})")
        ans = json.loads(line)
        if not ans.get("ok"):
            raise RuntimeError(f"LMCache worker: {op}: {ans.get('error')}")
        return ans

    def close(self) -> None:
        try:
            self.call("quit")
            self.proc.wait(timeout=60)
        finally:
            self._log.close()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=16, help="32 MiB groups (the issue: 40)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--peer-python", default=str(ROOT / ".venv-lmcache" / "bin" / "python"))
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    ap.add_argument("--put-placement", default=None, choices=("auto", "demote", "write_around"),
                    help="the host cache's put_placement (default: CacheConfig's own, not named)")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if args.rounds < 5:
        ap.error("--rounds must be >= 5 (medians of at least five paired rounds)")
    if not Path(args.peer_python).exists():
        ap.error(f"no LMCache environment at {args.peer_python}: run benchmarks/peers/peers_env.sh (./run peers)")
    torch.set_num_threads(args.threads)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="peer-lmcache-", dir=ROOT / "benchmarks"))
    work.mkdir(parents=True, exist_ok=True)
    shape = dict(groups=args.groups, layers=32, heads=8, head_dim=128, chunk=256, seed=7)
    peer = Peer(args.peer_python, work / "lmcache-worker.log")
    mine = None
    try:
        info = peer.call("init", **shape, workdir=str(work), threads=args.threads)
        mine = MMTierSide(**shape, workdir=str(work), put_placement=args.put_placement)
        run = {"mmtier": lambda op: getattr(mine, op)(), "lmcache": lambda op: peer.call(op),
               "raw": lambda op: getattr(mine, op)()}
        # two untimed rounds: first-touch of every buffer on both sides (the cache's host slab
        # fills over the first round and its slots are first reused in the second)
        for _ in range(2):
            for _, m_op, l_op, r_op in PAIRS:
                run["mmtier"](m_op)
                if l_op:
                    run["lmcache"](l_op)
                if r_op:
                    run["raw"](r_op)
        got: dict[str, dict[str, list[dict]]] = {name: {"mmtier": [], "lmcache": [], "raw": []}
                                                  for name, *_ in PAIRS}
        loads = []
        orders: dict[str, list[tuple[float, float]]] = {}   # per round: each side's time second over first
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name, m_op, l_op, r_op in PAIRS:
                order = [("mmtier", m_op)] + ([("lmcache", l_op)] if l_op else []) + ([("raw", r_op)] if r_op else [])
                k = r % len(order)
                # the raw copies are sized by what this round's put did: run them after it
                seq = order[k:] + order[:k]
                if r_op and seq.index(("raw", r_op)) < seq.index(("mmtier", m_op)):
                    seq.remove(("raw", r_op))
                    seq.insert(seq.index(("mmtier", m_op)) + 1, ("raw", r_op))
                # every pair (and triple) runs in both orders each round (A B B A), and each
                # side's round is its runs together: the disk serves the first writer of a
                # round at up to 3x the second's speed (the pairs of 2026-12-02 00:31), and an
                # op run right after the other process's swept memory paid for it, so a ratio of
                # one order per round measures the order, not the systems. (The raw copies of
                # the reversed half are sized by the first half's put: the same groups.)
                halves = [seq] if len(seq) < 2 else [seq, seq[::-1]]
                runs: dict[str, list[dict]] = {}
                for half in halves:
                    for side, op in half:
                        ans = run[side](op)
                        if ans.get("equal") is False:
                            raise AssertionError(f"{side} {op}: the bytes read back differ from the source")
                        runs.setdefault(side, []).append(ans)
                for side, answers in runs.items():
                    got[name][side].append(merged(answers))
                if len(halves) == 2:
                    first, second = halves[0][0][0], halves[0][1][0]
                    orders.setdefault(name, []).append(
                        (runs[first][0]["s"] / runs[first][1]["s"], runs[second][1]["s"] / runs[second][0]["s"]))
        probes = {**mine.probes(), **{k: v for k, v in peer.call("probes").items() if k.startswith("lmcache_")}}
    finally:
        if mine is not None:
            mine.close()
        peer.close()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    fig = figures(got, mine, args, info, loads, probes)
    for name, per_round in orders.items():      # per round, each side: its seconds when first over when second
        fig[f"{name}_order_effect"] = "; ".join(f"{a:.2f}/{b:.2f}" for a, b in per_round)
    print_table(f"mmtier vs LMCache {info['version']}, {args.groups} groups of 32 MiB bf16 "
                f"(medians of {args.rounds} paired rounds)",
                [(k, v) for k, v in fig.items() if not k.endswith(("_pairs", "_n"))])
    write_results("peer_lmcache", fig, args.out)
    return fig


def merged(answers: list[dict]) -> dict:
    """One side's answers of one round as one: seconds, byte and group counts added up (its
    speed is then the bytes of both runs over their time together), ``halves`` how many."""
    out = dict(answers[0])
    for key in ("s", "s_no_fsync", "groups", "disk_bytes", "demotions", "written_around"):
        if key in out:
            out[key] = sum(a[key] for a in answers)
    out["halves"] = len(answers)
    out["equal"] = all(a.get("equal", True) for a in answers)
    return out


def figures(got, mine: MMTierSide, args, info: dict, loads: list[float], probes: dict) -> dict:
    gb = mine.group_bytes
    n = args.groups
    fig: dict[str, object] = {"groups": n, "group_bytes": gb, "bytes": n * gb, "rounds": args.rounds,
                              "lmcache_version": info["version"], "lmcache_torch": info["torch"],
                              "threads": args.threads, "drop_cache": got["tier_cold_read"]["mmtier"][0]["drop"],
                              "round_loads": "; ".join(f"{x:.2f}" for x in loads)}

    def bytes_of(name: str, side: str, ans: dict) -> float:
        """Bytes the op moved: a cache op only over the groups it touched on that tier."""
        if side == "lmcache":
            return n * gb * ans.get("halves", 1)
        if name in ("cache_get_host", "cache_cold_read", *SIMPLE):
            return ans["groups"] * gb
        if name == "cache_durable_write":
            return ans["disk_bytes"]
        return n * gb * ans.get("halves", 1)

    sums = got["host_checksums"]["mmtier"]
    t_sum = sorted(a["s"] for a in sums)[len(sums) // 2] / n    # seconds per group, a pass of its own
    fig["host_checksum_gbs"] = gb / t_sum / 1e9
    fig["raw_copy_path"] = RAW_PATH
    # what checking each page's digest costs a copy out of host memory now: the verified copy
    # (digests taken by the copy itself) over the plain row copy of the same groups, per round
    if all(a["s_plain"] > 0 for a in sums):
        fig.update(ratio_figures("host_verified_copy_over_plain_copy", [a["s_verified"] for a in sums],
                                 [a["s_plain"] for a in sums], higher_is_better=False))
    for name, _, l_op, _ in PAIRS:
        if name == "cache_cold_read_one":        # per group, the cache's call over the storage layer's
            m, raw = got[name]["mmtier"], got[name]["raw"]
            fig.update(ratio_figures("cache_cold_read_simple_over_storage_read", [a["s"] / a["groups"] for a in m],
                                     [a["s"] / a["groups"] for a in raw], higher_is_better=False))
        if l_op is None:
            continue
        m, lm = got[name]["mmtier"], got[name]["lmcache"]
        m_speed = [bytes_of(name, "mmtier", a) / a["s"] for a in m]
        l_speed = [bytes_of(name, "lmcache", a) / a["s"] for a in lm]
        fig[f"{name}_gbs"] = sorted(m_speed)[len(m_speed) // 2] / 1e9
        fig[f"lmcache_{name}_gbs"] = sorted(l_speed)[len(l_speed) // 2] / 1e9
        label = {"tier_durable_write": "tier_durable_write_over_lmcache_fsynced",
                 "cache_durable_write": "cache_durable_write_over_lmcache_fsynced"}.get(name, f"{name}_over_lmcache")
        fig.update(ratio_figures(label, m_speed, l_speed, higher_is_better=True))
        if "s_no_fsync" in lm[0]:
            l_run = [bytes_of(name, "lmcache", a) / a["s_no_fsync"] for a in lm]
            fig.update(ratio_figures(label.replace("_fsynced", "_as_it_runs"), m_speed, l_run, higher_is_better=True))
        if got[name]["raw"] and name in SIMPLE:       # the simple call over the batched / out= one
            raw = got[name]["raw"]
            fig.update(ratio_figures(f"{name}_over_{SIMPLE[name]}", [a["s"] / a["groups"] for a in m],
                                     [a["s"] / a["groups"] for a in raw], higher_is_better=False))
        elif got[name]["raw"]:
            raw = got[name]["raw"]
            fig.update(ratio_figures(f"{name}_over_raw_{'copies' if 'put' in name else 'copy'}",
                                     [a["s"] for a in m], [a["s"] for a in raw], higher_is_better=False))
    per_run = lambda name, key: (lambda a: a[key] // a["halves"])(got[name]["mmtier"][-1])  # noqa: E731
    fig["put_placement"] = mine.cache_host.cfg.put_placement
    fig["put_placement_is_default"] = args.put_placement is None      # CacheConfig's default, not named
    fig["cache_put_host_demotions_per_round"] = per_run("cache_put_host", "demotions")   # per put
    fig["cache_put_host_written_around_per_round"] = per_run("cache_put_host", "written_around")
    fig["cache_get_host_groups"] = per_run("cache_get_host", "groups")
    fig["cache_cold_read_groups"] = per_run("cache_cold_read", "groups")
    fig.update(probes)
    return fig


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
