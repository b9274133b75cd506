#!/usr/bin/env bash
# The MoE GPU benchmarks of issue 22 on one host with 4 GPUs, in order:
#   1. megacore_bench_moe_dispatch under mpirun: the EP all-to-all dispatcher vs raw NCCL all-to-all
#   2. bench_moe_e2e.py: a Mixtral-style model (~3.5B total parameters) trained with EP = 4 vs Hugging Face
#      MixtralForCausalLM on one GPU (eager and torch.compile); its --small smoke test runs first; then the
#      same model with forced balanced routing (--force-balance, megacore only: the peer cannot force it)
#   3. bench_grouped_peer.py: the expert GEMMs through megacore.ops against torch._grouped_mm on GPU 0 (the shapes of
#      the committed megacore_bench_moe JSON)
#   (TESTS=1) the tiny_moe EP 2 vs EP 1 GPU test of tests/python/test_moe_train.py
# Compact tables go to stdout, full logs to OUT_DIR/logs, JSON to OUT_DIR.
#
# Usage: bash benchmarks/moe/run_gpu.sh BUILD_DIR [OUT_DIR]
#   BUILD_DIR  a CMake build tree configured with CUDA, MPI and -DMEGACORE_BUILD_BENCHMARKS=ON
#              -DMEGACORE_BUILD_PYTHON=ON (the targets _C and megacore_bench_moe_dispatch are built here)
#   OUT_DIR    default benchmarks/results
#   env: NP (GPUs, default 4), PYTHON (default /opt/torch/.venv/bin/python3), TESTS=1, SKIP_FULL=1 (smoke only)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
[ $# -ge 1 ] && [ -d "$1" ] || { echo "usage: bash benchmarks/moe/run_gpu.sh BUILD_DIR [OUT_DIR] (BUILD_DIR must exist)"; exit 2; }
B=$(cd "$1" && pwd)
OUT=$(mkdir -p "${2:-$root/benchmarks/results}" && cd "${2:-$root/benchmarks/results}" && pwd)
LOGS=$OUT/logs; mkdir -p "$LOGS"
PY=${PYTHON:-/opt/torch/.venv/bin/python3}; [ -x "$PY" ] || PY=python3
NP=${NP:-4}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  PYTHONPATH=$B/python PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN MEGACORE_SOURCE_DIR=$root
cd "$root"
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$ngpu" -ge "$NP" ] || { echo "needs $NP GPUs, $ngpu visible (set NP)"; exit 2; }
nvidia-smi -L | head -"$NP"

echo "== build (_C megacore_bench_moe_dispatch) in $B"
cmake --build "$B" -j"$(nproc)" --target _C megacore_bench_moe_dispatch > "$LOGS/build.log" 2>&1 ||
  { grep -B2 -A8 -m5 -E "error|Error" "$LOGS/build.log" | head -60; echo "build failed (log: $LOGS/build.log)"; exit 1; }

rc=0
# Prints a step's table (the lines before its JSON) and remembers a failure.
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
         timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1; local r=$?
         echo "== $name: exit $r, $(( $(date +%s) - t )) s (log: $LOGS/$name.log)"
         sed -n '1,/^{/p' "$LOGS/$name.log" | grep -v '^{' | grep -vE '^\[rank|NCCL INFO' | head -40
         [ $r -eq 0 ] || { rc=1; grep -iE "error|what\(\)|out of memory" "$LOGS/$name.log" | head -5; }
         return $r; }

echo; echo "== 1. dispatcher all-to-all vs raw NCCL all-to-all (target: dispatcher >= 85% of raw, same splits)"
step moe_dispatch 600 mpirun -np "$NP" --bind-to none "$B/benchmarks/megacore_bench_moe_dispatch" --out-dir "$OUT"

echo; echo "== 2. end-to-end MoE training, EP = $NP (target: MFU by active parameters >= 35%)"
step moe_e2e_small 240 "$PY" benchmarks/moe/bench_moe_e2e.py --small --nproc "$NP" --python "$PY" --no-compile \
  --timeout 200
if [ -z "${SKIP_FULL:-}" ]; then
  step moe_e2e 3000 "$PY" benchmarks/moe/bench_moe_e2e.py --nproc "$NP" --python "$PY" --out-dir "$OUT" --timeout 900 --keep
  step moe_e2e_forced 1200 "$PY" benchmarks/moe/bench_moe_e2e.py --nproc "$NP" --python "$PY" --out-dir "$OUT" \
    --timeout 900 --no-peer --force-balance --keep
fi

echo; echo "== 3. expert GEMMs vs torch._grouped_mm (the peer's time over megacore's; one GPU)"
CUDA_VISIBLE_DEVICES=0 step moe_gemm_peer 600 "$PY" benchmarks/moe/bench_grouped_peer.py --out-dir "$OUT"

if [ -n "${TESTS:-}" ]; then
  echo; echo "== tiny_moe on 2 GPUs: EP 2 trains and matches EP 1"
  step moe_gpu_test 900 "$PY" -m pytest -q -rs -s tests/python/test_moe_train.py -k gpus
fi
echo; echo "JSON in $OUT, logs in $LOGS"
exit $rc
