// The Hopper grouped GEMM (src/ops/cuda/grouped_gemm_sm90.cu) on its own, without the rest of the library:
// `check` compares every kind (forward, dgrad, wgrad) and every f32 wgrad epilogue (registers, TMA reduce-add,
// staged) with a naive f32 kernel on awkward shapes (partial tiles, empty experts, 64 experts, beta 0 / 0.5 /
// 1, f32 and bf16 dw); `bench` times the kernel against one cuBLAS GEMM per expert and a dense cuBLAS GEMM of
// the same FLOPs, and for wgrad each epilogue forced in turn, at MoE shapes. Built by nvcc alone (no CMake
// target), on a machine with CUDA 12.5+ and an sm_90a GPU:
//
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -DMEGACORE_GROUPED_SM90=1 -Isrc -Iinclude \
//     benchmarks/moe/grouped_sm90_check.cu src/ops/cuda/grouped_gemm_sm90.cu -lcublas -o /tmp/gg
//   /tmp/gg check && /tmp/gg bench
//
// Add -DMC_SM90_DEBUG_HANG to make a stuck mbarrier wait print and trap instead of hanging. Under Nsight Compute
// set GG_ITERS=1 (one timed launch after three warm-ups per variant) and pick one case: `/tmp/gg bench2 2`.
// GG_KINDS=2 runs the wgrad cases only (digits: 0 forward, 1 dgrad, 2 wgrad); GG_FAST=1 times the kernel alone
// (no epilogue sweep, no cuBLAS loop or dense GEMM), for comparing builds of the kernel in one call.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <string>
#include <algorithm>
#include <random>
#include "ops/cuda/grouped_gemm_sm90.hpp"
using namespace megacore::ops::cuda;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
#define CB(x) do { cublasStatus_t e = (x); if (e != CUBLAS_STATUS_SUCCESS) { printf("cuBLAS %d at %d\n", int(e), __LINE__); exit(1);} } while (0)

__global__ void fill(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16((float(h & 0xffff) / 65535.f - 0.5f) * 2.f);
  }
}
__global__ void fillf(float* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = (float(h & 0xffff) / 65535.f - 0.5f) * 4.f;
  }
}
// naive reference into f32 ref (same layout as out); kind 0 fwd,1 dgrad,2 wgrad
__global__ void ref_kernel(int kind, const __nv_bfloat16* a, const __nv_bfloat16* b, const int64_t* off, int groups,
                           int64_t rows, int64_t mo, int64_t k, float beta, const float* init, float* ref) {
  const int64_t total = kind == 2 ? int64_t(groups) * mo * k : rows * (kind == 0 ? mo : k);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.f;
    if (kind == 2) {
      const int64_t g = i / (mo * k), m = (i / k) % mo, n = i % k;
      for (int64_t r = off[g]; r < off[g + 1]; ++r) s += __bfloat162float(a[r * mo + m]) * __bfloat162float(b[r * k + n]);
      s += (off[g + 1] == off[g] ? 1.f : beta) * init[i];  // empty groups: untouched (the library's caller scales them)
    } else {
      const int64_t n_out = kind == 0 ? mo : k;
      const int64_t r = i / n_out, n = i % n_out;
      int g = 0; while (r >= off[g + 1]) ++g;
      if (kind == 0) for (int64_t kk = 0; kk < k; ++kk) s += __bfloat162float(a[r * k + kk]) * __bfloat162float(b[(g * mo + n) * k + kk]);
      else for (int64_t kk = 0; kk < mo; ++kk) s += __bfloat162float(a[r * mo + kk]) * __bfloat162float(b[(g * mo + kk) * k + n]);
    }
    ref[i] = s;
  }
}
__global__ void compare(const void* got, bool f32, const float* ref, int64_t n, float rtol, float atol, unsigned long long* bad, float* maxerr) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = f32 ? static_cast<const float*>(got)[i] : __bfloat162float(static_cast<const __nv_bfloat16*>(got)[i]);
    const float e = fabsf(v - ref[i]);
    if (!(e <= atol + rtol * fabsf(ref[i]))) atomicAdd(bad, 1ull);
    atomicMax(reinterpret_cast<int*>(maxerr), __float_as_int(isfinite(e) ? e : 1e30f));
  }
}

struct Case { std::string name; int kind; std::vector<int64_t> sizes; int64_t mo, k; float beta; bool f32; };

