#!/usr/bin/env bash
# Install everything and run the test suite (what CI runs first).
#   scripts/test.sh            the main suite (real committer processes, real shm, real ZeroMQ)
#   OMNISHM_QUICK=0 ...        nothing is skipped either way; this only lengthens the bench/demo smoke runs
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
bash scripts/install.sh
"$PY" -m pytest -q -m "not vllm" -p no:cacheprovider tests "$@"
"$PY" -m omnishm demo --tp 2 --steps 200
