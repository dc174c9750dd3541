#!/usr/bin/env bash
# Install everything and run the test suite (what CI runs first).
#   scripts/test.sh            the main suite (real committer processes, real shm, real ZeroMQ)
#   scripts/test.sh -k NAME    extra arguments go to pytest
#   scripts/test.sh -n 0       serially (by default two pytest-xdist workers, one file each at a time: the suite
#                              mostly waits on its committer processes, so two halve its time on two cores)
#   PYTHON=python3.12 ...      the interpreter to install into and test with (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
bash scripts/install.sh
# --max-worker-restart 0: a worker the suite's hang watchdog ended (tests/conftest.py, HANG_LIMIT_S) is not
# replaced, so its hung test is not run again for another limit: the run ends, red, with its stacks printed.
"$PY" -m pytest -q -m "not vllm" -p no:cacheprovider -n 2 --dist loadfile --max-worker-restart 0 tests "$@"
# The demo in a runtime dir of its own, removed after it, failed or not (the demo itself fails on a segment or a
# runtime file of its cache left behind: its "leaked segments" row).
demo_dir="$(mktemp -d -t omnishm-demo-XXXXXX)"
rc=0
OMNISHM_RUNTIME_DIR="$demo_dir" "$PY" -m omnishm demo --tp 2 --steps 200 || rc=$?
rm -rf "$demo_dir"
exit "$rc"
