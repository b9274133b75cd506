#!/usr/bin/env bash
# GPU validation and benchmarks on one Hopper host (docs/gpu.md): builds the tree for sm_90a into .gpu-build/
# (reused by the next run; cuDNN off unless CUDNN=ON, attention then uses megacore's flash kernel; the .deps/
# bundle is used when present), then runs the phases named in PHASE (comma-separated):
#   tests        single-GPU [gpu] tests, multi-rank [gpu] tests under mpirun -np 2 and 4 (NCCL collectives,
#                the watchdog, GPT model with TP/SP/overlap, ...), Python GPU tests (transformers logits,
#                DLPack with torch, the trainer on 1 and 4 GPUs, a killed rank ends the job)
#   collectives  megacore_bench_collectives (C++, vs raw NCCL) and bench_collectives.py (vs torch.distributed)
#   recipes      the llama32_1b recipe for 12 steps in DP4, TP2×DP2, PP2×DP2, TP2×PP2, checkpoint at the end
#   recipes_zero the llama32_1b recipe in DP4, plain and with ZeRO-1 + overlap_param_gather (same settings)
#   model        GPT model fwd+bwd: 1 GPU vs HF, then TP 2/4 ± SP ± tp_comm_overlap (± the SP forward overlap)
#   ddp          DDP and ZeRO-1 scaling vs torch DDP
#   pipeline     pipeline bubble, VP 1 and 2
#   ckpt         checkpoint save/load vs torch.save on 1 GPU and on every GPU
#   ddp2         more DDP/ZeRO variants: high-priority communication stream, 32 CTAs, ZeRO with bf16 reduction
#   ddp3         ZeRO with the param all-gather overlapped with forward; 4-micro-batch gradient accumulation
#   ddp4         GEMMs planned for fewer SMs beside the overlapped collective (--gemm-sm-margin) and NCCL's
#                CTA policies, for DDP and for ZeRO with the param all-gather overlapped; the ZeRO
#                overlap-param-gather parity test on GPUs
#   ddp5         ZeRO with the param all-gather overlapped (f32 and bf16 reduction), ZeRO without, DDP with bf16
#                reduction over 4 micro-batches (torch DDP reduces bf16 grads), at 1 and 4 micro-batches
#   ddp6         the DP comparison in one run: DDP, ZeRO + overlapped param gather (f32 and bf16
#                reduction), and torch DDP at 1 and 4 micro-batches
#   kernels      single-GPU [gpu] tests, torch peers (fused ops and SDPA), then megacore_bench_kernels
#                (launch-shape variants included; CUDNN=ON builds the cuDNN attention path; KFILTER=substrings,
#                comma-separated; TPEERS_ONLY=op prefixes for torch_peers.py --only; TORCH_PEERS=0 / ATTN_PEERS=0
#                skip the fused-op / SDPA peers; KTESTS=0 skips the tests)
#   cp           context parallelism: the [cp] tests (merge kernels, ring blocks on cuDNN and flash), the bf16 model at
#                CP = all GPUs over NCCL against the CPU model, the copy-engine transfers ([copy_engine]; the ring over
#                them bit-identical to NCCL's), the CP 2/4 trainer tests (parity with CP 1, copy engines on and off),
#                then megacore_bench_cp --copy-engine at CP = all GPUs (seq 32768 and 65536: NCCL's ring and the
#                copy engines' in the same rounds) and on 1 GPU (seq 8192 and 32768), and the torch
#                context_parallel peer on the same shapes (CUDNN=ON for cuDNN SDPA)
#   moe          the MoE ops' [moe] tests (CUDA kernels and the cuBLAS grouped GEMM against the CPU reference), then
#                megacore_bench_moe (grouped expert GEMMs vs a per-expert loop vs a dense GEMM of the same FLOPs),
#                megacore_bench_moe_dispatch (the EP all-to-all dispatcher vs raw NCCL all-to-all; the end-to-end
#                MoE training benchmark is benchmarks/moe/run_gpu.sh)
#   OUT_DIR   logs (OUT_DIR/<step>.log) and JSON results (OUT_DIR/json/), default gpu-results/ in the tree
#   PYTHON    interpreter (default /opt/torch/.venv/bin/python3 when present, else python3)
#   DEADLINE  seconds for the whole run (default 3600); each step is also cut to what is left of it
# Usage: PHASE=tests,collectives bash scripts/device_train.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=$(mkdir -p "${OUT_DIR:-$root/gpu-results}/json" && cd "${OUT_DIR:-$root/gpu-results}" && pwd)
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_DEBUG=WARN
PY=${PYTHON:-python3}; [ -z "${PYTHON:-}" ] && [ -x /opt/torch/.venv/bin/python3 ] && PY=/opt/torch/.venv/bin/python3
PHASE=${PHASE:-tests}
has() { [[ ",$PHASE," == *",$1,"* ]]; }
source scripts/install_deps.sh; set +euo pipefail
B=$PWD/.gpu-build; t0=$(date +%s)
cmake -S . -B $B -G Ninja -DMEGACORE_BUILD_PYTHON=ON -DPython_EXECUTABLE=$PY -DMEGACORE_BUILD_BENCHMARKS=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DMEGACORE_CUDNN=${CUDNN:-OFF} > $OUT_DIR/configure.log 2>&1
targets=${TARGETS:-"_C megacore_tests megacore_mpi_tests megacore_bench_model megacore_bench_training megacore_bench_pipeline megacore_bench_collectives"}
has kernels && targets="$targets megacore_bench_kernels"
has cp && targets="$targets megacore_bench_cp"
has moe && targets="$targets megacore_bench_moe megacore_bench_moe_dispatch"
cmake --build $B -j$(nproc) --target $targets > $OUT_DIR/build.log 2>&1 || { grep -B2 -A8 error $OUT_DIR/build.log | head -60; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s ($(grep -c Building $OUT_DIR/build.log) compiled)"; nvidia-smi -L | head -4
export PYTHONPATH=$B/python
ngpu=$(nvidia-smi -L | wc -l)
# Every step is cut to what is left of DEADLINE seconds (from the start), so a hang in one step leaves
# time for the others.
DEADLINE=${DEADLINE:-3600}; T_START=$t0
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); local left=$(( DEADLINE - (t - T_START) - 15 ));
         [ $left -lt $limit ] && limit=$left; if [ $limit -le 5 ]; then echo "== $name skipped (deadline)"; return 1; fi
         timeout $limit "$@" > $OUT_DIR/$name.log 2>&1; local rc=$?;
         echo "== $name rc=$rc ($(( $(date +%s) - t )) s)"; return $rc; }

