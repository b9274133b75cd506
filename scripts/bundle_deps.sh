#!/usr/bin/env bash
# Bundles the header-only build dependencies for an offline GPU host. Run it in the source tree on a
# connected Debian/Ubuntu machine of the host's release; it writes .deps/ (git-ignored), which travels
# with the tree. There, scripts/install_deps.sh sees .deps/ and points CMake at .deps/root/usr.
#   Debian packages: Eigen, fmt, nlohmann-json, Catch2 (plus any given as arguments), unpacked with dpkg -x.
#   cudnn-frontend (header-only, for the cuDNN attention path): from its wheel, when pip can reach PyPI.
# Usage: scripts/bundle_deps.sh [extra Debian packages...]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps/debs .deps/root
pkgs=(libeigen3-dev libfmt-dev libfmt9 catch2 nlohmann-json3-dev "$@")
( cd .deps/debs && apt-get download "${pkgs[@]}" >/dev/null 2>&1 ) || {
  apt-get update >/dev/null && ( cd .deps/debs && apt-get download "${pkgs[@]}" ); }
for f in .deps/debs/*.deb; do dpkg -x "$f" .deps/root; done
if python3 -m pip download -q --no-deps -d .deps/wheels nvidia-cudnn-frontend >/dev/null 2>&1; then
  tmp=$(mktemp -d); unzip -q -o .deps/wheels/nvidia_cudnn_frontend-*.whl -d "$tmp"
  inc=$(find "$tmp" -name cudnn_frontend.h -printf '%h\n' | head -n1)
  if [ -n "$inc" ]; then mkdir -p .deps/root/usr/include && cp -r "$inc"/. .deps/root/usr/include/; fi
  rm -rf "$tmp"
else
  echo "[deps] cudnn-frontend not bundled (pip could not download it): the cuDNN attention path will be off"
fi
du -sh .deps | awk '{print "[deps] bundle: .deps (" $1 ")"}'
