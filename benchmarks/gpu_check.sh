#!/usr/bin/env bash
# One command for a GPU machine (plain `python`: 3.12, torch, triton, pyarrow, aiofiles, pytest;
# no Ray, no venv, no network). Everything runs compiled on CUDA (TRITON_INTERPRET unset):
#   0. when .gpu-wheels/ came along (benchmarks/gpu_wheels.sh here, then `carry: [".gpu-wheels"]`)
#      the cache's missing pure dependencies (pydantic, ...) are unpacked into a scratch
#      directory on PYTHONPATH, so the whole cache imports; without them only the kernels do
#      (through a shim package) and the steps that need the cache (1b, 3, 4) are skipped;
#   1. tests: (a) the Triton kernel tests (compiled, the GPU's own tile configuration); (b) the
#      cache suite with its pool on the GPU (tests/cache/test_cache.py, tests/cache/test_tiers.py,
#      tests/e2e/test_model.py, each test on the torch and the triton backend, and the test that an
#      attention call makes no host sync; tests/attention/kernels/test_fp8_pages.py: fp8 pages, the Triton kernel
#      over them compiled);
#   2. `python -m benchmarks.kernels.kernels --device cuda` (paged Triton vs SDPA's flash backend over the
#      same K/V made contiguous, fp16 and bf16, page sizes 16, 64, 256 and mixed, 64K-1M tokens);
#   3. `python -m benchmarks.engines.connector_copy --device cuda` (the vLLM connector's staged save /
#      load of whole blocks against a plain D2H / H2D copy of the same bytes);
#   4. `python -m benchmarks.kernels.long_context --device cuda --preset $LC_PRESET --tokens $LC_TOKENS`
#      (one layer of a real model's shape per decode step, across GPU, host and NVMe).
# Under $OUT (default ./gpu_check_out): log.txt (every step's output, the environment first),
# tests.xml (junit), kernels.json, connector_copy.json, long_context.json, summary.json (exit
# codes, test counts, headline figures): 6 files, within the 8 a device call brings back.
# Exit status: non-zero if a step that ran failed.
# Time: the steps' limits (TEST_TIMEOUT 210 s, BENCH_TIMEOUT 150 s, COPY_TIMEOUT 60 s,
# LC_TIMEOUT 120 s) fit one 10-minute device call. BENCH_ARGS adds kernel benchmark flags
# (BENCH_ARGS=--quick: 64K-256K only); LC_PRESET (qwen2.5-vl-7b: 28 query / 4 KV heads),
# LC_TOKENS (500000); TEST_WORKERS (8: pytest-xdist processes, where it is installed; they share
# the GPU); LC_LAYERS (1; 'all': the preset's).
# `benchmarks/gpu_check.sh --dry-run` (any machine, no GPU needed): checks that each step would
# start: the tests collect, each benchmark imports and takes its arguments (`--help` after
# them); it runs nothing, writes the same log.txt and summary.json.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check_out}
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3
DRY=0
if [[ ${1:-} == --dry-run ]]; then DRY=1; fi
mkdir -p "$OUT"
LOG=$OUT/log.txt
SCRATCH=$(mktemp -d)          # benchmarks write here (JSON, plots); only the JSON goes to $OUT
unset TRITON_INTERPRET MMTIER_TEST_DEVICE
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

{
    date -u +%FT%TZ
    if [[ $DRY == 1 ]]; then echo "dry run: each step's start is checked, nothing runs"; fi
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
try:
    import flash_attn
    print("flash_attn", flash_attn.__version__)
except ImportError:
    print("flash_attn not installed (the kernel benchmark compares SDPA's flash backend)")
print("cuda available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF2
} > "$LOG" 2>&1
cat "$LOG"

# step NAME TIMEOUT CMD...: run CMD (its output into log.txt), or in a dry run start it with
# `--help` after its arguments (imports, argument parsing); sets rc_NAME
step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*" | tee -a "$LOG"
    if [[ $DRY == 1 ]]; then
        timeout 120 "$@" --help >/dev/null 2>>"$LOG"
    else
        timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
        (exit "${PIPESTATUS[0]}")
    fi
    local rc=$?
    printf -v "rc_$name" '%s' "$rc"
    echo "=== $name: rc=$rc" | tee -a "$LOG"
}

# 0. the cache's pure dependencies, when their wheels were sent along. A wheel is a zip of what
# goes on the path: extracting needs no pip and no network.
if [[ -d .gpu-wheels ]]; then
    DEPS=$(mktemp -d)
    if "$PY" -c "import glob, sys, zipfile
for w in sorted(glob.glob('.gpu-wheels/*.whl')):
    zipfile.ZipFile(w).extractall(sys.argv[1])" "$DEPS" >>"$LOG" 2>&1; then
        export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "unpacking .gpu-wheels failed (see log.txt)" | tee -a "$LOG"
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
    echo "mmtier's dependencies are missing here: kernels loaded through a shim package" | tee -a "$LOG"
fi
export PYTHONPATH="${SHIM:+$SHIM:}$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# 1. tests. With pytest when it is installed (the kernel tests, and the cache suite on CUDA when
# the whole cache imports), else a minimal runner that understands the few pytest features
# the kernel tests use (parametrize, skipif, raises, skip).
TEST_TIMEOUT=${TEST_TIMEOUT:-210}
TESTS=(tests/attention/kernels/test_triton.py)
if [[ -z $SHIM ]]; then
    TESTS+=(tests/cache/test_cache.py tests/cache/test_tiers.py tests/e2e/test_model.py tests/attention/kernels/test_fp8_pages.py)
