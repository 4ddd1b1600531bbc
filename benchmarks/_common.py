"""Shared benchmark plumbing: timing, machine description, flat JSON results."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mmtier.stats.machine import machine

RESULTS = Path(__file__).resolve().parent / "results"

__all__ = ["RESULTS", "Spread", "add_out_arg", "best_time", "machine", "paired_rounds", "print_table",
           "ratio_figures", "spread", "write_results"]


def add_out_arg(ap: argparse.ArgumentParser) -> None:
    """``--out DIR``: where a benchmark writes its JSON (and plot, trace); every benchmark takes
    it, so ``mmtier bench --out DIR`` (and the tests) can leave ``benchmarks/results/`` alone."""
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder (default benchmarks/results)")


def write_results(name: str, figures: dict, out: Path = RESULTS) -> Path:
    """``OUT/NAME.json`` (default ``benchmarks/results/``): the flat figures plus ``machine``,
    ``date`` and the machine's load when they were written (``cpu_load_avg_1min``: other jobs
    share it)."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"cpu_load_avg_1min": os.getloadavg()[0], **figures, "machine": machine(),
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


# ---------------------------------------------------------------------------- paired repeats
@dataclass(frozen=True)
class Spread:
    """The median of repeated measurements with the best and worst beside it, and every value."""

    median: float
    best: float
    worst: float
    values: tuple[float, ...]


def spread(values: Sequence[float], higher_is_better: bool = False) -> Spread:
    """Median, best and worst of ``values`` (best = largest when ``higher_is_better``)."""
    if not values:
        raise ValueError("no values to summarise")
    lo, hi = min(values), max(values)
    best, worst = (hi, lo) if higher_is_better else (lo, hi)
    return Spread(statistics.median(values), best, worst, tuple(values))


def paired_rounds(sides: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Run every side once per round, ``repeats`` rounds, the order rotated each round (no side
    always runs first on a warm or a cold machine); each side returns its own measurement
    (seconds, bytes/s...). Returns every side's measurements in round order, so the i-th values
    of two sides form a pair measured side by side."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(sides)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(float(sides[name]()))
    return out


def ratio_figures(name: str, num: Sequence[float], den: Sequence[float],
                  higher_is_better: bool) -> dict[str, object]:
    """Flat figures for the ratio ``num / den`` over paired measurements: ``name`` is the median
    of the per-pair ratios, ``name_best`` / ``name_worst`` beside it, ``name_n`` the number of
    pairs and ``name_pairs`` every pair as text."""
    if len(num) != len(den) or not num:
        raise ValueError(f"{name}: {len(num)} numerators against {len(den)} denominators")
    ratios = [a / b for a, b in zip(num, den)]
    s = spread(ratios, higher_is_better)
    return {name: s.median, f"{name}_best": s.best, f"{name}_worst": s.worst, f"{name}_n": len(ratios),
            f"{name}_pairs": "; ".join(f"{a:.4g}/{b:.4g}={r:.3f}" for a, b, r in zip(num, den, ratios))}
