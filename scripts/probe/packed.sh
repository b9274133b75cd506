#!/usr/bin/env bash
# Device check of packed attention through cuDNN's ragged layout: the [attention][gpu] tests, test_ops,
# then the packed benchmark (cuDNN vs the flash kernel; BENCH=0 skips it).   device run: bash scripts/probe/packed.sh (carry .deps)
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
PY=/opt/torch/.venv/bin/python3
source scripts/install_deps.sh; set +euo pipefail
B=$PWD/.gpu-build; t0=$(date +%s)
cmake -S . -B $B -G Ninja -DMEGACORE_BUILD_PYTHON=ON -DPython_EXECUTABLE=$PY -DMEGACORE_BUILD_BENCHMARKS=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DMEGACORE_CUDNN=ON > $OUT/configure.log 2>&1
BENCH=${BENCH:-1}  # BENCH=0: tests only
targets="_C megacore_tests"; [ "$BENCH" = 1 ] && targets="$targets megacore_bench_kernels"
cmake --build $B -j$(nproc) --target $targets > $OUT/build.log 2>&1 || { grep -B2 -A8 error $OUT/build.log | head -60; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"; nvidia-smi -L
timeout 240 $B/tests/megacore_tests "[attention]" > $OUT/attn_tests.log 2>&1; echo "tests rc=$? ($(( $(date +%s) - t0 )) s)"
grep -E "test cases|assertions|All tests" $OUT/attn_tests.log | tail -3
grep -B6 -A22 "FAILED" $OUT/attn_tests.log | head -120
grep -iE "warn|skipped" $OUT/attn_tests.log | sort | uniq -c | head -10
PYTHONPATH=$B/python timeout 60 $PY -m pytest -q tests/python/test_ops.py 2>&1 | tail -2
if [ "$BENCH" = 1 ]; then
  left=$(( 570 - ($(date +%s) - t0) ))
  timeout $left $B/benchmarks/megacore_bench_kernels --filter attention_packed --out $OUT/attention_packed.json \
    > $OUT/bench.log 2>&1; echo "bench rc=$?"; grep -vE "^\s*$" $OUT/bench.log | tail -14
fi
echo "done at $(( $(date +%s) - t0 )) s"
