"""The ``mmtier`` command."""

from __future__ import annotations

import importlib
import sys

import click

BENCHMARKS = ("alloc", "kernels", "spill", "eviction", "cluster")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """mmtier: a tiered, modality-aware, paged KV-cache store for multimodal LLM serving."""


@main.command()
@click.option("--conversations", default=6, show_default=True, help="Conversations to run.")
@click.option("--turns", default=3, show_default=True, help="Turns per conversation.")
@click.option("--quick", is_flag=True, help="A smaller run (same checks).")
def demo(conversations: int, turns: int, quick: bool) -> None:
    """Cache and share images and audio across conversations; print what was stored and reused."""
    from .demo import format_report, run_demo

    if quick:
        conversations, turns = 3, 2
    report = run_demo(conversations=conversations, turns=turns)
    click.echo(format_report(report))
    if report.max_rel_err > 1e-5:
        click.echo("attention check FAILED", err=True)
        sys.exit(1)


@main.command()
@click.argument("names", nargs=-1)
@click.option("--quick", is_flag=True, help="Smaller sizes.")
def bench(names: tuple[str, ...], quick: bool) -> None:
    """Run benchmarks (default: all available) and write benchmarks/results/*.json."""
    for name in names or BENCHMARKS:
        try:
            mod = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as exc:
            click.echo(f"skip {name}: {exc}", err=True)
            continue
        mod.main(["--quick"] if quick else [])


if __name__ == "__main__":
    main()