if has tests; then
  step gpu_single 120 $B/tests/megacore_tests "[gpu]"; tail -2 $OUT_DIR/gpu_single.log
  for np in 2 4; do
    [ $np -le $ngpu ] || continue
    step gpu_mpi_np$np 240 mpirun -np $np --bind-to none $B/tests/megacore_mpi_tests "[gpu]"
    grep -E "\[gpu model\]|test cases|assertions" $OUT_DIR/gpu_mpi_np$np.log | sort -u | head -30
    grep -B4 -A14 "FAILED" $OUT_DIR/gpu_mpi_np$np.log | grep -v "^\[rank" | head -40
  done
  step pytest_gpu 300 $PY -m pytest -q -rs -s tests/python/test_convert_transformers.py tests/python/test_dlpack_torch.py \
    tests/python/test_train_gpu.py tests/python/test_comm_faults.py
  grep -E "passed|failed|Error" $OUT_DIR/pytest_gpu.log | tail -8
fi

if has collectives; then
  for np in 2 4 8; do
    [ $np -le $ngpu ] || continue
    step bench_coll_np$np 240 mpirun -np $np --bind-to none $B/benchmarks/megacore_bench_collectives \
      --out $OUT_DIR/json/collectives_${np}gpu_blocking.json
    grep -E "^all_reduce +(8|1048576|67108864|1073741824) |^(all_gather|reduce_scatter|all_to_all|broadcast) +(8|67108864) " \
      $OUT_DIR/bench_coll_np$np.log
  done
  step bench_coll_nb 120 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_collectives --non-blocking \
    --max-bytes 1M --ops all_reduce --out $OUT_DIR/json/collectives_${ngpu}gpu_nonblocking_small.json
  grep -E "^all_reduce +(8|1048576) " $OUT_DIR/bench_coll_nb.log
