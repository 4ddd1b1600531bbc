#!/usr/bin/env bash
# One command for a GPU machine (plain `python`: 3.12, torch, triton, pyarrow, aiofiles, pytest;
# no Ray, no venv, no network). Everything runs compiled on CUDA (TRITON_INTERPRET unset):
#   0. when .gpu-wheels/ came along (benchmarks/gpu_wheels.sh here, then `carry: [".gpu-wheels"]`)
#      the cache's missing pure dependencies (pydantic, ...) are unpacked into a scratch
#      directory on PYTHONPATH, so the whole cache imports; without them only the kernels do
#      (through a shim package) and steps 1b and 3 are skipped;
#   1. tests: (a) the Triton kernel tests; (b) the cache suite with its pool on the GPU
#      (tests/test_cache.py, test_cache_tiers.py, test_model_e2e.py, each test on the torch and
#      the triton backend, and the test that an attention call makes no host sync);
#   2. `python -m benchmarks.kernels --device cuda` (paged Triton vs SDPA / flash over the same
#      K/V made contiguous, fp16 and bf16, page sizes 16, 64, 256 and mixed, 64K-1M tokens);
#   3. `python -m benchmarks.long_context --device cuda --preset $LC_PRESET --tokens $LC_TOKENS`
#      (one layer of a real model's shape per decode step, across GPU, host and NVMe).
# Everything lands under $OUT (default ./gpu_check_out): env.txt, tests.txt + tests.xml
# (junit), bench.txt, kernels.json, long_context.txt/.json, summary.json (exit codes, test
# counts, headline figures): 8 files at most, what a device call brings back. Exit status:
# non-zero if a step that ran failed.
# Time: the three steps' limits (TEST_TIMEOUT 240 s, BENCH_TIMEOUT 200 s, LC_TIMEOUT 120 s)
# fit one 10-minute device call. BENCH_ARGS adds kernel benchmark flags (BENCH_ARGS=--quick:
# 64K-256K only); LC_PRESET (qwen2.5-vl-7b: 28 query / 4 KV heads), LC_TOKENS (500000);
# TEST_WORKERS (8: pytest-xdist processes, where it is installed; they share the GPU);
# LC_LAYERS (1; 'all': the preset's).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check_out}
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3
mkdir -p "$OUT"
unset TRITON_INTERPRET MMTIER_TEST_DEVICE
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

