#!/usr/bin/env bash
# GPU run of the pipeline bubble benchmark (one GPU per rank, NCCL point-to-point): builds the working tree
# for sm_90a with the carried .deps bundle (cuDNN off), then runs megacore_bench_pipeline with PP = every GPU,
# VP 1 and 2. Logs and JSON go to $OUT.
#   device run: bash benchmarks/pipeline/device_pipeline.sh   (carry [".deps"], kind nvidia-h100-x4)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_DEBUG=WARN
src=/tmp/mc-src; rm -rf $src; mkdir -p $src; cp -r . $src; cd $src
source scripts/install_deps.sh; set +euo pipefail
B=/tmp/b; t0=$(date +%s)
cmake -S . -B $B -G Ninja -DMEGACORE_BUILD_BENCHMARKS=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DMEGACORE_CUDNN=OFF > $OUT/configure.log 2>&1
cmake --build $B -j$(nproc) --target megacore_bench_pipeline > $OUT/build.log 2>&1 || { grep -B2 -A6 error $OUT/build.log | head -40; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"; nvidia-smi -L
ngpu=$(nvidia-smi -L | wc -l)
for vp in ${VPS:-1 2}; do
  timeout ${BENCH_TIMEOUT:-240} mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_pipeline --vp $vp ${BENCH_ARGS:-} \
    --out $OUT/pipeline_bubble_${ngpu}gpu_vp$vp.json > $OUT/bench_vp$vp.log 2>&1
  echo "bench vp $vp rc=$?"; grep -E "^PP|bench_pipeline|rror" $OUT/bench_vp$vp.log | head -20
done
