#!/usr/bin/env bash
# Communication tests and benchmark on a GPU host with 2 or 4 GPUs (docs/gpu.md, docs/comm.md): builds a
# copy of the tree for sm_90a (cuDNN off: the attention path is not needed here and its headers take
# minutes to compile; the .deps/ bundle is used when present), runs the single-process [gpu] tests, the
# multi-rank NCCL tests under mpirun -np 2 and -np 4, the Python GPU comm/fault/DLPack tests, and the
# collectives benchmark against raw NCCL in both communicator modes.
#   OUT_DIR  logs and JSON (default gpu-results/ in the tree);  PYTHON  interpreter (default
#            /opt/torch/.venv/bin/python3 when present, else python3)
# Usage: bash scripts/device_comm.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=$(mkdir -p "${OUT_DIR:-$root/gpu-results}" && cd "${OUT_DIR:-$root/gpu-results}" && pwd)
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_DEBUG=WARN
PY=${PYTHON:-python3}; [ -z "${PYTHON:-}" ] && [ -x /opt/torch/.venv/bin/python3 ] && PY=/opt/torch/.venv/bin/python3
src=/tmp/mc-src; rm -rf $src; mkdir -p $src; cp -r . $src; cd $src
source scripts/install_deps.sh; set +euo pipefail
B=/tmp/b; t0=$(date +%s)
cmake -S . -B $B -G Ninja -DMEGACORE_BUILD_PYTHON=ON -DPython_EXECUTABLE=$PY -DCMAKE_CUDA_ARCHITECTURES=90a -DMEGACORE_CUDNN=OFF > $OUT_DIR/configure.log 2>&1
cmake --build $B -j$(nproc) --target megacore_tests megacore_mpi_tests _C megacore_bench_collectives > $OUT_DIR/build.log 2>&1 || { grep error $OUT_DIR/build.log | head; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"; nvidia-smi -L
timeout 60 $B/tests/megacore_tests "[gpu]" > $OUT_DIR/gpu_single.log 2>&1; echo "megacore_tests [gpu] rc=$?"; tail -2 $OUT_DIR/gpu_single.log
for np in 2 4; do
  [ $np -le $(nvidia-smi -L | wc -l) ] || continue
  timeout 100 mpirun -np $np $B/tests/megacore_mpi_tests "[gpu]" > $OUT_DIR/gpu_np$np.log 2>&1; echo "mpi [gpu] np$np rc=$?"; tail -2 $OUT_DIR/gpu_np$np.log
  grep -B3 -A12 "FAILED" $OUT_DIR/gpu_np$np.log | head -30
done
PYTHONPATH=$B/python timeout 150 $PY -m pytest -v -rs -k "gpu or dlpack" tests/python/test_comm.py tests/python/test_comm_faults.py tests/python/test_dlpack_torch.py > $OUT_DIR/pytest.log 2>&1; echo "pytest rc=$?"; grep -E "PASS|FAIL|SKIP|passed|failed" $OUT_DIR/pytest.log | head -20
ngpu=$(nvidia-smi -L | wc -l)
for mode in "" "--blocking"; do
  timeout 60 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_collectives $mode --iters 20 --out $OUT_DIR/collectives_${ngpu}gpu${mode:+_blocking}.json > $OUT_DIR/bench$ngpu$mode.log 2>&1; echo "bench $mode rc=$?"
  grep -E "^#| 8 | 1048576 | 67108864 | 1073741824 " $OUT_DIR/bench$ngpu$mode.log
done
