#!/usr/bin/env bash
# A/B of megacore._C's export list against the cuDNN-in-Python crash (docs/kernels.md, "cuDNN inside the
# Python module"), then the Python GPU tests with cuDNN on. Relinks the built module's objects twice: with no
# export list ("none") and with --exclude-libs,ALL ("exclude"), and runs probe.py's cuDNN forward/backward
# with each and with the normal build ("main", bindings/exports.map), torch imported first or not.
#   device run: bash scripts/probe/cudnn_in_python.sh   (carry [".deps"])
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=/opt/torch/.venv/bin/python3
source scripts/install_deps.sh; set +euo pipefail
B=$PWD/.gpu-build; t0=$(date +%s)
cmake -S . -B $B -G Ninja -DMEGACORE_BUILD_PYTHON=ON -DPython_EXECUTABLE=$PY -DMEGACORE_BUILD_BENCHMARKS=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DMEGACORE_CUDNN=ON > $OUT/configure.log 2>&1
cmake --build $B -j$(nproc) --target _C megacore_tests > $OUT/build.log 2>&1 || { grep -B2 -A8 error $OUT/build.log | head -60; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"; nvidia-smi -L
P=scripts/probe; W=/tmp/probe; mkdir -p $W
gcc -shared -fPIC -O1 -o $W/segv.so $P/segv.c -ldl && g++ -std=c++20 -O2 -shared -fPIC -o $W/probe_ss.so $P/probe_ss.cpp
export PROBE_SS=$W/probe_ss.so
cmd=$(cd $B && ninja -t commands _C | tail -1)
for v in none exclude; do
  mkdir -p $W/$v/megacore; cp -r $B/python/megacore/. $W/$v/megacore/; rm -f $W/$v/megacore/_C*.so
  c=$(echo "$cmd" | sed -E "s#-o python/megacore/#-o $W/$v/megacore/#")
  if [ $v = none ]; then c=$(echo "$c" | sed -E 's#-Wl,--version-script=[^ ]+##'); else c=$(echo "$c" | sed -E 's#-Wl,--version-script=[^ ]+#-Wl,--exclude-libs,ALL#'); fi
  (cd $B && eval "$c") > $W/relink_$v.log 2>&1; echo "relink $v rc=$?"
done
echo "== exported (defined) dynamic symbols: main $(nm -D --defined-only $B/python/megacore/_C*.so | wc -l), exclude $(nm -D --defined-only $W/exclude/megacore/_C*.so | wc -l), none $(nm -D --defined-only $W/none/megacore/_C*.so | wc -l)"
nm -D --defined-only $W/none/megacore/_C*.so | c++filt > $OUT/exports_none.txt
nm -D --defined-only $W/exclude/megacore/_C*.so | c++filt > $OUT/exports_exclude.txt
echo "== std:: exports: none $(grep -c 'std::' $OUT/exports_none.txt), exclude $(grep -c 'std::' $OUT/exports_exclude.txt)"
grep -E "_M_insert|num_put|locale|basic_stringstream|basic_ostream|basic_ios" $OUT/exports_none.txt | cut -c1-180 | head -20
for v in main exclude none; do
  pp=$B/python; [ $v != main ] && pp=$W/$v
  for mode in plain torch_first; do
    PYTHONPATH=$pp LD_PRELOAD=$W/segv.so timeout 120 $PY $P/probe.py $mode > $W/p_${v}_$mode.log 2>&1; rc=$?
    echo "== variant $v mode $mode rc=$rc: $(grep -cE '^OK (fwd|bwd)' $W/p_${v}_$mode.log)/2 OK"
    [ $rc -ne 0 ] && grep -A14 SIGNAL $W/p_${v}_$mode.log | cut -c1-200
  done
done
cp $W/p_*.log $OUT/ 2>/dev/null
echo "== who binds to the unrestricted module's symbols (variant none, plain)"
PYTHONPATH=$W/none LD_DEBUG=bindings LD_DEBUG_OUTPUT=$W/ldb timeout 120 $PY $P/probe.py plain > /dev/null 2>&1
cat $W/ldb.* | grep -E "to /tmp/probe/none/megacore/_C" | grep -v "binding file /tmp/probe/none/megacore/_C" | sed -E 's/^ *[0-9]+: *//' > $OUT/bindings_to_C_none.txt
echo "$(wc -l < $OUT/bindings_to_C_none.txt) bindings from other objects"; awk '{print $3}' $OUT/bindings_to_C_none.txt | sort | uniq -c
grep -oE "symbol \`[^']+'" $OUT/bindings_to_C_none.txt | sed 's/symbol `//' | c++filt | sort | uniq -c | sort -rn | cut -c1-200 | head -40
export PYTHONPATH=$B/python
echo "===== C++ [attention] tests ($(( $(date +%s) - t0 )) s)"; timeout 150 $B/tests/megacore_tests "[attention]" 2>&1 | tail -3
echo "===== pytest GPU ($(( $(date +%s) - t0 )) s)"
timeout 240 $PY -m pytest -q -rs tests/python/test_ops.py tests/python/test_module_exports.py tests/python/test_dlpack_torch.py \
  tests/python/test_convert_transformers.py tests/python/test_train_gpu.py > $OUT/pytest_gpu.log 2>&1; echo "rc=$?"
grep -E "passed|failed|Error|SKIP" $OUT/pytest_gpu.log | tail -12; grep -m3 "using cuDNN" $OUT/pytest_gpu.log
echo "all done at $(( $(date +%s) - t0 )) s"