{
    date -u +%FT%TZ
    nvidia-smi 2>&1 || echo "nvidia-smi failed"
    "$PY" - <<'EOF2'
import sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
print("cuda available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF2
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 0. the cache's pure dependencies, when their wheels were sent along. A wheel is a zip of what
# goes on the path: extracting needs no pip and no network.
if [[ -d .gpu-wheels ]]; then
    DEPS=$(mktemp -d)
    if "$PY" -c "import glob, sys, zipfile
for w in sorted(glob.glob('.gpu-wheels/*.whl')):
    zipfile.ZipFile(w).extractall(sys.argv[1])" "$DEPS" >>"$OUT/env.txt" 2>&1; then
        export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "unpacking .gpu-wheels failed (see env.txt)"
    fi
fi

# `import mmtier` loads the whole cache (pydantic, pyarrow, ...); the kernels need only torch
# and triton. If the full package does not import here, a shim package whose __path__ is the
# real mmtier/ directory stands in, so that only the modules the kernels use are loaded.
SHIM=""
if ! "$PY" -c "import mmtier" >/dev/null 2>&1; then
    SHIM=$(mktemp -d)
    mkdir -p "$SHIM/mmtier"
    printf '__path__ = [%s]\n' "'$ROOT/mmtier'" > "$SHIM/mmtier/__init__.py"
    echo "mmtier's dependencies are missing here: kernels loaded through a shim package"
fi
export PYTHONPATH="${SHIM:+$SHIM:}$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# 1. tests. With pytest when it is installed (the kernel tests, and the cache suite on CUDA when
# the whole cache imports), else a minimal runner that understands the few pytest features
# the kernel tests use (parametrize, skipif, raises, skip).
TEST_TIMEOUT=${TEST_TIMEOUT:-240}
TESTS=(tests/test_kernels_triton.py)
if [[ -z $SHIM ]]; then
    TESTS+=(tests/test_cache.py tests/test_cache_tiers.py tests/test_model_e2e.py)
else
    echo "the cache suite is skipped: mmtier does not import here (send .gpu-wheels)" | tee "$OUT/tests.txt"
fi
if "$PY" -c "import pytest" >/dev/null 2>&1; then
    XDIST=()
    if "$PY" -c "import xdist" >/dev/null 2>&1 && [[ ${TEST_WORKERS:-8} -gt 1 ]]; then
        XDIST=(-n "${TEST_WORKERS:-8}")       # compiles in parallel; the tests share the GPU
    fi
    timeout "$TEST_TIMEOUT" "$PY" -m pytest "${TESTS[@]}" "${XDIST[@]}" -q -rs -p no:cacheprovider \
        -o addopts="" --junitxml="$OUT/tests.xml" 2>&1 | tee -a "$OUT/tests.txt"
    rc_tests=${PIPESTATUS[0]}
else
    RUNNER=$(mktemp -d)
    cat > "$RUNNER/pytest.py" <<'EOF'
"""A stand-in for the few pytest features tests/test_kernels_triton.py uses."""
import contextlib
import re


class _Skip(Exception):
    pass


class _SkipIf:
    def __init__(self, cond, reason=""):
        self.cond, self.reason = cond, reason

    def __call__(self, fn):
        fn.__dict__.setdefault("_skips", []).append(self)
        return fn


class _Mark:
    def parametrize(self, names, values):
        def deco(fn):
            fn.__dict__.setdefault("_params", []).insert(0, ([n.strip() for n in names.split(",")], values))
            return fn
        return deco

    def skipif(self, cond, reason=""):
        return _SkipIf(cond, reason)

    def __getattr__(self, name):  # slow, ... : labels only
        return lambda fn: fn


mark = _Mark()


def skip(reason=""):
    raise _Skip(reason)


@contextlib.contextmanager
def raises(exc, match=None):
    try:
        yield
    except exc as e:
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"{e!r} does not match {match!r}") from e
        return
    raise AssertionError(f"DID NOT RAISE {exc}")
EOF
    cat > "$RUNNER/run_tests.py" <<'EOF'
import importlib
import itertools
import sys
import time
import traceback

import pytest

mod = importlib.import_module("tests.test_kernels_triton")
passed = failed = skipped = 0
t0 = time.time()
module_skip = getattr(mod, "pytestmark", None)
for name in [n for n in dir(mod) if n.startswith("test_")]:
    fn = getattr(mod, name)
    grids = getattr(fn, "_params", [])
    combos = itertools.product(*[[dict(zip(names, v if len(names) > 1 else (v,))) for v in vals]
                                 for names, vals in grids]) if grids else [()]
    for combo in combos:
        kwargs = {k: v for d in combo for k, v in d.items()}
        label = f"{name}[{'-'.join(map(str, kwargs.values()))}]" if kwargs else name
        skips = [s for s in getattr(fn, "_skips", []) + ([module_skip] if module_skip else [])
                 if s.cond]
        if skips:
            skipped += 1
            print(f"SKIPPED {label}: {skips[0].reason}")
            continue
        try:
            fn(**kwargs)
        except pytest._Skip as e:
            skipped += 1
            print(f"SKIPPED {label}: {e}")
        except Exception:
            failed += 1
            print(f"FAILED {label}\n{traceback.format_exc()}")
        else:
            passed += 1
            print(f"PASSED {label}")
        sys.stdout.flush()
print(f"{passed} passed, {failed} failed, {skipped} skipped in {time.time() - t0:.1f}s")
sys.exit(1 if failed else 0)
EOF
    timeout "$TEST_TIMEOUT" env PYTHONPATH="$RUNNER:$PYTHONPATH" "$PY" "$RUNNER/run_tests.py" 2>&1 \
        | tee "$OUT/tests.txt"
    rc_tests=${PIPESTATUS[0]}
fi

# 2. the kernel benchmark (writes benchmarks/results/kernels.json; copied to $OUT)
BENCH_TIMEOUT=${BENCH_TIMEOUT:-200}
STAMP=$(mktemp)             # results older than this are the checkout's, not this run's
# shellcheck disable=SC2086
timeout "$BENCH_TIMEOUT" "$PY" -m benchmarks.kernels --device cuda ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.txt"
rc_bench=${PIPESTATUS[0]}
fresh() { [[ -f $1 && $1 -nt $STAMP ]]; }
if fresh benchmarks/results/kernels.json; then cp -f benchmarks/results/kernels.json "$OUT/kernels.json"; fi

# 3. the long-context benchmark on CUDA at a real preset (needs the whole cache)
rc_lc=0
if [[ -z $SHIM ]]; then
    timeout "${LC_TIMEOUT:-120}" "$PY" -m benchmarks.long_context --device cuda \
        --preset "${LC_PRESET:-qwen2.5-vl-7b}" --tokens "${LC_TOKENS:-500000}" --layers "${LC_LAYERS:-1}" 2>&1 \
        | tee "$OUT/long_context.txt"
    rc_lc=${PIPESTATUS[0]}
    if fresh benchmarks/results/long_context.json; then
        cp -f benchmarks/results/long_context.json "$OUT/long_context.json"
    fi
else
    rc_lc=skipped
    echo "mmtier does not import here: long-context step skipped (run benchmarks/gpu_wheels.sh, carry .gpu-wheels)" \
        | tee "$OUT/long_context.txt"
fi

echo "tests: rc=$rc_tests  benchmark: rc=$rc_bench  long_context: rc=$rc_lc"   # also in summary.json
"$PY" - "$OUT" "$rc_tests" "$rc_bench" "$rc_lc" <<'EOF2'
"""summary.json: each step's exit code, the test counts (junit), the headline figures."""
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, rc_tests, rc_bench, rc_lc = Path(sys.argv[1]), *sys.argv[2:]
summary = {"rc": {"tests": rc_tests, "kernels": rc_bench, "long_context": rc_lc}}
try:
    root = ET.parse(out / "tests.xml").getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    summary["tests"] = {k: sum(int(s.get(k, 0)) for s in suites)
                        for k in ("tests", "failures", "errors", "skipped")}
except (OSError, ET.ParseError) as e:
    summary["tests"] = f"no junit report: {e}"
for name, keys in (("kernels", ("gpu_name", "gpu_paged_over_contiguous", "gpu_bandwidth_fraction",
                                "gpu_plan_us", "gpu_copy_bandwidth_gbs", "gpu_sdpa_backend")),
                   ("long_context", ("preset", "tokens", "device", "decode_over_floor", "decode_s"))):
    try:
        figures = json.loads((out / f"{name}.json").read_text())
        summary[name] = {k: figures.get(k) for k in keys}
    except (OSError, ValueError) as e:
        summary[name] = f"no results: {e}"
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF2
[[ $rc_tests == 0 && $rc_bench == 0 && ( $rc_lc == 0 || $rc_lc == skipped ) ]]
