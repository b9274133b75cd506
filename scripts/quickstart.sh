#!/usr/bin/env bash
# The main job: installs what is missing, installs megacore (pip install .) and pretrains the `tiny` recipe
# (a 4-layer Llama on the embedded corpus) with TP=2 × PP=2 on 4 ranks — GPUs (bf16) when 4 are visible, else CPU
# ranks through mpirun: falling loss, validation, a checkpoint under runs/tiny_pretrain/, and a greedy sample
# generated from the trained model. Extra arguments go to `megacore train` (e.g. --set trainer.max_steps=200).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/install_deps.sh
PY=${PYTHON:-python3}
"$PY" -m pip install -q --no-build-isolation . ${CMAKE_ARGS:+--config-settings=cmake.args="$CMAKE_ARGS"}
gpus=$(cd /tmp && "$PY" -c "import megacore; print(megacore.cuda_device_count())")
# trainer.precision is auto: bf16 on GPUs, f32 on CPU ranks.
flags=(--cpu); [ "$gpus" -ge 4 ] && flags=()
exec "$PY" -m megacore.cli train --recipe tiny --nproc-per-node 4 "${flags[@]}" "$@"
