#!/usr/bin/env bash
# One prepared GPU check (about 2 minutes): the CUDA tests, then a device benchmark that prints the
# device-to-host GB/s of a whole-step staging copy into a registered shared-memory page next to a
# plain pinned copy_ of the same bytes. Run on a machine with a CUDA device:
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
"$PY" -m pip install -q --no-deps -e . 2>/dev/null || true
"$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_device_order.py
"$PY" scripts/gpu_bench.py
