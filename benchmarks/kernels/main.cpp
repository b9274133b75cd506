// megacore_bench_kernels: measures the card's own ceilings (device-to-device copy, bf16 GEMM through
// cuBLASLt), then every registered benchmark, and writes one JSON file with the card's name.
//
//   megacore_bench_kernels [--quick] [--no-variants] [--filter SUBSTR[,SUBSTR...]] [--out PATH] [--peers torch_peers.json]
//
// Ops with launch-shape variants (norms, cross-entropy) record the library's default first, then each
// variant as a row with the same op and shape and a "variant" field; --no-variants skips them.
// --peers folds in the torch eager / torch.compile timings that torch_peers.py measured on the same
// card in the same job; rows are matched on (op, shape).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/bench.hpp"

namespace mcbench {

std::vector<Entry>& registry() {
  static std::vector<Entry> r;
  return r;
}

namespace {
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void lt_ok(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(int(s)));
}
}  // namespace

namespace {
// Calls per sample so that a sample lasts about 2 ms (1 to 10): one call, timed alone, decides.
int burst_for(const std::function<void()>& fn, cudaEvent_t a, cudaEvent_t b) {
  cuda_ok(cudaEventRecord(a, nullptr), "record");
  fn();
  cuda_ok(cudaEventRecord(b, nullptr), "record");
  cuda_ok(cudaEventSynchronize(b), "sync");
  float ms = 0;
  cuda_ok(cudaEventElapsedTime(&ms, a, b), "elapsed");
  const int n = ms > 0.f ? int(2.0f / ms) : 10;
  return n < 1 ? 1 : n > 10 ? 10 : n;
}
}  // namespace

double time_ms(const std::function<void()>& fn, int warmup, int samples, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  cuda_ok(cudaGetLastError(), "warm-up");
  cudaEvent_t a, b;
  cuda_ok(cudaEventCreate(&a), "event");
  cuda_ok(cudaEventCreate(&b), "event");
  if (iters <= 0) iters = burst_for(fn, a, b);
  std::vector<double> t;
  for (int s = 0; s < samples; ++s) {
    cuda_ok(cudaEventRecord(a, nullptr), "record");
    for (int i = 0; i < iters; ++i) fn();
    cuda_ok(cudaEventRecord(b, nullptr), "record");
    cuda_ok(cudaEventSynchronize(b), "sync");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, a, b), "elapsed");
    t.push_back(double(ms) / iters);
  }
  cuda_ok(cudaGetLastError(), "timed runs");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

namespace {

double measure_copy_tbps(bool quick) {
  const size_t bytes = size_t(quick ? 1 : 2) << 30;
  void *src = nullptr, *dst = nullptr;
  cuda_ok(cudaMalloc(&src, bytes), "cudaMalloc");
  cuda_ok(cudaMalloc(&dst, bytes), "cudaMalloc");
  cuda_ok(cudaMemset(src, 0x3c, bytes), "memset");
  const double ms = time_ms([&] { cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr), "copy"); },
                            3, quick ? 10 : 30);
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * double(bytes) / (ms * 1e-3) / 1e12;
}

__attribute__((unused)) void fill_random_bf16(void* p, size_t n) {
  // Host-generated random bf16 values (never time on zeros).
  std::vector<uint16_t> h(n);
  uint32_t x = 12345;
  for (auto& e : h) {
    x = x * 1664525u + 1013904223u;
    float f = (float((x >> 8) & 0xffff) / 65536.f - 0.5f);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    e = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  cuda_ok(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice), "H2D");
}

