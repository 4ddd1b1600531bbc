"""Runs one real-engine scenario in a process of its own (``python -m MODULE NAME ARGS_JSON``,
which prints one ``RESULT {...}`` line) and returns its result: the pytest drivers of
``tests/support/vllm_scenarios.py`` and ``tests/support/vllm_mm_scenarios.py`` share it. vLLM's spawned
processes want a ``__main__`` guard and the environment set before vLLM is imported, which a
process per scenario gives them; the test process itself imports no vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCENARIO_TIMEOUT_S = 900


def scenario(module: str, name: str, tmp: Path, **args) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run([sys.executable, "-m", module, name, json.dumps({"tmp": str(tmp), **args})],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout[-2000:] + done.stderr[-6000:])
    return json.loads(lines[-1][len("RESULT "):])


def scenario_main(scenarios: dict, argv: list[str]) -> int:
    """A scenario module's ``main``: runs ``scenarios[argv[0]]`` with the JSON arguments
    ``argv[1]``, keeps the result in ``tmp/NAME.json`` (to look at) and prints it."""
    name, args = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    tmp = Path(args.get("tmp", "."))
    tmp.mkdir(parents=True, exist_ok=True)
    result = scenarios[name](**args)
    (tmp / f"{name}.json").write_text(json.dumps(result))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def column(rows: list[dict], name: str) -> list:
    """One field of a scenario's rows: ``column(rows, "cached")``."""
    return [r[name] for r in rows]
