// Private interface between the host-side core and its CUDA implementation (src/core/cuda/).
// A build without CUDA links src/core/cuda_stubs.cpp instead, whose functions report that CUDA is
// absent (device_count() is 0, everything else throws CudaError naming the fix).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "megacore/core/dtype.hpp"

namespace megacore::cuda_impl {

inline constexpr int kMaxDims = 8;

/// Shape and strides (in elements) of a strided tensor, passed to kernels by value.
struct StridedDesc {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};
  int64_t numel = 1;
};

int device_count();
std::string device_name(int device);
/// major * 10 + minor (90 for Hopper).
int compute_capability(int device);
void set_device(int device);
int current_device();
void mem_get_info(int device, size_t* free_bytes, size_t* total_bytes);
/// cudaDeviceProp::totalGlobalMem (creates no context, unlike mem_get_info).
size_t device_total_memory(int device);

/// cudaMalloc on device; nullptr when the device is out of memory (the error is cleared).
void* raw_malloc(size_t nbytes, int device);
void raw_free(void* p, int device);
/// Device ordinal of a device pointer, -1 for host memory (pageable or pinned), throws if unknown.
int pointer_device(const void* p);

enum class CopyKind { HostToDevice, DeviceToHost, DeviceToDevice };
/// All functions that take a stream also take its device: the legacy default stream (nullptr) and
/// kernel launches refer to the calling thread's current device, which need not be the tensor's.
void memcpy_async(void* dst, const void* src, size_t nbytes, CopyKind kind, void* stream, int device);

void* stream_create(int device, bool non_blocking, int priority);
void stream_destroy(void* s);
void stream_synchronize(void* s, int device);
bool stream_query(void* s, int device);
void stream_wait_event(void* s, void* e, int device);
void* event_create(int device, bool timing);
void event_destroy(void* e);
void event_record(void* e, void* s, int device);
void event_synchronize(void* e);
bool event_query(void* e);
float event_elapsed_ms(void* start, void* end);
void device_synchronize(int device);
/// cudaProfilerStart / cudaProfilerStop: bracket a range for a profiler that honours them (nsys
/// --capture-range=cudaProfilerApi, benchmarks/tools/step_profile).
void profiler_range(bool start);

// Kernels (src/core/cuda/tensor_kernels.cu).
void fill(void* data, DType dt, const StridedDesc& d, double value, void* stream, int device);
enum class RandomKind { Uniform, Normal };
void random(void* data, DType dt, const StridedDesc& d, RandomKind kind, uint64_t seed, uint64_t offset, double a,
            double b, void* stream, int device);
/// dst[i] = convert(src[i]) for every logical index i; both on the same device.
void copy(void* dst, DType dst_dt, const StridedDesc& dd, const void* src, DType src_dt, const StridedDesc& sd,
          void* stream, int device);

}  // namespace megacore::cuda_impl
