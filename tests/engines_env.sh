#!/usr/bin/env bash
# Creates the optional engines environment for the connector tests: an overlay venv that sees
# mmtier's own venv (torch, ray, pyarrow, ...) through a .pth file and adds vLLM and SGLang
# WITHOUT their dependencies (no CUDA, never another torch), plus the few packages their
# connector / storage modules import. The tests skip, saying why, when it is absent.
#   tests/engines_env.sh [BASE_VENV] [ENGINES_VENV]      (defaults: .venv, .venv-engines)
# Then run the connector tests with ENGINES_VENV/bin/python -m pytest tests/test_vllm_*.py
# tests/test_sglang_backend.py. About 3.5 minutes on a busy 2-core machine (downloads ~60 MB of wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=$(cd "${1:-.venv}" && pwd)
ENG=${2:-.venv-engines}
PY=${PYTHON:-python3}
ENGINE_PKGS=(vllm==0.33.0 sglang==0.5.23)
# What vllm.distributed.{kv,ec}_transfer, vllm.v1.request and sglang's hicache_storage import.
IMPORT_PKGS=(apache-tvm-ffi==0.1.15.post2 cachetools==8.0.2 cbor2==6.3.0 cloudpickle==3.1.3
    ipython==9.18.1 llguidance==1.9.1 msgspec==0.23.0 openai==3.57.0 openai-harmony==0.0.8
    orjson==3.13.0 partial-json-parser==0.2.1.1.post7 psutil==7.2.2 py-cpuinfo==9.0.0
    pybase64==1.5.1 pyzmq==27.3.0 sniffio==1.3.1 traitlets==5.16.1 xgrammar==0.2.9)

if [[ ! -x $ENG/bin/python ]]; then
    "$PY" -m venv "$ENG"
fi
SITE=$("$ENG/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$SITE/mmtier-base.pth"
export VLLM_TARGET_DEVICE=cpu
"$ENG/bin/python" -m pip install -q --no-deps "${ENGINE_PKGS[@]}" "${IMPORT_PKGS[@]}"
"$ENG/bin/python" - <<'PY'
import importlib
for m in ("torch", "mmtier", "vllm.distributed.kv_transfer.kv_connector.factory",
          "vllm.distributed.ec_transfer.ec_connector.factory", "vllm.v1.request",
          "sglang.srt.mem_cache.storage.backend_factory"):
    importlib.import_module(m)
import torch
print(f"[engines] ready: torch {torch.__version__} from the base venv, vLLM and SGLang importable")
PY