double measure_gemm_tflops(bool quick) {
  const int64_t m = 8192, n = 8192, k = 8192;
  void *a, *b, *c, *ws;
  const size_t ws_bytes = size_t(64) << 20;
  cuda_ok(cudaMalloc(&a, m * k * 2), "cudaMalloc");
  cuda_ok(cudaMalloc(&b, k * n * 2), "cudaMalloc");
  cuda_ok(cudaMalloc(&c, m * n * 2), "cudaMalloc");
  cuda_ok(cudaMalloc(&ws, ws_bytes), "cudaMalloc");
  fill_random_bf16(a, size_t(m * k));
  fill_random_bf16(b, size_t(k * n));
  cublasLtHandle_t lt;
  lt_ok(cublasLtCreate(&lt), "cublasLtCreate");
  cublasLtMatmulDesc_t op;
  lt_ok(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;  // the layout of a transformer's y = x W^T
  lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "transa");
  lt_ok(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "transb");
  cublasLtMatrixLayout_t la, lb, lc;
  lt_ok(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, m, k), "layout");
  lt_ok(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, k), "layout");
  lt_ok(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, m, n, m), "layout");
  cublasLtMatmulPreference_t pref;
  lt_ok(cublasLtMatmulPreferenceCreate(&pref), "pref");
  lt_ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)),
        "pref ws");
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  lt_ok(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heur, &found), "heuristic");
  if (found == 0) throw std::runtime_error("cuBLASLt found no bf16 GEMM algorithm");
  const float alpha = 1.f, beta = 0.f;
  const double ms = time_ms(
      [&] {
        lt_ok(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, c, lc, c, lc, &heur.algo, ws, ws_bytes, nullptr),
              "matmul");
      },
      5, quick ? 10 : 30);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cudaFree(ws);
  return 2.0 * double(m) * double(n) * double(k) / (ms * 1e-3) / 1e12;
}

std::string sanitize(std::string s) {
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

std::string fmt_num(double v, int prec) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", prec, v);
  return buf;
}

}  // namespace
}  // namespace mcbench

