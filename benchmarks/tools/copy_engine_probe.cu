// Which copies progress while a kernel holds every SM? The question behind comm::CommOptions::copy_engine
// (docs/comm.md, "Copy-engine transfers"): a kernel that keeps every SM busy until it ends (here a spin
// kernel of 8 × 256-thread blocks per SM, about 10 ms; cuDNN's attention in practice) runs on one stream, and
// a 64 MiB copy is issued on another once the kernel has started. A copy done by a copy engine ends long
// before the kernel; one that needs SMs ends with it. Cases: a copy within GPU 0 (cudaMemcpyAsync, and
// cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute), and with a second GPU a push from GPU 0
// into GPU 1 and a pull from GPU 1 into GPU 0 (both GPUs spinning), each without the kernel as the baseline.
// Three repeats each; prints one JSON object (card, per case: copy ms, GB/s, ms from the kernel's start to the
// copy's end, kernel ms).
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -o copy_engine_probe benchmarks/tools/copy_engine_probe.cu
//   ./copy_engine_probe > benchmarks/results/copy_engine_probe_<card>.json
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

namespace {

__global__ void spin(long long cycles, int* sink) {
  const long long t = clock64();
  while (clock64() - t < cycles) {
  }
  if (threadIdx.x == 0 && blockIdx.x == 0) *sink = 1;
}

enum class Copy { Local, LocalBatchOverlap, Push, Pull };

struct Gpu {
  int index = 0;
  cudaStream_t spin_stream = nullptr;
  int* sink = nullptr;
  int blocks = 0;
  void init(int i) {
    index = i;
    CK(cudaSetDevice(i));
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, i));
    blocks = sms * 8;
    CK(cudaStreamCreateWithFlags(&spin_stream, cudaStreamNonBlocking));
    CK(cudaMalloc(&sink, sizeof(int)));
  }
  void busy() {
    CK(cudaSetDevice(index));
    spin<<<blocks, 256, 0, spin_stream>>>(20000000LL, sink);
    CK(cudaGetLastError());
  }
};

}  // namespace

int main() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 1) {
    std::fprintf(stderr, "no GPU\n");
    return 1;
  }
  const size_t bytes = size_t(64) << 20;
  std::vector<Gpu> gpus(size_t(std::min(n, 2)));
  for (int i = 0; i < int(gpus.size()); ++i) gpus[size_t(i)].init(i);
  char *a = nullptr, *b = nullptr, *peer = nullptr;
  CK(cudaSetDevice(0));
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  if (n > 1) {
    CK(cudaDeviceEnablePeerAccess(1, 0));
    CK(cudaSetDevice(1));
    CK(cudaMalloc(&peer, bytes));
    CK(cudaDeviceEnablePeerAccess(0, 0));
    CK(cudaSetDevice(0));
  }
  cudaStream_t copy_stream;
  CK(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));
  cudaEvent_t k0, k1, c0, c1;
  for (cudaEvent_t* e : {&k0, &k1, &c0, &c1}) CK(cudaEventCreate(e));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("{\"card\": \"%s\", \"gpus\": %d, \"bytes\": %zu, \"spin_blocks\": %d, \"cases\": [\n", prop.name, n,
              bytes, gpus[0].blocks);
  struct Case {
    const char* name;
    Copy copy;
    bool busy;
  };
  std::vector<Case> cases = {{"local cudaMemcpyAsync", Copy::Local, true},
                             {"local cudaMemcpyAsync, no kernel", Copy::Local, false},
                             {"local cudaMemcpyBatchAsync PreferOverlapWithCompute", Copy::LocalBatchOverlap, true},
                             {"local cudaMemcpyBatchAsync PreferOverlapWithCompute, no kernel", Copy::LocalBatchOverlap, false}};
  if (n > 1) {
    cases.push_back({"push GPU 0 -> GPU 1, both busy", Copy::Push, true});
    cases.push_back({"pull GPU 1 -> GPU 0, both busy", Copy::Pull, true});
    cases.push_back({"push GPU 0 -> GPU 1, no kernel", Copy::Push, false});
  }
  bool first = true;
  for (const Case& c : cases) {
    for (int rep = 0; rep < 3; ++rep) {
      CK(cudaSetDevice(0));
      if (c.busy) {
        CK(cudaEventRecord(k0, gpus[0].spin_stream));
        gpus[0].busy();
        CK(cudaSetDevice(0));
        CK(cudaEventRecord(k1, gpus[0].spin_stream));
        if (n > 1 && (c.copy == Copy::Push || c.copy == Copy::Pull)) gpus[1].busy();
        CK(cudaSetDevice(0));
        CK(cudaEventSynchronize(k0));  // the copy is issued once the kernel has started
      }
      CK(cudaEventRecord(c0, copy_stream));
      switch (c.copy) {
        case Copy::Local: CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, copy_stream)); break;
        case Copy::Push: CK(cudaMemcpyAsync(peer, a, bytes, cudaMemcpyDeviceToDevice, copy_stream)); break;
        case Copy::Pull: CK(cudaMemcpyAsync(b, peer, bytes, cudaMemcpyDeviceToDevice, copy_stream)); break;
        case Copy::LocalBatchOverlap: {
          void* dst[1] = {b};
          const void* src[1] = {a};
          size_t size[1] = {bytes}, idx[1] = {0};
          cudaMemcpyAttributes at{};
          at.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
          at.flags = cudaMemcpyFlagPreferOverlapWithCompute;
          CK(cudaMemcpyBatchAsync(dst, src, size, 1, &at, idx, 1, copy_stream));
          break;
        }
      }
      CK(cudaEventRecord(c1, copy_stream));
      for (const Gpu& g : gpus) {
        CK(cudaSetDevice(g.index));
        CK(cudaDeviceSynchronize());
      }
      CK(cudaSetDevice(0));
      float copy_ms = 0, kernel_ms = 0, done_ms = 0;
      CK(cudaEventElapsedTime(&copy_ms, c0, c1));
      if (c.busy) {
        CK(cudaEventElapsedTime(&kernel_ms, k0, k1));
        CK(cudaEventElapsedTime(&done_ms, k0, c1));
      }
      std::printf("%s  {\"case\": \"%s\", \"repeat\": %d, \"copy_ms\": %.4f, \"gb_per_s\": %.1f, \"kernel_ms\": %.3f, "
                  "\"copy_done_after_kernel_start_ms\": %.3f}",
                  first ? "" : ",\n", c.name, rep, copy_ms, double(bytes) / copy_ms / 1e6, kernel_ms,
                  c.busy ? done_ms : 0.0);
      first = false;
    }
  }
  std::printf("\n]}\n");
  return 0;
}
