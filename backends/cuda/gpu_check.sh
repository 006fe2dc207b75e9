#!/usr/bin/env bash
# Check the CUDA backend on a machine with a GPU, in one command:
#
#   backends/cuda/gpu_check.sh [TIME_LIMIT_SECONDS]     (default 1800)
#
# 1. builds (or finds in the cache) the CUDA library, printing the build time;
# 2. `statecache conformance --backend cuda --require-device`: every case must
#    pass, and a missing device is a failure, not a skip;
# 3. the GPU tests of backends/cuda/tests/test_cuda_gpu.py (needs the torch
#    extra with CUDA for the torch ones): torch CUDA tensors as arguments on
#    torch's current stream, and a 4-layer Mamba-2 decode step of a torch
#    runtime captured with torch.cuda.graph and replayed (same states and
#    outputs as eager steps, nothing allocated while capturing);
# 4. `statecache conformance --perf --backend cuda`: GB/s and the ratio to the
#    GPU's own device-to-device copy bandwidth for the benchmark shapes;
# 5. backends/cuda/nccl_loopback.py: a sequence transfer (send_sequence /
#    recv_sequence) between two processes over NCCL, CUDA memories on both
#    sides, rank r on GPU r, received states and rollbacks compared with the
#    sender's (needs 2 GPUs: NCCL refuses two ranks on one device; with one GPU
#    it runs the NCCL collectives in a group of one and says the transfer did
#    not run).
# All steps share the time limit; the script exits non-zero if any step fails
# or runs out of time (exit 124).  Set PYTHON to pick the interpreter (default:
# the checkout's .venv as the README creates it, else python3 on PATH).
set -uo pipefail

limit=${1:-1800}
root=$(cd "$(dirname "$0")/../.." && pwd)
default_python=python3
[ -x "$root/.venv/bin/python" ] && default_python="$root/.venv/bin/python"
python=${PYTHON:-$default_python}
deadline=$((SECONDS + limit))
status=0

step() {
    local left=$((deadline - SECONDS))
    if ((left <= 0)); then
        echo "== time limit of ${limit}s reached before: $*" >&2
        status=124
        return
    fi
    echo "== $* (time left: ${left}s)"
    timeout --kill-after=15 "$left" "$@"
    local rc=$?
    if ((rc != 0)); then
        echo "== failed with exit code $rc: $*" >&2
        if ((rc == 124 || rc == 137)); then status=124; elif ((status == 0)); then status=$rc; fi
    fi
}

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
step "$python" -m statecache.backends.cuda build
step "$python" -m statecache.cli conformance --backend cuda --require-device
step "$python" -m pytest -q -p no:cacheprovider -m cuda "$root/backends/cuda/tests/test_cuda_gpu.py"
step "$python" -m statecache.cli conformance --perf --backend cuda
step "$python" "$root/backends/cuda/nccl_loopback.py" --device cuda --timeout 300
echo "== gpu_check: exit $status"
exit $status