else
    echo "the cache suite is skipped: mmtier does not import here (send .gpu-wheels)" | tee -a "$LOG"
fi
if "$PY" -c "import pytest" >/dev/null 2>&1; then
    XDIST=()
    if "$PY" -c "import xdist" >/dev/null 2>&1 && [[ ${TEST_WORKERS:-8} -gt 1 ]]; then
        XDIST=(-n "${TEST_WORKERS:-8}")       # compiles in parallel; the tests share the GPU
    fi
    echo "=== tests: pytest ${TESTS[*]}" | tee -a "$LOG"
    if [[ $DRY == 1 ]]; then
        "$PY" -m pytest "${TESTS[@]}" --collect-only -q -p no:cacheprovider -o addopts="" 2>&1 | tail -3 | tee -a "$LOG"
    else
        timeout "$TEST_TIMEOUT" "$PY" -m pytest "${TESTS[@]}" "${XDIST[@]}" -q -rs -p no:cacheprovider \
            -o addopts="" --junitxml="$OUT/tests.xml" 2>&1 | tee -a "$LOG"
    fi
    rc_tests=${PIPESTATUS[0]}
    echo "=== tests: rc=$rc_tests" | tee -a "$LOG"
else
    RUNNER=$(mktemp -d)
    cat > "$RUNNER/pytest.py" <<'EOF'
"""A stand-in for the few pytest features tests/attention/kernels/test_triton.py uses."""
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

mod = importlib.import_module("tests.attention.kernels.test_triton")
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
    if [[ $DRY == 1 ]]; then       # the stand-in runner only imports the test module
        env PYTHONPATH="$RUNNER:$PYTHONPATH" "$PY" -c "import tests.attention.kernels.test_triton" 2>&1 | tee -a "$LOG"
    else
        timeout "$TEST_TIMEOUT" env PYTHONPATH="$RUNNER:$PYTHONPATH" "$PY" "$RUNNER/run_tests.py" 2>&1 \
            | tee -a "$LOG"
    fi
    rc_tests=${PIPESTATUS[0]}
fi

# 2.-4. the benchmarks, each writing its JSON into the scratch folder, copied to $OUT
# shellcheck disable=SC2086
step kernels "${BENCH_TIMEOUT:-150}" "$PY" -m benchmarks.kernels.kernels --device cuda --out "$SCRATCH" ${BENCH_ARGS:-}
rc_copy=skipped rc_lc=skipped
if [[ -z $SHIM ]]; then
    step copy "${COPY_TIMEOUT:-60}" "$PY" -m benchmarks.engines.connector_copy --device cuda --out "$SCRATCH"
    step lc "${LC_TIMEOUT:-120}" "$PY" -m benchmarks.kernels.long_context --device cuda \
        --preset "${LC_PRESET:-qwen2.5-vl-7b}" --tokens "${LC_TOKENS:-500000}" --layers "${LC_LAYERS:-1}" \
        --out "$SCRATCH"
else
    echo "mmtier does not import here: the connector and long-context steps are skipped" \
        "(run benchmarks/gpu_wheels.sh, carry .gpu-wheels)" | tee -a "$LOG"
fi
for name in kernels connector_copy long_context; do
    if [[ -f $SCRATCH/$name.json ]]; then cp -f "$SCRATCH/$name.json" "$OUT/$name.json"; fi
done

echo "tests: rc=$rc_tests  kernels: rc=$rc_kernels  connector_copy: rc=$rc_copy  long_context: rc=$rc_lc" \
    | tee -a "$LOG"      # also in summary.json
"$PY" - "$OUT" "$DRY" "$rc_tests" "$rc_kernels" "$rc_copy" "$rc_lc" <<'EOF2'
"""summary.json: each step's exit code, the test counts (junit), the headline figures."""
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, dry, rc_tests, rc_kernels, rc_copy, rc_lc = Path(sys.argv[1]), *sys.argv[2:]
summary = {"dry_run": dry == "1",
           "rc": {"tests": rc_tests, "kernels": rc_kernels, "connector_copy": rc_copy, "long_context": rc_lc}}
try:
    root = ET.parse(out / "tests.xml").getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    summary["tests"] = {k: sum(int(s.get(k, 0)) for s in suites)
                        for k in ("tests", "failures", "errors", "skipped")}
except (OSError, ET.ParseError) as e:
    summary["tests"] = f"no junit report: {e}"
for name, keys in (("kernels", ("gpu_name", "gpu_paged_over_contiguous", "gpu_bandwidth_fraction",
                                "gpu_plan_us", "gpu_copy_bandwidth_gbs", "gpu_sdpa_backend")),
                   ("connector_copy", ("save_over_plain_copy", "load_over_plain_copy")),
                   ("long_context", ("preset", "tokens", "device", "decode_over_floor", "decode_s"))):
    try:
        figures = json.loads((out / f"{name}.json").read_text())
        summary[name] = {k: figures.get(k) for k in keys}
    except (OSError, ValueError) as e:
        summary[name] = f"no results: {e}"
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF2
ok() { [[ $1 == 0 || $1 == skipped ]]; }
ok "$rc_tests" && ok "$rc_kernels" && ok "$rc_copy" && ok "$rc_lc"
