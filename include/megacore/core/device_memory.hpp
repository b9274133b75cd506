// How much memory a CUDA device has, asked without touching the device.
#pragma once

#include <cstdint>

namespace megacore {

/// Total memory of CUDA device `index` in bytes. Read from the device's properties, so no CUDA context is created
/// on it: a launcher can ask before its ranks start without taking memory from them. Throws ValueError when the
/// device does not exist, CudaError in a build without CUDA.
int64_t cuda_device_total_memory(int index);

}  // namespace megacore
