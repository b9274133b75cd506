// Status checks for CUDA runtime calls (compiled only in CUDA builds).
#pragma once

#include <cuda_runtime.h>

#include "megacore/core/error.hpp"

#define MC_CUDA_CHECK(expr)                                                                         \
  do {                                                                                              \
    cudaError_t mc_err_ = (expr);                                                                   \
    if (mc_err_ != cudaSuccess) {                                                                   \
      (void)cudaGetLastError();                                                                     \
      ::megacore::raise<::megacore::CudaError>("{} failed: {} ({}) at {}:{}", #expr,                \
                                               cudaGetErrorString(mc_err_), cudaGetErrorName(mc_err_), \
                                               __FILE__, __LINE__);                                 \
    }                                                                                               \
  } while (0)

/// Checks the launch that just happened.
#define MC_CUDA_CHECK_LAUNCH() MC_CUDA_CHECK(cudaGetLastError())

namespace megacore::cuda_impl {
/// Sets the current device for the scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MC_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) MC_CUDA_CHECK(cudaSetDevice(device));
    cur_ = device;
  }
  ~DeviceGuard() {
    if (prev_ != cur_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0, cur_ = 0;
};

/// DeviceGuard that never throws (for watchdogs, destructors and error-returning code, which must survive a
/// device in a sticky error state): failures are ignored and the runtime's last error is cleared.
struct QuietDeviceGuard {
  int prev = -1;
  explicit QuietDeviceGuard(int device) {
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    if (prev != device) (void)cudaSetDevice(device);
    (void)cudaGetLastError();
  }
  ~QuietDeviceGuard() {
    if (prev >= 0) (void)cudaSetDevice(prev);
  }
  QuietDeviceGuard(const QuietDeviceGuard&) = delete;
  QuietDeviceGuard& operator=(const QuietDeviceGuard&) = delete;
};
}  // namespace megacore::cuda_impl
