"""Shared benchmark plumbing: timing, machine description, flat JSON results."""

from __future__ import annotations

import datetime as _dt
import json
import time
from collections.abc import Callable
from pathlib import Path

from mmtier.telemetry import machine

RESULTS = Path(__file__).resolve().parent / "results"

__all__ = ["RESULTS", "best_time", "machine", "print_table", "write_results"]


def write_results(name: str, figures: dict) -> Path:
    """``benchmarks/results/NAME.json``: the flat figures plus ``machine`` and ``date``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {**figures, "machine": machine(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    for k, v in out.items():
        if isinstance(v, (dict, list)):
            raise TypeError(f"figure {k!r} is not flat")
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
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