static cublasHandle_t H;
// cuBLAS per group (row-major conventions of grouped_gemm_sm90.hpp)
void cublas_group(int kind, const __nv_bfloat16* a, const __nv_bfloat16* b, void* out, bool f32, int64_t r0, int64_t rows, int g, int64_t mo, int64_t k, float beta) {
  const float one = 1.f, zero = 0.f;
  if (kind == 0) {  // y[r][mo] = x[r][k] w_g[mo][k]^T  -> col-major C^T(mo x r) = w_g^T? : gemm(T, N, mo, r, k, w_g(ld k), x(ld k), y(ld mo))
    CB(cublasGemmEx(H, CUBLAS_OP_T, CUBLAS_OP_N, mo, rows, k, &one, b + g * mo * k, CUDA_R_16BF, k, a + r0 * k, CUDA_R_16BF, k, &zero,
                    static_cast<__nv_bfloat16*>(out) + r0 * mo, CUDA_R_16BF, mo, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  } else if (kind == 1) {  // dx[r][k] = dy[r][mo] w_g[mo][k]: C^T (k x r) = w_g^T(k x mo, colmajor ld k, N) * dy^T (mo x r, ld mo, N)
    CB(cublasGemmEx(H, CUBLAS_OP_N, CUBLAS_OP_N, k, rows, mo, &one, b + g * mo * k, CUDA_R_16BF, k, a + r0 * mo, CUDA_R_16BF, mo, &zero,
                    static_cast<__nv_bfloat16*>(out) + r0 * k, CUDA_R_16BF, k, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  } else {  // dw[mo][k] = dy^T x: C^T (k x mo) = x^T (k x r, ld k, N) * dy (r x mo) = (mo x r ld mo)^T
    if (f32)
      CB(cublasGemmEx(H, CUBLAS_OP_N, CUBLAS_OP_T, k, mo, rows, &one, b + r0 * k, CUDA_R_16BF, k, a + r0 * mo, CUDA_R_16BF, mo, &beta,
                      static_cast<float*>(out) + g * mo * k, CUDA_R_32F, k, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    else
      CB(cublasGemmEx(H, CUBLAS_OP_N, CUBLAS_OP_T, k, mo, rows, &one, b + r0 * k, CUDA_R_16BF, k, a + r0 * mo, CUDA_R_16BF, mo, &beta,
                      static_cast<__nv_bfloat16*>(out) + g * mo * k, CUDA_R_16BF, k, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

template <class F> float time_ms(F f, int iters) {
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) f();
  CK(cudaEventRecord(e0)); for (int i = 0; i < iters; ++i) f(); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
  float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); return ms / iters;
}

int main(int argc, char** argv) {
  const bool bench = argc > 1 && std::string(argv[1]).rfind("bench", 0) == 0;
  setvbuf(stdout, nullptr, _IONBF, 0);
  const int only = argc > 2 ? atoi(argv[2]) : -1;
  const char* kinds = getenv("GG_KINDS");     // e.g. GG_KINDS=2: wgrad cases only (0 forward, 1 dgrad)
  const bool fast = getenv("GG_FAST") != nullptr;  // bench: the kernel's own time only (no epilogue sweep, no cuBLAS)
  CB(cublasCreate(&H));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
  printf("device %s\n", prop.name);
  std::vector<Case> cases;
  if (!bench) {
    for (int kind = 0; kind < 3; ++kind) {
      cases.push_back({"even", kind, {256, 256, 256}, 384, 512, 0.f, kind == 2});
      cases.push_back({"ragged", kind, {100, 0, 257, 1, 64, 130}, 200, 136, 0.f, kind == 2});
      cases.push_back({"single", kind, {77}, 1032, 264, 0.f, kind == 2});
      // forward/dgrad wide tail tiles (64 x 256; 282 rows per group on average) with an odd number of n-tiles: the
      // second half of the last one lies past N (forward N = 328: 3 n-tiles; dgrad N = 392: 4); groups below 64
      // rows, just above 128, and one whose tail (88 rows) stays a 128-row tile
      cases.push_back({"wide tails", kind, {40, 300, 600, 5, 129, 0, 900}, 328, 392, 0.f, kind == 2});
    }
    cases.push_back({"wgrad beta1 f32", 2, {100, 0, 257, 1, 64, 130}, 200, 136, 1.f, true});
    cases.push_back({"wgrad beta0.5 bf16", 2, {190, 3, 0, 257}, 264, 392, 0.5f, false});
    cases.push_back({"wgrad bf16 beta0", 2, {128, 64, 65}, 256, 128, 0.f, false});
    // beta 1 f32 from 256 rows per group (the staged box in four parts), several tiles per CTA, uneven groups
    cases.push_back({"wgrad staged 4 parts", 2, {600, 0, 513, 400, 1, 700, 350, 90}, 1032, 776, 1.f, true});
    // beta 1 f32, every group at most 256 rows (the staged box as the accumulators' start), several tiles per CTA
    cases.push_back({"wgrad staged init", 2, {200, 0, 256, 1, 130, 64, 255, 90, 17, 256}, 1032, 776, 1.f, true});
    std::vector<int64_t> many(64); for (int i = 0; i < 64; ++i) many[i] = (i * 37) % 50; 
    for (int kind = 0; kind < 3; ++kind) cases.push_back({"64 groups", kind, many, 2816 / 4, 512, 1.f, kind == 2});
  } else {
    auto even = [](int g, int64_t rows) { return std::vector<int64_t>(g, rows / g); };
    // megacore_bench_moe's "imbalanced" split: fixed-seed shares from 0.25x to 2.5x of even, expert 1 empty.
    auto imbalanced = [](int g, int64_t rows) {
      std::mt19937_64 rng(1234);
      std::uniform_real_distribution<double> u(0.25, 2.5);
      std::vector<double> w(g);
      for (auto& v : w) v = u(rng);
      w[1] = 0.0;
      double total = 0;
      for (double v : w) total += v;
      std::vector<int64_t> sizes(g);
      int64_t used = 0;
      for (int e = 0; e < g; ++e) used += (sizes[e] = int64_t(double(rows) * w[e] / total));
      sizes[0] += rows - used;
      return sizes;
    };
    struct S { const char* m; int g; int64_t rows, mo, k; };
    // `bench`: the shapes of the MoE models; `bench2`: megacore_bench_moe's rows below 85 % of attainable
    // (Mixtral wgrad at 1024 rows per expert, fine-grained experts from 128 rows per expert) and 64 fine-grained
    // experts at 32 and 64 rows per expert, even and imbalanced.
    const bool b2 = std::string(argv[1]) == "bench2";
    const std::vector<S> shapes = b2 ? std::vector<S>{
        S{"mixtral fc1", 8, 8192, 28672, 4096}, S{"mixtral fc2", 8, 8192, 4096, 14336},
        S{"fine128 fc1 128", 128, 16384, 2816, 2048}, S{"fine128 fc2 128", 128, 16384, 2048, 1408},
        S{"fine128 fc1 256", 128, 32768, 2816, 2048}, S{"fine128 fc2 256", 128, 32768, 2048, 1408},
        S{"fine128 fc1 512", 128, 65536, 2816, 2048}, S{"fine128 fc2 512", 128, 65536, 2048, 1408},
        S{"fine64 fc1 32", 64, 2048, 2816, 2048}, S{"fine64 fc2 64", 64, 4096, 2048, 1408}}
      : std::vector<S>{S{"mixtral fc1", 8, 8192, 28672, 4096}, S{"mixtral fc2", 8, 8192, 4096, 14336}, S{"mixtral fc1 16k", 8, 16384, 28672, 4096},
                S{"1.1b-moe fc1", 8, 8192, 11264, 2048}, S{"fine64 fc1", 64, 4096, 2816, 2048}, S{"fine64 fc2", 64, 8192, 2048, 1408},
                S{"fine128 fc1", 128, 16384, 2816, 2048}, S{"fine64 fc1 512", 64, 32768, 2816, 2048}, S{"1.1b fc2", 8, 8192, 2048, 5632}};
    for (S s : shapes)
      for (int imb = 0; imb < (b2 ? 2 : 1); ++imb)
        for (int kind = 0; kind < 3; ++kind)
          cases.push_back({std::string(s.m) + (imb ? " imb" : ""), kind, imb ? imbalanced(s.g, s.rows) : even(s.g, s.rows),
                           s.mo, s.k, 1.f, kind == 2});
  }
  int fails = 0;
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    if (only >= 0 && int(ci) != only) continue;
    if (kinds != nullptr && std::string(kinds).find(char('0' + c.kind)) == std::string::npos) continue;
    printf("case %zu %s kind %d\n", ci, c.name.c_str(), c.kind);
    const int G = int(c.sizes.size());
    std::vector<int64_t> off(G + 1, 0); for (int g = 0; g < G; ++g) off[g + 1] = off[g] + c.sizes[g];
    const int64_t rows = off[G], mo = c.mo, k = c.k;
    const int64_t na = c.kind == 0 ? rows * k : rows * mo;
    const int64_t nb = c.kind == 2 ? rows * k : int64_t(G) * mo * k;
    const int64_t nout = c.kind == 2 ? int64_t(G) * mo * k : rows * (c.kind == 0 ? mo : k);
    __nv_bfloat16 *a, *b; void* out; float *ref, *init; int64_t* doff;
    CK(cudaMalloc(&a, std::max<int64_t>(na, 1) * 2)); CK(cudaMalloc(&b, std::max<int64_t>(nb, 1) * 2));
    CK(cudaMalloc(&out, nout * 4)); CK(cudaMalloc(&ref, nout * 4)); CK(cudaMalloc(&init, nout * 4)); CK(cudaMalloc(&doff, (G + 1) * 8));
    fill<<<512, 256>>>(a, na, 1u); fill<<<512, 256>>>(b, nb, 2u); fillf<<<512, 256>>>(init, nout, 3u);
    CK(cudaMemcpy(doff, off.data(), (G + 1) * 8, cudaMemcpyHostToDevice));
    GroupedSm90 p; p.kind = GroupedSm90::Kind(c.kind); p.out_f32 = c.f32; p.groups = G; p.rows = rows; p.mo = mo; p.k = k;
    p.a = a; p.b = b; p.out = out; p.offsets = off.data(); p.beta = c.kind == 2 ? c.beta : 0.f;
    const char* why = grouped_sm90_unsupported(p, 0);
    if (why) { printf("%s kind %d unsupported: %s\n", c.name.c_str(), c.kind, why); fails++; continue; }
    auto init_out = [&] {  // out := init (f32) or bf16(init)
      if (c.f32) CK(cudaMemcpy(out, init, nout * 4, cudaMemcpyDeviceToDevice));
      else { std::vector<float> h(nout); CK(cudaMemcpy(h.data(), init, nout * 4, cudaMemcpyDeviceToHost));
             std::vector<__nv_bfloat16> hb(nout); for (int64_t i = 0; i < nout; ++i) hb[i] = __float2bfloat16(h[i]);
             // make init exactly the bf16 value for the reference
             for (int64_t i = 0; i < nout; ++i) h[i] = __bfloat162float(hb[i]);
             CK(cudaMemcpy(init, h.data(), nout * 4, cudaMemcpyHostToDevice));
             CK(cudaMemcpy(out, hb.data(), nout * 2, cudaMemcpyHostToDevice)); }
    };
    const double flops = 2.0 * double(rows) * double(mo) * double(k);
    if (!bench) {
      unsigned long long* bad; float* me; CK(cudaMallocManaged(&bad, 8)); CK(cudaMallocManaged(&me, 4));
      for (int epi = -1; epi <= (c.kind == 2 ? 2 : -1); ++epi) {
      p.epilogue = epi;
      init_out();
      ref_kernel<<<1024, 256>>>(c.kind, a, b, doff, G, rows, mo, k, p.beta, init, ref);
      CK(cudaGetLastError());
      int rc = grouped_sm90(p, 0, nullptr);
      CK(cudaError_t(rc)); CK(cudaDeviceSynchronize());
      *bad = 0; *me = 0;
      const float kred = float(c.kind == 0 ? k : c.kind == 1 ? mo : 300);
      compare<<<512, 256>>>(out, c.f32, ref, nout, c.f32 ? 1e-5f : 8e-3f, c.f32 ? 1e-4f * sqrtf(kred) : 1e-2f, bad, me);
      CK(cudaDeviceSynchronize());
      printf("%-20s kind %d epi %2d G %3d rows %6ld mo %5ld k %5ld beta %.1f %s: %s (bad %llu / %ld, max err %.3g)\n", c.name.c_str(), c.kind, epi, G, (long)rows,
             (long)mo, (long)k, p.beta, c.f32 ? "f32" : "bf16", *bad ? "FAIL" : "ok", *bad, (long)nout, *me);
      fails += *bad != 0;
      }
      p.epilogue = -1;
      const float kred = float(c.kind == 0 ? k : c.kind == 1 ? mo : 300);
      // also check cuBLAS group path agrees with the reference (validates the harness's cuBLAS calls)
      init_out();
      for (int g = 0; g < G; ++g) if (off[g + 1] > off[g]) cublas_group(c.kind, a, b, out, c.f32, off[g], off[g + 1] - off[g], g, mo, k, p.beta);
      CK(cudaDeviceSynchronize());
      *bad = 0; *me = 0;
      compare<<<512, 256>>>(out, c.f32, ref, nout, c.f32 ? 1e-5f : 8e-3f, c.f32 ? 1e-4f * sqrtf(kred) : 1e-2f, bad, me);
      CK(cudaDeviceSynchronize());
      if (c.kind != 2 || c.beta == 0.f || true) if (*bad) printf("   (cuBLAS loop disagrees with the reference too: bad %llu) \n", *bad);
    } else {
      if (c.f32) init_out();
      const int iters = getenv("GG_ITERS") ? atoi(getenv("GG_ITERS")) : 10;  // GG_ITERS=1 under ncu
      const float t_k = time_ms([&] { CK(cudaError_t(grouped_sm90(p, 0, nullptr))); }, iters);
      if (fast) {
        printf("%-20s kind %d rows %6ld mo %5ld k %5ld: sm90 %.3f ms %.0f TF\n", c.name.c_str(), c.kind, (long)rows,
               (long)mo, (long)k, t_k, flops / t_k / 1e9);
        cudaFree(a); cudaFree(b); cudaFree(out); cudaFree(ref); cudaFree(init); cudaFree(doff);
        continue;
      }
      if (c.kind == 2) {
        float te[3], tz[2];
        for (int epi = 0; epi < 3; ++epi) { p.epilogue = epi; te[epi] = time_ms([&] { CK(cudaError_t(grouped_sm90(p, 0, nullptr))); }, iters); }
        // beta 0 (dw written, not read): from registers and by TMA store; what the main loop costs without the read
        p.beta = 0.f;
        for (int epi = 0; epi < 2; ++epi) { p.epilogue = epi; tz[epi] = time_ms([&] { CK(cudaError_t(grouped_sm90(p, 0, nullptr))); }, iters); }
        p.beta = c.beta, p.epilogue = -1;
        printf("   wgrad epilogues, beta 1: registers %.3f ms, TMA reduce-add %.3f ms, staged %.3f ms (min bytes at 4.18 TB/s: %.3f ms); "
               "beta 0: registers %.3f ms, TMA store %.3f ms\n", te[0], te[1], te[2],
               (double(G) * mo * k * 8.0 + 2.0 * rows * (mo + k)) / 4.18e12 * 1e3, tz[0], tz[1]);
      }
      const float t_l = time_ms([&] { for (int g = 0; g < G; ++g) cublas_group(c.kind, a, b, out, c.f32, off[g], off[g + 1] - off[g], g, mo, k, p.beta); }, iters);
      // dense of the same FLOPs: one group of all rows (expert 0's weight)
      const float t_d = time_ms([&] {
        if (c.kind == 2) cublas_group(2, a, b, out, c.f32, 0, rows, 0, mo, k, p.beta);
        else cublas_group(c.kind, a, b, out, false, 0, rows, 0, mo, k, 0.f); }, iters);
      // wgrad: a dense GEMM of the same FLOPs and the same output (dw of every group as one [G mo, k] f32 main grad,
      // beta 1, reduced over rows / G rows): the same bytes to read and write as the grouped op, without groups
      float t_ds = 0.f;
      if (c.kind == 2 && c.f32 && rows % G == 0)
        t_ds = time_ms([&] { cublas_group(2, a, b, out, true, 0, rows / G, 0, int64_t(G) * mo, k, p.beta); }, iters);
      const char* kn[3] = {"fwd", "dgrad", "wgrad"};
      // attainable = max(dense time, memory roofline of the bytes the problem must move at 4.18 TB/s, the
      // H200's measured copy bandwidth), as megacore_bench_moe reports it
      const double wbytes = double(G) * mo * k * (c.kind == 2 ? 8.0 : 2.0), iobytes = 2.0 * rows * (mo + k);
      const double t_roof = (wbytes + iobytes) / 4.18e12 * 1e3, t_att = std::max(double(t_d), t_roof);
      printf("%-20s %-5s rows %6ld mo %5ld k %5ld: sm90 %.3f ms %.0f TF | loop %.3f ms | dense %.3f ms %.0f TF | roof %.3f | sm90/att %.2f sm90/loop %.2f\n",
             c.name.c_str(), kn[c.kind], (long)rows, (long)mo, (long)k, t_k, flops / t_k / 1e9, t_l, t_d, flops / t_d / 1e9,
             t_roof, t_att / t_k, t_l / t_k);
      if (t_ds > 0.f)
        printf("   dense of the same output (one [%ld, %ld] f32 main grad, %ld rows): %.3f ms %.0f TF | sm90/that %.2f\n",
               (long)(G * mo), (long)k, (long)(rows / G), t_ds, flops / t_ds / 1e9, t_ds / t_k);
    }
    cudaFree(a); cudaFree(b); cudaFree(out); cudaFree(ref); cudaFree(init); cudaFree(doff);
  }
  printf("%s: %d failing cases\n", bench ? "bench" : "check", fails);
  return fails ? 1 : 0;
}
