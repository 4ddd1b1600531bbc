#!/usr/bin/env bash
# Creates the peers environment for benchmarks/peers/peer_lmcache.py: a venv of its own with LMCache
# from PyPI (and the CPU build of torch it runs on here), apart from mmtier's venv, so the
# comparison runs each system in the environment it ships with. LMCache pulls cupy and CUDA
# python packages; they import on a machine without a GPU, and the benchmark drives LMCache's
# CPU and disk backends and its engine with a small CPU connector of its own.
#   benchmarks/peers/peers_env.sh [PEERS_VENV]      (default: .venv-lmcache)
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=${1:-.venv-lmcache}
PY=${PYTHON:-python3}
CPU_TORCH=${MMTIER_CPU_TORCH:-torch==2.13.0}
PEER_PKGS=(lmcache==0.5.6)

if [[ ! -x $PEERS/bin/python ]]; then
    "$PY" -m venv "$PEERS"
fi
"$PEERS/bin/python" -m pip install -q --upgrade pip
# the CPU build of torch first (a local wheel when the machine has one, else PyTorch's CPU index),
# so that LMCache's own `torch` requirement installs nothing more
if ! "$PEERS/bin/python" -m pip install -q --no-deps --no-index "$CPU_TORCH" 2>/dev/null; then
    "$PEERS/bin/python" -m pip install -q "$CPU_TORCH" --extra-index-url https://download.pytorch.org/whl/cpu
fi
"$PEERS/bin/python" -m pip install -q "$CPU_TORCH" "${PEER_PKGS[@]}"
"$PEERS/bin/python" - <<'PY'
import lmcache, torch
from lmcache.v1.cache_engine import LMCacheEngine  # noqa: F401
print(f"[peers] ready: lmcache {lmcache.__version__ if hasattr(lmcache, '__version__') else '?'}, torch {torch.__version__}")
PY
