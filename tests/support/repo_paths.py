"""What the repository's own text names: the ``python -m`` modules a README, doc or script runs,
and which of them no longer exist (files move; a stale name is a newcomer's first error)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE_RUN = re.compile(r"-m ((?:benchmarks|mmtier)(?:\.\w+)+)")
PLACEHOLDER = re.compile(r"\.[A-Z]+(\.|$)")          # benchmarks.GROUP.NAME: a pattern, not a module


def modules_run(text: str) -> set[str]:
    """The project's modules ``text`` runs with ``-m`` (placeholders left out)."""
    return {m for m in MODULE_RUN.findall(text) if not PLACEHOLDER.search(m)}


def missing_modules(text: str) -> list[str]:
    """Those of ``modules_run(text)`` with neither a ``.py`` file nor a package folder."""
    missing = []
    for module in sorted(modules_run(text)):
        base = ROOT / module.replace(".", "/")
        if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
            missing.append(module)
    return missing
