// Stand-ins for src/core/cuda/ in builds without CUDA.
#include "megacore/build_config.hpp"
#if !MEGACORE_WITH_CUDA
#include "core/cuda_backend.hpp"
#include "megacore/core/error.hpp"

namespace megacore::cuda_impl {
namespace {
[[noreturn]] void no_cuda() {
  raise<CudaError>("megacore was built without CUDA; rebuild with the CUDA toolkit installed (configure with "
                   "-DMEGACORE_CUDA=ON) or use Device::cpu()");
}
}  // namespace
int device_count() { return 0; }
std::string device_name(int) { no_cuda(); }
int compute_capability(int) { no_cuda(); }
void set_device(int) { no_cuda(); }
int current_device() { no_cuda(); }
void mem_get_info(int, size_t*, size_t*) { no_cuda(); }
size_t device_total_memory(int) { no_cuda(); }
void* raw_malloc(size_t, int) { no_cuda(); }
void raw_free(void*, int) { no_cuda(); }
int pointer_device(const void*) { return -1; }
void memcpy_async(void*, const void*, size_t, CopyKind, void*, int) { no_cuda(); }
void* stream_create(int, bool, int) { no_cuda(); }
void stream_destroy(void*) {}
void profiler_range(bool) {}
void stream_synchronize(void*, int) { no_cuda(); }
bool stream_query(void*, int) { no_cuda(); }
void stream_wait_event(void*, void*, int) { no_cuda(); }
void* event_create(int, bool) { no_cuda(); }
void event_destroy(void*) {}
void event_record(void*, void*, int) { no_cuda(); }
void event_synchronize(void*) { no_cuda(); }
bool event_query(void*) { no_cuda(); }
float event_elapsed_ms(void*, void*) { no_cuda(); }
void device_synchronize(int) { no_cuda(); }
void fill(void*, DType, const StridedDesc&, double, void*, int) { no_cuda(); }
void random(void*, DType, const StridedDesc&, RandomKind, uint64_t, uint64_t, double, double, void*, int) { no_cuda(); }
void copy(void*, DType, const StridedDesc&, const void*, DType, const StridedDesc&, void*, int) { no_cuda(); }
}  // namespace megacore::cuda_impl
#endif
