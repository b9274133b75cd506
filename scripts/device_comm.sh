#!/usr/bin/env bash
# The GPU run used for the comm issue on 2 and 4 GPUs (docs/gpu.md, docs/comm.md): builds the working tree
# for sm_90a with the carried .deps bundle (cuDNN off: the attention path is not needed here and its headers
# take minutes to compile), runs the single-process [gpu] tests, the multi-rank NCCL tests under mpirun -np 2
# and -np 4, the Python GPU comm/fault/DLPack tests, and the collectives benchmark against raw NCCL in both
# communicator modes. Logs and JSON go to $OUT.
#   device run: bash scripts/device_comm.sh   (carry [".deps"], kind nvidia-h100-x4)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_DEBUG=WARN
PY=/opt/torch/.venv/bin/python3
src=/tmp/mc-src; rm -rf $src; mkdir -p $src; cp -r . $src; cd $src
source scripts/install_deps.sh; set +euo pipefail
B=/tmp/b; t0=$(date +%s)
cmake -S . -B $B -G Ninja -DMEGACORE_BUILD_PYTHON=ON -DPython_EXECUTABLE=$PY -DCMAKE_CUDA_ARCHITECTURES=90a -DMEGACORE_CUDNN=OFF > $OUT/configure.log 2>&1
cmake --build $B -j64 --target megacore_tests megacore_mpi_tests _C megacore_bench_collectives > $OUT/build.log 2>&1 || { grep error $OUT/build.log | head; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"; nvidia-smi -L
timeout 60 $B/tests/megacore_tests "[gpu]" > $OUT/gpu_single.log 2>&1; echo "megacore_tests [gpu] rc=$?"; tail -2 $OUT/gpu_single.log
for np in 2 4; do
  [ $np -le $(nvidia-smi -L | wc -l) ] || continue
  timeout 100 mpirun -np $np $B/tests/megacore_mpi_tests "[gpu]" > $OUT/gpu_np$np.log 2>&1; echo "mpi [gpu] np$np rc=$?"; tail -2 $OUT/gpu_np$np.log
  grep -B3 -A12 "FAILED" $OUT/gpu_np$np.log | head -30
done
PYTHONPATH=$B/python timeout 150 $PY -m pytest -v -rs -k "gpu or dlpack" tests/python/test_comm.py tests/python/test_comm_faults.py tests/python/test_dlpack_torch.py > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; grep -E "PASS|FAIL|SKIP|passed|failed" $OUT/pytest.log | head -20
ngpu=$(nvidia-smi -L | wc -l)
for mode in "" "--blocking"; do
  timeout 60 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_collectives $mode --iters 20 --out $OUT/collectives_${ngpu}gpu${mode:+_blocking}.json > $OUT/bench$ngpu$mode.log 2>&1; echo "bench $mode rc=$?"
  grep -E "^#| 8 | 1048576 | 67108864 | 1073741824 " $OUT/bench$ngpu$mode.log
done
