// Catch2 entry point. `--skip-without-gpu` makes the run exit 77 (ctest: skipped) when no CUDA
// device is visible, so GPU-tagged tests are skipped rather than failed on CPU-only machines.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <vector>

#include "megacore/core/device.hpp"

int main(int argc, char** argv) {
  std::vector<char*> args;
  bool skip_without_gpu = false;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--skip-without-gpu") == 0) skip_without_gpu = true;
    else args.push_back(argv[i]);
  }
  if (skip_without_gpu && !megacore::cuda_available()) {
    std::puts("no CUDA device visible: GPU tests skipped");
    return 77;
  }
  return Catch::Session().run(int(args.size()), args.data());
}
