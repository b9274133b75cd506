#!/usr/bin/env bash
# Builds megacore with its tests and runs all of them: C++ unit tests, multi-rank MPI tests
# (mpirun -np 2/4/8, oversubscribed), Python tests, the find_package install test, and the GPU tests
# when a GPU is visible (they are reported as skipped otherwise). Then checks `pip install .`.
#   MEGACORE_BUILD_DIR   build folder (default build)
#   CMAKE_ARGS           extra configure flags (e.g. -DMEGACORE_CUDA=OFF -DCMAKE_CUDA_ARCHITECTURES=90a)
#   MEGACORE_SKIP_PIP=1  skip the pip-install check
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/install_deps.sh
PY=${PYTHON:-python3}
BUILD=${MEGACORE_BUILD_DIR:-build}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

# A tree the pip check below configured last (and was interrupted before it was reset) is reset first.
unset_pip=()
grep -q '^SKBUILD:' "$BUILD/CMakeCache.txt" 2>/dev/null && unset_pip=(-U 'SKBUILD*' -U CMAKE_INSTALL_PREFIX)
cmake -S . -B "$BUILD" -G Ninja "${unset_pip[@]}" -DMEGACORE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$PY")" \
  ${CMAKE_ARGS:-}
cmake --build "$BUILD" -j"$(nproc)"
ctest --test-dir "$BUILD" --output-on-failure -j1

if [ "${MEGACORE_SKIP_PIP:-0}" != 1 ] && "$PY" -c "import scikit_build_core" >/dev/null 2>&1; then
  echo "[test] pip install . (packaging check)"
  # scikit-build-core configures, builds and installs in the tree just built and tested (tests and benchmarks kept
  # on), so the package is the tested build and nothing is compiled twice. It leaves its own cache entries there
  # (SKBUILD*, which switch the install rules and the module's location to the wheel's, and a temporary install
  # prefix); the tree is reconfigured without them afterwards.
  prefix=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$BUILD/CMakeCache.txt")
  "$PY" -m pip install -q --no-build-isolation . --config-settings=build-dir="$BUILD" \
    --config-settings=cmake.define.MEGACORE_BUILD_TESTS=ON --config-settings=cmake.define.MEGACORE_BUILD_BENCHMARKS=ON \
    ${CMAKE_ARGS:+--config-settings=cmake.args="$CMAKE_ARGS"}
  cmake -S . -B "$BUILD" -U 'SKBUILD*' -DCMAKE_INSTALL_PREFIX="$prefix" > /dev/null
  (cd /tmp && "$PY" -c "import megacore, numpy as np; t = megacore.from_numpy(np.arange(6, dtype=np.float32)); \
assert np.asarray(t.to('bf16').to('f32')).sum() == 15; print('installed megacore', megacore.__version__, 'ok')")
fi
