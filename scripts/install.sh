#!/usr/bin/env bash
# Install omnishm and its test extras into the current Python environment.
#
# torch: an already installed torch (for example vLLM's) is kept as it is. Only
# when none is importable do we ask for the CPU build 2.13.0 explicitly, because
# an unpinned `torch` would pull a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
