#!/usr/bin/env bash
# The main job: installs what is missing, installs megacore (pip install .) and runs examples/quickstart.py.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/install_deps.sh
PY=${PYTHON:-python3}
"$PY" -m pip install -q --no-build-isolation . ${CMAKE_ARGS:+--config-settings=cmake.args="$CMAKE_ARGS"}
cd /tmp && exec "$PY" "$root/examples/quickstart.py"
