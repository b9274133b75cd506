#!/usr/bin/env bash
# Full test run on a GPU host (docs/gpu.md): scripts/test.sh built for sm_90a (C++ unit and [gpu] tests,
# MPI tests, Python tests incl. torch DLPack, the find_package install test, the pip-install check),
# then the quickstart example. Uses the .deps/ bundle when present (scripts/bundle_deps.sh).
#   OUT_DIR             logs (default gpu-results/ in the tree)
#   MEGACORE_BUILD_DIR  build folder (default /tmp/mc-build); CMAKE_ARGS extra configure flags
#   PYTHON              interpreter (default /opt/torch/.venv/bin/python3 when present, else python3)
# Usage: bash scripts/device_foundation.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=$(mkdir -p "${OUT_DIR:-$root/gpu-results}" && cd "${OUT_DIR:-$root/gpu-results}" && pwd)
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
[ -z "${PYTHON:-}" ] && [ -x /opt/torch/.venv/bin/python3 ] && export PYTHON=/opt/torch/.venv/bin/python3
export MEGACORE_BUILD_DIR=${MEGACORE_BUILD_DIR:-/tmp/mc-build} CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90a ${CMAKE_ARGS:-}"
scripts/test.sh 2>&1 | tee "$OUT_DIR/test.log" | grep -vE "^\[[0-9]+/[0-9]+\] "
rc=${PIPESTATUS[0]}
PYTHONPATH=$MEGACORE_BUILD_DIR/python ${PYTHON:-python3} examples/quickstart.py
exit $rc
