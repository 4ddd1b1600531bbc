"""The repository documents itself: its design is in ``docs/``, and nothing points to files
outside the repository (a clone has only what is committed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.support.repo_paths import missing_modules

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared|shared/DESIGN|DESIGN\.md|(?<![\w/])seed/")


def test_design_docs_are_in_the_repository():
    design = (ROOT / "docs" / "design.md").read_text()
    assert "## Public contract" in design and "(seed.md)" in design
    assert (ROOT / "docs" / "seed.md").read_text().startswith("# The design note")
    assert "docs/design.md" in (ROOT / "README.md").read_text()


def test_no_reference_to_files_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    hits = []
    for name in files:
        if not name.endswith((".py", ".md", ".yaml", ".toml", ".sh", ".txt")) and name != "run":
            continue
        if name == "tests/test_docs.py":
            continue
        for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{name}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


REPO_PATH = re.compile(r"`((?:mmtier|tests|benchmarks|configs|docs|\.ci)/[\w./-]+)`")


def test_the_paths_and_modules_the_readme_and_design_name_exist():
    """Every repository path the README and the design doc name in backticks, and every module
    they run with ``python -m``, exists (files move: the house moved 250 of them); names with a
    placeholder in capitals (``benchmarks/results/NAME.json``) are patterns, not paths."""
    missing = []
    for doc in ("README.md", "docs/design.md"):
        text = (ROOT / doc).read_text()
        for path in REPO_PATH.findall(text):
            path = path.rstrip("/.")
            if re.search(r"[A-Z]{3,}", path) or "*" in path:
                continue
            if not (ROOT / path).exists():
                missing.append(f"{doc}: {path}")
        missing += [f"{doc}: -m {module}" for module in missing_modules(text)]
    assert not missing, "\n".join(missing)