fi
if has collectives || has collectives_py; then
  step bench_coll_py 240 $PY -m megacore.launch --nproc-per-node $ngpu benchmarks/collectives/bench_collectives.py \
    --out $OUT_DIR/json/collectives_py_${ngpu}gpu.json
  grep -E "^(all_reduce|all_gather) +(8|67108864) " $OUT_DIR/bench_coll_py.log; tail -3 $OUT_DIR/bench_coll_py.log
fi

if has quick; then
  # A short check of a build on all GPUs: C++ collectives vs raw NCCL, the [gpu] multi-rank tests, one
  # pipeline-bubble measurement (VP 1).
  step bench_coll 60 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_collectives \
    --out $OUT_DIR/json/collectives_${ngpu}gpu_blocking.json
  grep -E "^[a-z_]+ +(8|67108864) " $OUT_DIR/bench_coll.log
  step gpu_mpi_np$ngpu 150 mpirun -np $ngpu --bind-to none $B/tests/megacore_mpi_tests "[gpu]"
  grep -E "test cases|assertions|All tests" $OUT_DIR/gpu_mpi_np$ngpu.log | sort -u | head -4
  grep -B4 -A14 "FAILED" $OUT_DIR/gpu_mpi_np$ngpu.log | grep -v "^\[rank" | head -30
  step bench_pipe_vp1 90 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_pipeline --vp 1 \
    --out $OUT_DIR/json/pipeline_bubble_${ngpu}gpu_vp1.json
  grep -E "^PP|bubble|rror" $OUT_DIR/bench_pipe_vp1.log | head -8
fi

