#!/usr/bin/env bash
# GPU run used for the foundation issue (see docs/gpu.md): builds for sm_90a with the carried .deps
# bundle and runs scripts/test.sh (C++ unit + [gpu] tests, MPI tests, Python tests incl. torch DLPack).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
[ -x /opt/torch/.venv/bin/python3 ] && export PYTHON=/opt/torch/.venv/bin/python3
export MEGACORE_BUILD_DIR=${MEGACORE_BUILD_DIR:-/tmp/mc-build} CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90a ${CMAKE_ARGS:-}"
scripts/test.sh 2>&1 | tee "${OUT:-/tmp}/test.log" | grep -vE "^\[[0-9]+/[0-9]+\] " 
rc=${PIPESTATUS[0]}
PYTHONPATH=$MEGACORE_BUILD_DIR/python ${PYTHON:-python3} examples/quickstart.py
exit $rc
