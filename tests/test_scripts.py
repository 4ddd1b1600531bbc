"""The shell scripts the README and CI call (``run``, ``.ci/run``, the environment makers, the
GPU check): each one that moves to the repository root from its own folder lands there, and the
scripts' paths into the tree exist. A script moved a folder deeper without its ``cd`` changed
ran from the wrong folder (``sha256sum: pyproject.toml: No such file or directory``: the CI of
2026-12-05 failed after 64 s on ``tests/support/engines_env.sh``)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.repo_paths import missing_modules, modules_run

ROOT = Path(__file__).resolve().parents[1]
CD_TO_OWN_FOLDER = re.compile(r'^cd "\$\(dirname "\$0"\)(?P<rel>(?:/\.\.)*)"', re.M)


def _scripts() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.sh", "run", ".ci/run"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in tracked]


def test_every_script_that_moves_to_the_root_lands_there():
    scripts = _scripts()
    assert {"run", ".ci/run", "tests/support/engines_env.sh"} <= {
        s.relative_to(ROOT).as_posix() for s in scripts}
    checked = 0
    for script in scripts:
        m = CD_TO_OWN_FOLDER.search(script.read_text())
        if m is None:
            continue
        lands = (script.parent / m.group("rel").lstrip("/")).resolve() if m.group("rel") \
            else script.parent.resolve()
        assert lands == ROOT, f"{script.relative_to(ROOT)} moves to {lands}, not the repository root"
        checked += 1
    assert checked >= 5, checked


def test_the_paths_run_calls_exist():
    text = (ROOT / "run").read_text() + (ROOT / ".ci/run").read_text()
    paths = set(re.findall(r"(?<![\w./$-])((?:tests|benchmarks)/[\w/.-]+\.(?:sh|py))", text))
    assert "tests/support/engines_env.sh" in paths
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, missing
    assert any(m.startswith("benchmarks.") for m in modules_run(text)), "run names no benchmark module"
    assert not missing_modules(text), missing_modules(text)


def test_the_engines_env_script_runs_from_any_folder(tmp_path):
    engines = ROOT / ".venv-engines"
    if not (engines / ".mmtier-engines").is_file():
        pytest.skip("no engines environment here (./run engines makes it): the script would "
                    "install vLLM, minutes of work, rather than check its stamp")
    script = ROOT / "tests/support/engines_env.sh"
    content = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + script.read_bytes())
    if not (engines / ".mmtier-engines").read_text().strip().endswith(content.hexdigest()[:16]):
        pytest.skip("the engines environment here is older than pyproject.toml or the script "
                    "(./run engines remakes it): the script would reinstall rather than check")
    env = {**os.environ, "PYTHON": "python3"}
    done = subprocess.run(["bash", str(script), str(ROOT / ".venv"), str(engines)], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=60)
    # the stamp says what pyproject.toml and the script hash to; from another folder the
    # script must read the same files (an up-to-date environment) and change nothing
    assert done.returncode == 0, done.stderr
    assert "[engines] up to date" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []
