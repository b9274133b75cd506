#!/usr/bin/env bash
# Installs what megacore needs to build and test, skipping what is already there.
#   Debian packages: cmake, ninja, g++, Eigen, fmt, nlohmann-json, Catch2 (v2), Open MPI.
#   Python packages: numpy, pytest, pybind11, scikit-build-core.
# On an offline machine with the header bundle of scripts/bundle_deps.sh in .deps/, nothing is
# installed: the bundle is used through CMAKE_PREFIX_PATH (source this script to get it exported).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}

if [ -d "$root/.deps/root/usr" ]; then
  export CMAKE_PREFIX_PATH="$root/.deps/root/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  echo "[deps] using the offline bundle in .deps/"
else
  pkgs=(cmake ninja-build g++ libeigen3-dev libfmt-dev nlohmann-json3-dev catch2 libopenmpi-dev openmpi-bin)
  missing=()
  for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[deps] apt-get install ${missing[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

pymissing=()
for m in numpy pytest pybind11 scikit_build_core; do
  "$PY" -c "import $m" >/dev/null 2>&1 || pymissing+=("${m//_/-}")
done
if [ ${#pymissing[@]} -gt 0 ]; then
  if [ -d "$root/.deps/root/usr" ]; then
    echo "[deps] offline: not installing Python packages ${pymissing[*]}"
  else
    echo "[deps] pip install ${pymissing[*]}"
    "$PY" -m pip install -q "${pymissing[@]}"
  fi
fi
