#!/usr/bin/env bash
# Pipeline-bubble benchmark on a GPU host (one GPU per rank, NCCL point-to-point): builds a copy of the tree
# for sm_90a (cuDNN off; the .deps/ bundle is used when present), then runs megacore_bench_pipeline with
# PP = every GPU, VP 1 and 2.
#   OUT_DIR  logs and JSON (default gpu-results/ in the tree); VPS (default "1 2"); BENCH_ARGS extra
#            benchmark flags; BENCH_TIMEOUT seconds per run (default 240)
# Usage: bash benchmarks/pipeline/device_pipeline.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
OUT_DIR=$(mkdir -p "${OUT_DIR:-$root/gpu-results}" && cd "${OUT_DIR:-$root/gpu-results}" && pwd)
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_DEBUG=WARN
src=/tmp/mc-src; rm -rf $src; mkdir -p $src; cp -r . $src; cd $src
source scripts/install_deps.sh; set +euo pipefail
B=/tmp/b; t0=$(date +%s)
cmake -S . -B $B -G Ninja -DMEGACORE_BUILD_BENCHMARKS=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DMEGACORE_CUDNN=OFF > $OUT_DIR/configure.log 2>&1
cmake --build $B -j$(nproc) --target megacore_bench_pipeline > $OUT_DIR/build.log 2>&1 || { grep -B2 -A6 error $OUT_DIR/build.log | head -40; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"; nvidia-smi -L
ngpu=$(nvidia-smi -L | wc -l)
for vp in ${VPS:-1 2}; do
  timeout ${BENCH_TIMEOUT:-240} mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_pipeline --vp $vp ${BENCH_ARGS:-} \
    --out $OUT_DIR/pipeline_bubble_${ngpu}gpu_vp$vp.json > $OUT_DIR/bench_vp$vp.log 2>&1
  echo "bench vp $vp rc=$?"; grep -E "^PP|bench_pipeline|rror" $OUT_DIR/bench_vp$vp.log | head -20
done
