#!/usr/bin/env bash
# The main job: installs what is missing, installs megacore (pip install .) and runs examples/quickstart.py
# on 4 ranks in a TP=2 × PP=2 grid (GPUs when 4 are visible, else CPU ranks through mpirun).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/install_deps.sh
PY=${PYTHON:-python3}
"$PY" -m pip install -q --no-build-isolation . ${CMAKE_ARGS:+--config-settings=cmake.args="$CMAKE_ARGS"}
cd /tmp
gpus=$("$PY" -c "import megacore; print(megacore.cuda_device_count())")
cpu_flag=""; [ "$gpus" -ge 4 ] || cpu_flag="--cpu"
exec "$PY" -m megacore.launch --nproc-per-node 4 $cpu_flag "$root/examples/quickstart.py"
