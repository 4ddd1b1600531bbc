#!/usr/bin/env bash
# Fetch, here (where PyPI is reachable), the wheels the cache needs beyond what the GPU machine
# has (it has torch, triton, pyarrow, aiofiles, numpy, nvidia-ml-py; no network), into
# .gpu-wheels/ (git-ignored). Send them with the device call (`carry: [".gpu-wheels"]`);
# benchmarks/gpu_check.sh installs them into a scratch directory and runs the long-context
# benchmark on CUDA. PYVER / PLATFORM pick the target interpreter (default: CPython 3.12, x86_64).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PLATFORM=${PLATFORM:-manylinux2014_x86_64}
PIP=${PIP:-.venv/bin/pip}
rm -rf .gpu-wheels
"$PIP" download --quiet --dest .gpu-wheels --only-binary=:all: --implementation cp \
    --python-version "$PYVER" --platform "$PLATFORM" --platform manylinux_2_17_x86_64 \
    "pydantic>=2.5,<3" "xxhash>=3" "PyYAML>=6" "tqdm>=4.60" "click>=8"
ls -1 .gpu-wheels
