#!/usr/bin/env bash
# Kernel checks for a GPU machine (plain `python`: 3.12, torch, triton; no Ray, no venv).
#   1. the Triton kernel tests, compiled on CUDA (TRITON_INTERPRET unset; the tests pick CUDA);
#   2. `python -m benchmarks.kernels --device cuda` (paged vs contiguous SDPA, bandwidth);
#   3. when .gpu-wheels/ came along (benchmarks/gpu_wheels.sh, sent with `carry`): the cache's
#      missing dependencies unpacked into a scratch directory, then `python -m
#      benchmarks.long_context --device cuda --preset $LC_PRESET --tokens $LC_TOKENS --layers
#      $LC_LAYERS` (LC_LAYERS of a real model's shape per decode step, across GPU, host and NVMe).
# Everything lands under $OUT (default ./gpu_check_out): env.txt, tests.txt (+ tests.xml with
# pytest), bench.txt, kernels.json, long_context.txt/.json, status.txt. Exit status: non-zero if
# a step that ran failed. BENCH_ARGS adds kernel benchmark flags (e.g. BENCH_ARGS=--quick);
# TEST_TIMEOUT / BENCH_TIMEOUT / LC_TIMEOUT in s; LC_PRESET (llama-3-8b), LC_TOKENS (2000000;
# 'max': what the disk holds), LC_LAYERS (1; 'all': the preset's).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check_out}
PY=${PYTHON:-python}
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONDONTWRITEBYTECODE=1

{
    date -u +%FT%TZ
    nvidia-smi 2>&1 || echo "nvidia-smi failed"
    "$PY" - <<'EOF'
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
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

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

# 1. tests. With pytest when it is installed, else a minimal runner that understands the few
# pytest features the kernel tests use (parametrize, skipif, raises, skip).
TEST_TIMEOUT=${TEST_TIMEOUT:-360}
if "$PY" -c "import pytest" >/dev/null 2>&1; then
    timeout "$TEST_TIMEOUT" "$PY" -m pytest tests/test_kernels_triton.py -q -rs --noconftest \
        -p no:cacheprovider -o addopts="" --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.txt"
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

# 2. benchmark (writes benchmarks/results/kernels.json; copied to $OUT)
BENCH_TIMEOUT=${BENCH_TIMEOUT:-420}
# shellcheck disable=SC2086
timeout "$BENCH_TIMEOUT" "$PY" -m benchmarks.kernels --device cuda ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.txt"
rc_bench=${PIPESTATUS[0]}
cp -f benchmarks/results/kernels.json "$OUT/kernels.json" 2>/dev/null || true

# 3. the long-context benchmark on CUDA, when the cache's wheels were sent along
rc_lc=0
if [[ -d .gpu-wheels ]]; then
    DEPS=$(mktemp -d)
    # a wheel is a zip of what goes on the path: extracting needs no pip and no network
    if "$PY" -c "import glob, sys, zipfile
for w in sorted(glob.glob('.gpu-wheels/*.whl')):
    zipfile.ZipFile(w).extractall(sys.argv[1])
import importlib; sys.path.insert(0, sys.argv[1])
for m in ('pydantic', 'xxhash', 'yaml', 'tqdm', 'click'):
    importlib.import_module(m)" "$DEPS" >"$OUT/long_context.txt" 2>&1; then
        timeout "${LC_TIMEOUT:-420}" env PYTHONPATH="$DEPS:$ROOT" "$PY" -m benchmarks.long_context \
            --device cuda --preset "${LC_PRESET:-llama-3-8b}" --tokens "${LC_TOKENS:-2000000}" --layers "${LC_LAYERS:-1}" 2>&1 \
            | tee -a "$OUT/long_context.txt"
        rc_lc=${PIPESTATUS[0]}
        cp -f benchmarks/results/long_context.json "$OUT/long_context.json" 2>/dev/null || true
    else
        rc_lc=1
        echo "unpacking the cache's wheels failed (see long_context.txt)"
    fi
else
    echo "no .gpu-wheels/: long-context step skipped (run benchmarks/gpu_wheels.sh and carry it)" \
        | tee "$OUT/long_context.txt"
fi

echo "tests: rc=$rc_tests  benchmark: rc=$rc_bench  long_context: rc=$rc_lc" | tee "$OUT/status.txt"
[[ $rc_tests == 0 && $rc_bench == 0 && $rc_lc == 0 ]]
