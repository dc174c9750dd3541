#!/usr/bin/env bash
# Install omnishm and its test extras into the current Python environment.
#
# torch: an already installed torch (for example vLLM's) is kept as it is. Only
# when none is importable do we ask for the CPU build 2.13.0 explicitly, because
# an unpinned `torch` (and on Linux PyPI's `torch==2.13.0` too) is a CUDA build of
# several GB: PyTorch's CPU index is added (its `2.13.0+cpu` sorts first), and
# where it cannot be reached pip goes on with the configured indexes after a warning.
# OMNISHM_TORCH_INDEX overrides that index (e.g. an internal mirror).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q --retries 1 --timeout 15 "torch==2.13.0" \
    --extra-index-url "${OMNISHM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
fi
"$PY" -m pip install -q -e ".[test]"
# vllm-omni's own prefix cache is the comparison arm of `omnishm bench` (figures 3 and 6) and the
# oracle of tests/test_vllm_omni_oracle.py. Only its prefix-cache package is loaded, which imports no
# vllm, so it goes in without its dependencies, and only where no vllm-omni is installed (yours stays).
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm_omni') is None)"; then
  "$PY" -m pip install -q --no-deps "vllm-omni==0.30.0"
fi
