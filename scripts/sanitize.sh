#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer run of megacore's C++ tests: a CPU-only build in its own folder
# (-fsanitize=address,undefined, -O1 -g, any UB report is fatal), then the unit tests and the MPI tests on 2, 4 and
# 8 ranks, as CI runs them (GPU tests excluded).
#   MEGACORE_SANITIZE_BUILD_DIR  build folder (default build-sanitize)
#   JOBS                         build parallelism (default: nproc)
# Leak checking stays on; scripts/sanitize.supp suppresses leaks whose allocation stack is inside Open MPI and its
# runtime libraries (what MPI_Init/MPI_Finalize keep), never one in megacore.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
BUILD=${MEGACORE_SANITIZE_BUILD_DIR:-build-sanitize}
JOBS=${JOBS:-$(nproc)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
san="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
t0=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DMEGACORE_CUDA=OFF -DMEGACORE_BUILD_PYTHON=OFF -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" -DCMAKE_CXX_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san" \
  -DCMAKE_SHARED_LINKER_FLAGS="$san" "${launcher[@]}" ${CMAKE_ARGS:-}
cmake --build "$BUILD" -j"$JOBS" --target megacore_tests megacore_mpi_tests
t1=$(date +%s)

# allocator_may_return_null: an impossible allocation returns null as plain malloc does (the allocator tests check
# that megacore turns it into OutOfMemoryError; ASan's default aborts on it instead).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/scripts/sanitize.supp:print_suppressions=0}
echo "[sanitize] unit tests"
"$BUILD/tests/megacore_tests" "~[gpu]"
for np in 2 4 8; do
  echo "[sanitize] mpirun -np $np"
  mpirun --oversubscribe -np "$np" -x ASAN_OPTIONS -x UBSAN_OPTIONS -x LSAN_OPTIONS \
    "$BUILD/tests/megacore_mpi_tests" "~[gpu]"
done
t2=$(date +%s)
echo "[sanitize] clean: build $((t1 - t0)) s, tests $((t2 - t1)) s"
