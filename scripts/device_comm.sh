#!/usr/bin/env bash
# GPU run for the comm issue (docs/comm.md): builds the committed tree (HEAD) for sm_90a with the carried
# .deps bundle, runs the multi-rank C++ tests (CPU and [gpu]) and the Python comm/fault tests on 2 and
# 4 GPUs, then the collectives benchmark against raw NCCL. Results go to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=/opt/torch/.venv/bin/python3; [ -x "$PY" ] || PY=python3
nvidia-smi -L
src=/tmp/mc-src; rm -rf "$src"; mkdir -p "$src"
if git rev-parse HEAD >/dev/null 2>&1; then git archive HEAD | tar -x -C "$src"; else cp -r . "$src"; fi
cp -r .deps "$src/"
cd "$src"
source scripts/install_deps.sh; set +euo pipefail
B=/tmp/mc-comm-build
cmake -S . -B $B -G Ninja -DMEGACORE_BUILD_PYTHON=ON -DPython_EXECUTABLE=$PY -DCMAKE_CUDA_ARCHITECTURES=90a > $OUT/configure.log 2>&1 || { tail -30 $OUT/configure.log; exit 1; }
cmake --build $B -j16 > $OUT/build.log 2>&1 || { grep -E "error" $OUT/build.log | head -30; exit 1; }
ngpu=$(nvidia-smi -L | wc -l)
rc=0
for np in 2 4; do
  [ $np -le $ngpu ] || continue
  echo "== mpirun -np $np megacore_mpi_tests (all, incl. [gpu])"
  mpirun --oversubscribe -np $np $B/tests/megacore_mpi_tests 2>&1 | tail -4 || rc=1
done
echo "== pytest comm (CPU ranks + all $ngpu GPUs)"
PYTHONPATH=$B/python $PY -m pytest -v -rs tests/python/test_comm.py tests/python/test_comm_faults.py 2>&1 | tail -15 || rc=1
for np in 2 4; do
  [ $np -le $ngpu ] || continue
  echo "== collectives benchmark, $np GPUs"
  mpirun -np $np --bind-to none $B/benchmarks/megacore_bench_collectives --out $OUT/collectives_${np}gpu.json 2>&1 | grep -vE "^$" | tail -70
done
exit $rc