if has recipes || has recipes_zero; then
  lays=("dp4:parallel.tp=1 parallel.pp=1" "tp2dp2:parallel.tp=2 parallel.pp=1" "pp2dp2:parallel.tp=1 parallel.pp=2"
        "tp2pp2:parallel.tp=2 parallel.pp=2")
  [ $ngpu -eq 2 ] && lays=("dp2:parallel.tp=1 parallel.pp=1" "tp2:parallel.tp=2 parallel.pp=1" "pp2:parallel.tp=1 parallel.pp=2")
  has recipes_zero && lays=("dp${ngpu}:parallel.tp=1 parallel.pp=1"
                            "dp${ngpu}_zero_pg:parallel.tp=1 parallel.pp=1 parallel.zero=true parallel.overlap_param_gather=true")
  for lay in "${lays[@]}"; do
    name=${lay%%:*}; sets=""; for s in ${lay#*:}; do sets="$sets --set $s"; done
    step recipe_$name 200 $PY -m megacore.cli train --recipe llama32_1b --nproc-per-node $ngpu $sets \
      --set data.paths=embedded --set data.tokenizer=byte --set data.global_batch_size=32 --set data.seq=2048 \
      --set data.mbs=2 --set trainer.max_steps=12 --set trainer.val_check_interval=0 --set optim.lr_warmup_iters=2 \
      --set checkpoint.save_dir=/tmp/ck/$name --set checkpoint.keep_last=1 --set logging.log_dir=$OUT_DIR/runs/$name \
      --set logging.tensorboard=false --set trainer.recompute=selective
    grep -E "^step (1|6|12)/|checkpoint" $OUT_DIR/recipe_$name.log | cut -c1-200; grep -iE "error" $OUT_DIR/recipe_$name.log | head -3
    rm -rf /tmp/ck/$name
    cp $OUT_DIR/runs/$name/metrics.jsonl $OUT_DIR/json/recipe_llama32_1b_$name.jsonl 2>/dev/null
  done
fi

if has model; then
  if [ -z "${MODEL_SKIP_1:-}" ]; then
    step bench_model 200 mpirun -np 1 --bind-to none $B/benchmarks/megacore_bench_model --out $OUT_DIR/json/model_1gpu.json
    grep -E "tokens_per_s\"|mfu" $OUT_DIR/bench_model.log | tr -s ' ' | tr '\n' ' '; echo
    step peer_model 200 $PY benchmarks/model/torch_llama_peer.py --out $OUT_DIR/json/model_peer.json
    grep -E "tokens_per_s" $OUT_DIR/peer_model.log
  fi
  for tp in 2 4; do [ $tp -le $ngpu ] || continue; for v in "" "--sequence-parallel" "--tp-comm-overlap" "--sequence-parallel --tp-comm-overlap" \
      "--sequence-parallel --tp-comm-overlap-forward" "--sequence-parallel --tp-comm-overlap --tp-comm-overlap-forward"; do
    tag=tp$tp$(echo "$v" | sed 's/--sequence-parallel/_sp/; s/--tp-comm-overlap-forward/_fwd/; s/--tp-comm-overlap/_overlap/; s/ //g')
    step bench_$tag 150 mpirun -np $tp --bind-to none $B/benchmarks/megacore_bench_model $v --out $OUT_DIR/json/model_$tag.json
    echo "$tag $(grep -E '"tokens_per_s"|"ms_per_step"' $OUT_DIR/bench_$tag.log | tr -s ' ' | tr '\n' ' ')"
  done; done
fi

if has ddp; then
  # DDP and ZeRO-1 with NCCL's own CTA choice and with the DP communicator capped at 8 / 16 CTAs (the
  # reduction overlaps backward GEMMs: fewer CTAs, fewer SMs taken from them); f32 and bf16 reduction.
  for z in "" "--zero"; do
    step bench_ddp$z 150 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_training $z --max-ctas 0,8,16 \
      --out $OUT_DIR/json/ddp_${ngpu}gpu${z:+_zero}.json
    grep -iE "^ddp max_ctas|\"scaling|error" $OUT_DIR/bench_ddp$z.log | head -12
  done
  step bench_ddp_bf16 100 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_training --bf16-reduce \
    --max-ctas 0,8 --out $OUT_DIR/json/ddp_${ngpu}gpu_bf16_reduce.json
  grep -iE "^ddp max_ctas|error" $OUT_DIR/bench_ddp_bf16.log | head -6
  step peer_ddp 120 $PY -m torch.distributed.run --nproc-per-node $ngpu benchmarks/training/torch_ddp_peer.py \
    --out $OUT_DIR/json/ddp_torch_peer_${ngpu}gpu.json
  grep -iE "scaling|tokens|error" $OUT_DIR/peer_ddp.log | head -6
fi

if has pipeline; then
  # The default 16-layer model split evenly, then 15 layers with the split balanced from a profiled step
  # (the last stage's output layer + loss costs about a layer: 4/4/4/3 evens the stages).
  for vp in 1 2; do
    step bench_pipe_vp$vp 200 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_pipeline --vp $vp \
      --out $OUT_DIR/json/pipeline_bubble_${ngpu}gpu_vp$vp.json
    grep -E "^PP|bubble|rror" $OUT_DIR/bench_pipe_vp$vp.log | head -8
    step bench_pipe_bal_vp$vp 200 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_pipeline --vp $vp \
      --layers 15 --layout balanced --out $OUT_DIR/json/pipeline_bubble_${ngpu}gpu_vp${vp}_balanced.json
    grep -E "^PP|^balanced|rror" $OUT_DIR/bench_pipe_bal_vp$vp.log | head -8
  done
fi

if has ckpt; then
  if [ -z "${CKPT_SKIP_1:-}" ]; then
    step bench_ckpt_1 300 $PY benchmarks/checkpoint/bench_checkpoint.py --repeats ${CKPT_REPEATS:-2} --out $OUT_DIR/json/checkpoint_1gpu.json
    grep -A6 best_GBps $OUT_DIR/bench_ckpt_1.log | head -7
  fi
  step bench_ckpt_n 300 mpirun -np $ngpu --bind-to none $PY benchmarks/checkpoint/bench_checkpoint.py \
    --repeats ${CKPT_REPEATS:-2} --out $OUT_DIR/json/checkpoint_${ngpu}gpu.json
  grep -A6 best_GBps $OUT_DIR/bench_ckpt_n.log | head -7; grep -iE "error|Traceback" -A3 $OUT_DIR/bench_ckpt_*.log | head -10
fi
if has ddp3; then
  # ZeRO-1 with the parameter all-gather overlapped with the next forward, and both with 4 micro-batches
  # of gradient accumulation (the reduction once per step, as in runs with large global batches).
  for v in "--zero --overlap-param-gather" "--grad-accum 4" "--zero --overlap-param-gather --grad-accum 4"; do
    tag=$(echo "$v" | sed 's/--zero/zero/; s/ --overlap-param-gather/_pg/; s/ *--grad-accum 4/_ga4/; s/^_//; s/ //g')
    step bench_ddp_$tag 150 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_training $v \
      --out $OUT_DIR/json/ddp_${ngpu}gpu_$tag.json
    grep -iE "^ddp max_ctas|error" $OUT_DIR/bench_ddp_$tag.log | head -3
  done
  step peer_ddp_ga4 150 $PY -m torch.distributed.run --nproc-per-node $ngpu benchmarks/training/torch_ddp_peer.py \
    --grad-accum 4 --out $OUT_DIR/json/ddp_torch_peer_${ngpu}gpu_ga4.json
  grep -iE "scaling|error" $OUT_DIR/peer_ddp_ga4.log | head -3
fi

if has ddp4; then
  has tests || { step gpu_gemm 60 $B/tests/megacore_tests "[gemm]"; tail -1 $OUT_DIR/gpu_gemm.log
                 step pytest_pg 200 $PY -m pytest -q -rs -s tests/python/test_train_gpu.py -k overlap_param_gather
                 grep -E "passed|failed|Error|assert" $OUT_DIR/pytest_pg.log | tail -6; }
  for v in "--max-ctas 0,16 --gemm-sm-margin 0,16,32" "--cta-policy 1 --gemm-sm-margin 0,16" \
           "--zero --overlap-param-gather --max-ctas 0,16 --gemm-sm-margin 0,16,32" \
           "--zero --overlap-param-gather --cta-policy 1 --gemm-sm-margin 0,16"; do
    tag=$(echo "$v" | sed 's/--zero --overlap-param-gather/zero_pg/; s/--max-ctas 0,16 //; s/--cta-policy 1 /eff_/; s/--gemm-sm-margin //; s/[ ,]/_/g')
    step bench_ddp4_$tag 150 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_training $v \
      --out $OUT_DIR/json/ddp_${ngpu}gpu_smmargin_$tag.json
    grep -iE "^ddp max_ctas|error" $OUT_DIR/bench_ddp4_$tag.log | head -8
  done
fi

if has ddp5; then
  has ddp4 || has tests || { step pytest_pg 200 $PY -m pytest -q -rs -s tests/python/test_train_gpu.py -k overlap_param_gather
                             grep -E "passed|failed|Error|assert" $OUT_DIR/pytest_pg.log | tail -6; }
  for v in "--zero" "--zero --overlap-param-gather" "--zero --overlap-param-gather --bf16-reduce" \
           "--zero --overlap-param-gather --grad-accum 4" "--bf16-reduce --grad-accum 4" "--grad-accum 4"; do
    tag=$(echo "$v" | sed 's/--zero/zero/; s/ *--overlap-param-gather/_pg/; s/ *--bf16-reduce/_bf16/; s/ *--grad-accum 4/_ga4/; s/^_//; s/ //g')
    step bench_ddp5_$tag 150 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_training $v \
      --out $OUT_DIR/json/ddp_${ngpu}gpu_$tag.json
    echo "$tag: $(grep -iE "^ddp max_ctas|error" $OUT_DIR/bench_ddp5_$tag.log | head -3)"
  done
fi

if has ddp6; then
  for v in "" "--zero --overlap-param-gather" "--zero --overlap-param-gather --bf16-reduce"; do
    tag=$(echo "$v" | sed 's/--zero/zero/; s/ *--overlap-param-gather/_pg/; s/ *--bf16-reduce/_bf16/; s/ //g'); tag=${tag:-ddp}
    step bench_ddp6_$tag 150 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_training $v \
      --out $OUT_DIR/json/ddp6_${ngpu}gpu_$tag.json
    echo "$tag: $(grep -iE "^ddp max_ctas|error" $OUT_DIR/bench_ddp6_$tag.log | head -3)"
  done
  for ga in 1 4; do
    step peer_ddp6_ga$ga 150 $PY -m torch.distributed.run --nproc-per-node $ngpu benchmarks/training/torch_ddp_peer.py \
      --grad-accum $ga --out $OUT_DIR/json/ddp6_torch_peer_${ngpu}gpu_ga$ga.json
    echo "torch ga$ga: $(grep -iE "scaling|error" $OUT_DIR/peer_ddp6_ga$ga.log | head -3)"
  done
fi

if has ddp2; then
  step bench_ddp_prio 120 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_training --comm-priority -5 \
    --max-ctas 0,32 --out $OUT_DIR/json/ddp_${ngpu}gpu_prio.json
  grep -iE "^ddp max_ctas|error" $OUT_DIR/bench_ddp_prio.log | head -4
  step bench_zero_bf16 120 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_training --zero --bf16-reduce \
    --out $OUT_DIR/json/ddp_${ngpu}gpu_zero_bf16_reduce.json
  grep -iE "^ddp max_ctas|error" $OUT_DIR/bench_zero_bf16.log | head -4
  step bench_zero_prio 120 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_training --zero --comm-priority -5 \
    --max-ctas 0,32 --out $OUT_DIR/json/ddp_${ngpu}gpu_zero_prio.json
  grep -iE "^ddp max_ctas|error" $OUT_DIR/bench_zero_prio.log | head -4
fi

if has kernels; then
  # attention in its own step: a hang there must not cost the other results
  # KTESTS=0: benchmarks only (the tests already ran on the same tree)
  has tests || [ "${KTESTS:-1}" = 0 ] || { step gpu_single 150 $B/tests/megacore_tests "[gpu]~[attention]"; tail -2 $OUT_DIR/gpu_single.log
                 step gpu_attention 200 $B/tests/megacore_tests "[attention][gpu]"; tail -2 $OUT_DIR/gpu_attention.log
                 grep -B3 -A12 FAILED $OUT_DIR/gpu_attention.log | head -40
                 grep -B3 -A12 FAILED $OUT_DIR/gpu_single.log | head -40; }
  if [ "${TORCH_PEERS:-1}" = 1 ]; then  # TORCH_PEERS=0: no torch fused-op peers (e.g. an attention-only run)
    step torch_peers 200 $PY benchmarks/kernels/torch_peers.py --out $OUT_DIR/json/torch_peers.json ${TPEERS_ONLY:+--only $TPEERS_ONLY}
    tail -2 $OUT_DIR/torch_peers.log
  fi
  if [ "${ATTN_PEERS:-1}" = 1 ]; then  # ATTN_PEERS=0: no torch SDPA peer (a run without attention)
    step torch_attn_peers 200 $PY benchmarks/kernels/torch_attention_peer.py --out $OUT_DIR/json/attention_torch_sdpa.json
    tail -2 $OUT_DIR/torch_attn_peers.log
  fi
  # KFILTER: comma-separated substrings of the benchmark names to run (all when empty).
  export MC_TORCH_ATTN_PEERS=$OUT_DIR/json/attention_torch_sdpa.json
  step bench_kernels 300 $B/benchmarks/megacore_bench_kernels \
    --peers $OUT_DIR/json/torch_peers.json --out $OUT_DIR/json/kernels.json ${KFILTER:+--filter $KFILTER}
  grep -E "ceiling|copy|rmsnorm|layernorm|cross_entropy|gemm|attention|embedding" $OUT_DIR/bench_kernels.log | head -120
fi
if has cp; then
  step cp_tests 300 $B/tests/megacore_tests "[cp]"; tail -2 $OUT_DIR/cp_tests.log
  step cp_mpi_gpu 200 mpirun -np $ngpu --bind-to none $B/tests/megacore_mpi_tests "[gpu][cp]"
  grep -E "\[gpu model\]|\[gpu cp\]|test cases|assertions" $OUT_DIR/cp_mpi_gpu.log | sort -u | head -10
  step cp_copy_engine 200 mpirun -np $ngpu --bind-to none $B/tests/megacore_mpi_tests "[copy_engine]"; tail -2 $OUT_DIR/cp_copy_engine.log
  step cp_pytest 500 $PY -m pytest -q -rs -s tests/python/test_train_gpu.py -k "context_parallel or cp_comm_copy_engine"
  tail -3 $OUT_DIR/cp_pytest.log
  for S in 32768 65536; do
    step bench_cp_$S 300 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_cp --seq $S --copy-engine \
      --out-dir $OUT_DIR/json
    grep -E "ms\"|tflops|hidden|tokens_per_s|exchange|wrote|error" $OUT_DIR/bench_cp_$S.log | head -20
    step peer_cp_$S 300 $PY -m torch.distributed.run --nproc-per-node $ngpu benchmarks/cp/torch_cp_peer.py --seq $S \
      --out-dir $OUT_DIR/json; grep -E "ms\"|tflops|error|wrote" $OUT_DIR/peer_cp_$S.log | head -6
  done
  # One GPU at seq 8192 (the target's base) and at 32768 (the same sequence as CP; the 1.1B model peaks at 47.6 GiB).
  step bench_cp_1gpu 200 mpirun -np 1 --bind-to none $B/benchmarks/megacore_bench_cp --seq 8192 --out-dir $OUT_DIR/json
  grep -E "tflops|wrote|error" $OUT_DIR/bench_cp_1gpu.log | head -6
  step bench_cp_1gpu_32k 200 mpirun -np 1 --bind-to none $B/benchmarks/megacore_bench_cp --seq 32768 --out-dir $OUT_DIR/json
  grep -E "tflops|wrote|error" $OUT_DIR/bench_cp_1gpu_32k.log | head -6
  step peer_cp_1gpu 200 $PY -m torch.distributed.run --nproc-per-node 1 benchmarks/cp/torch_cp_peer.py --seq 8192 \
    --out-dir $OUT_DIR/json; grep -E "tflops|error" $OUT_DIR/peer_cp_1gpu.log | head -3
fi

if has moe; then
  step moe_tests 300 $B/tests/megacore_tests "[moe]"; tail -2 $OUT_DIR/moe_tests.log
  grep -B4 -A14 "FAILED" $OUT_DIR/moe_tests.log | head -60
  step bench_moe 600 $B/benchmarks/megacore_bench_moe --out-dir $OUT_DIR/json; cat $OUT_DIR/bench_moe.log | head -80
  step bench_moe_dispatch 600 mpirun -np $ngpu --bind-to none $B/benchmarks/megacore_bench_moe_dispatch --out-dir $OUT_DIR/json
  sed -n '1,/^{/p' $OUT_DIR/bench_moe_dispatch.log | grep -v '^{' | head -20
fi
echo "logs in $OUT_DIR, JSON results in $OUT_DIR/json"