int main(int argc, char** argv) {
  using namespace mcbench;
  std::string out_path, filter, peers_path;
  bool quick = false, variants = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--quick") quick = true;
    else if (a == "--no-variants") variants = false;
    else if (a == "--filter") filter = next();
    else if (a == "--out") out_path = next();
    else if (a == "--peers") peers_path = next();
    else if (a == "--help" || a == "-h") {
      std::puts("megacore_bench_kernels [--quick] [--no-variants] [--filter SUBSTR[,SUBSTR...]] [--out PATH] [--peers torch_peers.json]");
      return 0;
    } else {
      std::fprintf(stderr, "unknown argument %s (try --help)\n", a.c_str());
      return 2;
    }
  }
  try {
    cudaDeviceProp prop{};
    cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    Context ctx;
    ctx.card = prop.name;
    ctx.quick = quick;
    ctx.variants = variants;
    std::printf("card: %s (%d SMs, L2 %d MiB)\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
    ctx.copy_tbps = measure_copy_tbps(quick);
    std::printf("ceiling: device-to-device copy %.3f TB/s (read + write)\n", ctx.copy_tbps);
    ctx.gemm_bf16_tflops = measure_gemm_tflops(quick);
    std::printf("ceiling: cuBLASLt bf16 GEMM 8192^3 %.1f TFLOP/s\n", ctx.gemm_bf16_tflops);

    auto& reg = registry();
    std::stable_sort(reg.begin(), reg.end(), [](const Entry& a, const Entry& b) { return a.order < b.order; });
    for (auto& e : reg) {
      if (!filter.empty()) {  // comma-separated substrings of the benchmark names; any one selects
        bool hit = false;
        for (size_t a = 0; a <= filter.size();) {
          const size_t b = std::min(filter.find(',', a), filter.size());
          const std::string part = filter.substr(a, b - a);
          if (!part.empty() && e.name.find(part) != std::string::npos) hit = true;
          a = b + 1;
        }
        if (!hit) continue;
      }
      std::printf("running %s ...\n", e.name.c_str());
      std::fflush(stdout);
      try {
        e.fn(ctx);
      } catch (const std::exception& ex) {
        std::printf("  %s failed: %s\n", e.name.c_str(), ex.what());
        ctx.record({{"op", e.name}, {"error", ex.what()}});
      }
    }

    // Fold in torch peers measured in the same job.
    std::map<std::string, nlohmann::json> peers;
    std::string peers_card;
    if (!peers_path.empty()) {
      std::ifstream f(peers_path);
      if (f) {
        nlohmann::json pj = nlohmann::json::parse(f);
        peers_card = pj.value("card", "");
        for (auto& r : pj["results"]) peers[r.value("op", "") + "|" + r.value("shape", "")] = r;
      } else {
        std::printf("note: peers file %s not found; no torch peers in this run\n", peers_path.c_str());
      }
    }
    for (auto& r : ctx.results) {
      if (r.contains("variant") && r["variant"] != "default") continue;  // peers sit with the default
      auto it = peers.find(r.value("op", "") + "|" + r.value("shape", ""));
      if (it == peers.end()) continue;
      for (const char* k : {"eager_ms", "compile_ms"})
        if (it->second.contains(k)) r[std::string("torch_") + k] = it->second[k];
    }

    // Memory-bound rows carry tbps (against the copy ceiling); compute-bound rows (GEMM, attention)
    // carry a *tflops figure (against the GEMM ceiling) and may name their own peer.
    std::printf("\n%-24s %-34s %9s %12s %8s  %s\n", "op", "shape", "ms", "rate", "%ceiling", "peers (ms)");
    for (auto& r : ctx.results) {
      if (r.contains("error")) {
        std::printf("%-24s ERROR %s\n", r.value("op", "").c_str(), r.value("error", "").c_str());
        continue;
      }
      std::string rate = "-", frac = "-";
      if (r.contains("tbps")) {
        rate = fmt_num(r["tbps"].get<double>(), 3) + " TB/s";
        frac = fmt_num(100.0 * r.value("frac_copy", 0.0), 1) + "%";
      } else {
        for (auto it = r.begin(); it != r.end(); ++it) {
          const std::string k = it.key();
          if (k.size() > 6 && k.compare(k.size() - 6, 6, "tflops") == 0 && it->is_number()) {
            rate = fmt_num(it->get<double>(), 1) + " TF/s";
            frac = fmt_num(100.0 * it->get<double>() / ctx.gemm_bf16_tflops, 1) + "%";
          }
        }
      }
      std::string peers_txt;
      for (auto it = r.begin(); it != r.end(); ++it) {
        const std::string k = it.key();
        if (k.size() > 3 && k.compare(k.size() - 3, 3, "_ms") == 0 && k != "fwd_ms" && k != "fwdbwd_ms" && it->is_number())
          peers_txt += k.substr(0, k.size() - 3) + "=" + fmt_num(it->get<double>(), 4) + " ";
      }
      std::string shape = r.value("shape", "");
      if (r.contains("variant") && r["variant"] != "default") shape += " [" + r.value("variant", "") + "]";
      std::printf("%-24s %-34s %9.4f %12s %8s  %s\n", r.value("op", "").c_str(), shape.c_str(),
                  r.value("ms", 0.0), rate.c_str(), frac.c_str(), peers_txt.c_str());
    }

    nlohmann::json doc = {{"card", ctx.card},
                          {"copy_tbps", ctx.copy_tbps},
                          {"gemm_bf16_tflops", ctx.gemm_bf16_tflops},
                          {"quick", quick},
                          {"peers_card", peers_card},
                          {"results", ctx.results}};
    if (out_path.empty()) out_path = "benchmarks/results/kernels_" + sanitize(ctx.card) + ".json";
    std::ofstream of(out_path);
    if (!of) throw std::runtime_error("cannot write " + out_path);
    of << doc.dump(2) << "\n";
    std::printf("\nwrote %s\n", out_path.c_str());
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "megacore_bench_kernels: %s\n", ex.what());
    return 1;
  }
  return 0;
}
