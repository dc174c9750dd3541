#!/usr/bin/env bash
# The prepared GPU check (2 minutes on an H200 machine, 2026-12-04; SUITE=1 adds about 8): everything that
# needs a CUDA device, in one run.
#   1. the CUDA tests: pinned shared staging, cudaHostRegister, device-order fakes, and the randomized
#      contract test with the outputs on the device (live buffers clobbered after every save);
#   2. scripts/gpu_bench.py: device-to-host GB/s of the whole-step staging copy into registered shared
#      memory next to a plain pinned copy_ of the same bytes;
#   3. `omnishm demo --tp 2 --device cuda`: a writer and a reader process saving from the device;
#   4. `omnishm bench --only 2,3,6` with figures 3 and 6's outputs on the device (figure 2 reads host memory
#      either way), figure 6 on the device again with omnishm's helper threads under SCHED_BATCH
#      (helper_sched = batch: set it against bench_cuda's figure 6), then figures 3 and 6 on the CPU, on the
#      same machine (JSON beside the logs), and a cProfile of figure 3's engine step on the device;
#   5. with SUITE=1, the main test suite on a host where torch sees a CUDA device (its outputs stay on the CPU),
#      stopped after SUITE_TIMEOUT_S seconds (default 600).
# Usage: bash scripts/gpu_check.sh [OUTDIR]   (OUTDIR gets the logs and the bench JSON)
# Needs torch with CUDA, pyzmq, msgspec, posix_ipc and pytest; omnishm is taken from this checkout.
# OMNI_SITE: a folder holding vllm-omni (pip install --target), added to the benchmarks' and suite's path, so that
# figures 3 and 6 also run vllm-omni's own cache (its CUDA mode) and omnishm behind the drop-in. Should the
# device run fail (that arm or any other), figures 3 and 6 on the device run again without vllm-omni; the
# failure still fails the check. The CPU run has no such second try.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-/tmp/omnishm-gpu-check}}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=()
before=$(ls /dev/shm | grep '^omnishm' | sort || true)  # a shared host may hold other users' caches
step() {  # step NAME CMD...: run, log to OUTDIR/NAME.log, remember a failure and go on
    local name=$1; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$OUTDIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $((SECONDS - t0))s"
    [ "$rc" -eq 0 ] || failed+=("$name")
}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name(), 'cuda', torch.version.cuda)" || exit 2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
step tests "$PY" -m pytest -q -p no:cacheprovider -s tests/test_cuda.py tests/test_device_order.py \
    tests/test_result_pool.py tests/test_manager_random.py
step staging "$PY" scripts/gpu_bench.py
step demo "$PY" -m omnishm demo --tp 2 --steps 200 --device cuda --name gpucheck
bench() {  # bench NAME FIGURES EXTRA_PATH [ARGS...]: omnishm bench --json into OUTDIR/NAME.json, then its table
    local name=$1 figures=$2 extra=$3; shift 3
    step "$name" env PYTHONPATH="$PYTHONPATH${extra:+:$extra}" sh -c "'$PY' -m omnishm bench --only $figures $* \
--json > '$OUTDIR/$name.json'; rc=\$?; '$PY' scripts/bench_table.py '$OUTDIR/$name.json'; exit \$rc"
}
bench bench_cuda 2,3,6 "${OMNI_SITE:-}" --device cuda
if [ -n "${OMNI_SITE:-}" ] && [[ " ${failed[*]} " == *" bench_cuda "* ]]; then
    bench bench_cuda_plain 3,6 "" --device cuda
fi
export OMNISHM_HELPER_SCHED=batch  # docs/DESIGN-NOTES.md, "omnishm's threads can run under SCHED_BATCH"
bench bench_cuda_batch 6 "" --device cuda
unset OMNISHM_HELPER_SCHED
step profile "$PY" scripts/profile_engine.py --device cuda --steps 20 --top 30
bench bench_cpu 3,6 "${OMNI_SITE:-}"
if [ "${SUITE:-0}" = 1 ]; then
    step suite timeout "${SUITE_TIMEOUT_S:-600}" env PYTHONPATH="$PYTHONPATH${OMNI_SITE:+:$OMNI_SITE}" \
        "$PY" -m pytest -q -m "not vllm" -p no:cacheprovider tests
fi
leftover=$(comm -13 <(echo "$before") <(ls /dev/shm | grep '^omnishm' | sort || true) | grep -c . || true)
echo "omnishm segments this check left in /dev/shm: $leftover"
[ "$leftover" -eq 0 ] || failed+=(leaks)
if [ ${#failed[@]} -ne 0 ]; then
    echo "GPU CHECK FAILED: ${failed[*]}"
    exit 1
fi
echo "GPU CHECK OK"
