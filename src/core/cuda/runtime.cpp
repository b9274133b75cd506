// The CUDA runtime half of core: devices, memory, streams and events.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include "core/cuda/cuda_check.hpp"
#include "core/cuda_backend.hpp"

namespace megacore::cuda_impl {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {  // no driver or no device: CPU-only machine
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::string device_name(int device) {
  cudaDeviceProp p{};
  MC_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  return p.name;
}

size_t device_total_memory(int device) {
  cudaDeviceProp p{};
  MC_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  return p.totalGlobalMem;
}

int compute_capability(int device) {
  int major = 0, minor = 0;
  MC_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MC_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major * 10 + minor;
}

void set_device(int device) { MC_CUDA_CHECK(cudaSetDevice(device)); }
int current_device() {
  int d = 0;
  MC_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

void mem_get_info(int device, size_t* free_bytes, size_t* total_bytes) {
  DeviceGuard g(device);
  MC_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
}

void* raw_malloc(size_t nbytes, int device) {
  DeviceGuard g(device);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, nbytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;
  }
  MC_CUDA_CHECK(e);
  return p;
}

void raw_free(void* p, int device) {
  DeviceGuard g(device);
  MC_CUDA_CHECK(cudaFree(p));
}

int pointer_device(const void* p) {
  cudaPointerAttributes a{};
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

void memcpy_async(void* dst, const void* src, size_t nbytes, CopyKind kind, void* stream, int device) {
  DeviceGuard g(device);
  cudaMemcpyKind k = kind == CopyKind::HostToDevice   ? cudaMemcpyHostToDevice
                     : kind == CopyKind::DeviceToHost ? cudaMemcpyDeviceToHost
                                                      : cudaMemcpyDeviceToDevice;
  MC_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, k, static_cast<cudaStream_t>(stream)));
}

void* stream_create(int device, bool non_blocking, int priority) {
  DeviceGuard g(device);
  cudaStream_t s = nullptr;
  MC_CUDA_CHECK(cudaStreamCreateWithPriority(&s, non_blocking ? cudaStreamNonBlocking : cudaStreamDefault, priority));
  return s;
}
void stream_destroy(void* s) { cudaStreamDestroy(static_cast<cudaStream_t>(s)); }
void stream_synchronize(void* s, int device) {
  DeviceGuard g(device);
  MC_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(s)));
}
bool stream_query(void* s, int device) {
  DeviceGuard g(device);
  cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(s));
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  MC_CUDA_CHECK(e);
  return true;
}
void stream_wait_event(void* s, void* e, int device) {
  DeviceGuard g(device);
  MC_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e), 0));
}
void* event_create(int device, bool timing) {
  DeviceGuard g(device);
  cudaEvent_t e = nullptr;
  MC_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  return e;
}
void event_destroy(void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); }
void event_record(void* e, void* s, int device) {
  DeviceGuard g(device);
  MC_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s)));
}
void event_synchronize(void* e) { MC_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(e))); }
bool event_query(void* e) {
  cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(e));
  if (r == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  MC_CUDA_CHECK(r);
  return true;
}
float event_elapsed_ms(void* start, void* end) {
  float ms = 0;
  MC_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)));
  return ms;
}
void device_synchronize(int device) {
  DeviceGuard g(device);
  MC_CUDA_CHECK(cudaDeviceSynchronize());
}

void profiler_range(bool start) { MC_CUDA_CHECK(start ? cudaProfilerStart() : cudaProfilerStop()); }

}  // namespace megacore::cuda_impl
