"""Shared benchmark plumbing: timing, machine description, flat JSON results."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import time
from collections.abc import Callable
from pathlib import Path

from mmtier.telemetry import machine

RESULTS = Path(__file__).resolve().parent / "results"

__all__ = ["RESULTS", "add_out_arg", "best_time", "machine", "print_table", "write_results"]


def add_out_arg(ap: argparse.ArgumentParser) -> None:
    """``--out DIR``: where a benchmark writes its JSON (and plot, trace); every benchmark takes
    it, so ``mmtier bench --out DIR`` (and the tests) can leave ``benchmarks/results/`` alone."""
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder (default benchmarks/results)")


def write_results(name: str, figures: dict, out: Path = RESULTS) -> Path:
    """``OUT/NAME.json`` (default ``benchmarks/results/``): the flat figures plus ``machine`` and
    ``date``."""
    out.mkdir(parents=True, exist_ok=True)
    data = {**figures, "machine": machine(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    for k, v in data.items():
        if isinstance(v, (dict, list)):
            raise TypeError(f"figure {k!r} is not flat")
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def best_time(fn: Callable[[], object], repeat: int = 5, min_time: float = 0.05) -> float:
    """Best seconds per call over ``repeat`` rounds, each long enough to time reliably."""
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_time or n >= 1 << 20:
            break
        n *= 2
    best = dt / n
    for _ in range(repeat - 1):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def print_table(title: str, rows: list[tuple[str, object]]) -> None:
    width = max((len(k) for k, _ in rows), default=10)
    print(f"\n{title}")
    print("-" * (width + 24))
    for k, v in rows:
        val = f"{v:,.4g}" if isinstance(v, float) else str(v)
        print(f"{k:<{width}}  {val}")
