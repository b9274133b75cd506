// Step profile of any CUDA program, loaded with LD_PRELOAD (built as libmegacore_step_profile.so when CUDA and
// CUPTI are found). It records every kernel, memcpy and memset through CUPTI's activity API (what Nsight Systems
// records) and, at exit, prints where the GPU time went by category and by kernel, and writes a JSON:
//
//   mpirun -np 1 -x MEGACORE_PROFILE_OUT=profile.json -x MEGACORE_PROFILE_STEPS=10 \
//     -x LD_PRELOAD=build/benchmarks/libmegacore_step_profile.so \
//     build/benchmarks/megacore_bench_training --single --profile-steps 10
//
// Window: activity between cudaProfilerStart and cudaProfilerStop (megacore_bench_training --profile-steps,
// or the trainer's MEGACORE_PROFILE_STEPS=first:last) is counted; a program that never calls them is counted
// from MEGACORE_PROFILE_FROM (a fraction of its GPU timeline, default 0.5) to the end.
// MEGACORE_PROFILE_STEPS divides the totals into per-step figures.
//
// Categories by kernel name (first match): attention (cuDNN SDPA / flash / fmha kernels), gemm (cuBLAS(Lt)
// nvjet / cutlass / gemm kernels), communication (NCCL), optimizer (AdamW / SGD / norm of gradients),
// cross_entropy, norm (RMSNorm / LayerNorm), elementwise (activations, RoPE, copies, fills, casts, embedding,
// dropout, memset, memcpy), other. busy = the union of all intervals; idle = window − busy (the GPU had no
// work queued: host time, launch latency, syncs). Categories overlap when streams run concurrently
// (communication under compute), so their sum can exceed busy.
#include <cupti.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

struct Interval {
  uint64_t start, end;
  std::string name;
};

std::mutex g_mu;
std::vector<Interval>* g_recs = new std::vector<Interval>();  // leaked on purpose: used at exit
std::vector<std::pair<uint64_t, uint64_t>>* g_windows = new std::vector<std::pair<uint64_t, uint64_t>>();
uint64_t g_open = 0;

void CUPTIAPI buffer_requested(uint8_t** buf, size_t* size, size_t* max_records) {
  *size = 8 << 20;
  *buf = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buf, size_t, size_t valid) {
  CUpti_Activity* r = nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      auto* k = reinterpret_cast<CUpti_ActivityKernel9*>(r);
      g_recs->push_back({k->start, k->end, k->name ? k->name : "?"});
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      auto* m = reinterpret_cast<CUpti_ActivityMemcpy5*>(r);
      g_recs->push_back({m->start, m->end, "memcpy (kind " + std::to_string(m->copyKind) + ")"});
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(r);
      g_recs->push_back({m->start, m->end, "memset"});
    }
  }
  std::free(buf);
}

void CUPTIAPI on_api(void*, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void* data) {
  if (domain != CUPTI_CB_DOMAIN_RUNTIME_API) return;
  auto* info = static_cast<const CUpti_CallbackData*>(data);
  if (info->callbackSite != CUPTI_API_EXIT) return;
  uint64_t now = 0;
  cuptiGetTimestamp(&now);
  std::lock_guard<std::mutex> lock(g_mu);
  if (id == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000) g_open = now;
  if (id == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000 && g_open) {
    g_windows->push_back({g_open, now});
    g_open = 0;
  }
}

bool has(const std::string& s, const char* sub) {
  std::string a = s, b = sub;
  std::transform(a.begin(), a.end(), a.begin(), ::tolower);
  return a.find(b) != std::string::npos;
}

const char* category(const std::string& n) {
  for (const char* k : {"sdpa", "flash", "fmha", "attention", "dot_do_o", "convert_dq"})
    if (has(n, k)) return "attention";
  for (const char* k : {"nccl"})
    if (has(n, k)) return "communication";
  for (const char* k : {"nvjet", "gemm", "cutlass", "xmma", "splitkreduce", "gemv"})
    if (has(n, k)) return "gemm";
  for (const char* k : {"adamw", "sgd_kernel", "l2norm", "optimizer"})
    if (has(n, k)) return "optimizer";
  for (const char* k : {"cross_entropy", "loss_from_stats"})
    if (has(n, k)) return "cross_entropy";
  for (const char* k : {"norm_"})
    if (has(n, k)) return "norm";
  for (const char* k : {"swiglu", "gelu", "activation", "rope", "copy", "fill", "cast", "embed", "dropout", "memset",
                        "memcpy", "elementwise", "scale", "segment_sum", "counting_sort"})
    if (has(n, k)) return "elementwise";
  return "other";
}

void json_string(FILE* f, const std::string& s) {
  std::fputc('"', f);
  for (char c : s) {
    if (c == '"' || c == '\\') std::fputc('\\', f);
    if (static_cast<unsigned char>(c) >= 0x20) std::fputc(c, f);
  }
  std::fputc('"', f);
}

struct Profiler {
  Profiler() {
    cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
    CUpti_SubscriberHandle sub;
    if (cuptiSubscribe(&sub, reinterpret_cast<CUpti_CallbackFunc>(on_api), nullptr) == CUPTI_SUCCESS) {
      cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000);
      cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000);
    }
  }
  ~Profiler() {
    cuptiActivityFlushAll(1);
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_recs->empty()) return;
    std::sort(g_recs->begin(), g_recs->end(), [](const Interval& a, const Interval& b) { return a.start < b.start; });
    std::vector<std::pair<uint64_t, uint64_t>> windows = *g_windows;
    const char* source = "cudaProfilerStart/Stop";
    if (windows.empty()) {
      uint64_t t0 = g_recs->front().start, t1 = 0;
      for (const Interval& r : *g_recs) t1 = std::max(t1, r.end);
      const char* f = std::getenv("MEGACORE_PROFILE_FROM");
      const double from = f ? std::atof(f) : 0.5;
      windows.push_back({t0 + uint64_t(from * double(t1 - t0)), t1});
      source = "MEGACORE_PROFILE_FROM";
    }
    const char* st = std::getenv("MEGACORE_PROFILE_STEPS");
    const double steps = st && std::atof(st) > 0 ? std::atof(st) : 1.0;
    // Clip every interval to the windows; accumulate per name and the union (busy).
    std::map<std::string, std::pair<double, long>> per_name;
    std::map<std::string, double> per_cat;
    double busy = 0, window_ms = 0;
    for (const auto& [ws, we] : windows) {
      window_ms += double(we - ws) * 1e-6;
      uint64_t cs = 0, ce = 0;
      for (const Interval& r : *g_recs) {
        const uint64_t s = std::max(r.start, ws), e = std::min(r.end, we);
        if (s >= e) continue;
        const double ms = double(e - s) * 1e-6;
        auto& pn = per_name[r.name.substr(0, 160)];
        pn.first += ms, pn.second += 1;
        per_cat[category(r.name)] += ms;
        if (s > ce) {
          busy += double(ce - cs) * 1e-6;
          cs = s, ce = e;
        } else {
          ce = std::max(ce, e);
        }
      }
      busy += double(ce - cs) * 1e-6;
    }
    std::vector<std::pair<std::string, std::pair<double, long>>> names(per_name.begin(), per_name.end());
    std::sort(names.begin(), names.end(), [](auto& a, auto& b) { return a.second.first > b.second.first; });
    std::fprintf(stderr, "step profile (%s, %zu window(s), per step of %g): window %.2f ms, GPU busy %.2f ms, idle %.2f ms\n",
                 source, windows.size(), steps, window_ms / steps, busy / steps, (window_ms - busy) / steps);
    for (const auto& [c, ms] : per_cat)
      std::fprintf(stderr, "  %-14s %9.3f ms/step %5.1f%% of the window\n", c.c_str(), ms / steps, 100 * ms / window_ms);
    for (size_t i = 0; i < names.size() && i < 25; ++i)
      std::fprintf(stderr, "  %9.3f ms/step %6ld  %.110s\n", names[i].second.first / steps, names[i].second.second,
                   names[i].first.c_str());
    const char* out = std::getenv("MEGACORE_PROFILE_OUT");
    if (!out) return;
    FILE* f = std::fopen(out, "w");
    if (!f) return;
    std::fprintf(f, "{\"window_source\": \"%s\", \"windows\": %zu, \"steps\": %g, \"window_ms_per_step\": %.4f, "
                 "\"busy_ms_per_step\": %.4f, \"idle_ms_per_step\": %.4f, \"categories_ms_per_step\": {",
                 source, windows.size(), steps, window_ms / steps, busy / steps, (window_ms - busy) / steps);
    bool first = true;
    for (const auto& [c, ms] : per_cat) {
      std::fprintf(f, "%s\"%s\": %.4f", first ? "" : ", ", c.c_str(), ms / steps);
      first = false;
    }
    std::fprintf(f, "}, \"kernels\": [");
    for (size_t i = 0; i < names.size() && i < 60; ++i) {
      std::fprintf(f, "%s{\"name\": ", i ? ", " : "");
      json_string(f, names[i].first);
      std::fprintf(f, ", \"category\": \"%s\", \"ms_per_step\": %.4f, \"calls\": %ld}", category(names[i].first),
                   names[i].second.first / steps, names[i].second.second);
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
};

Profiler g_profiler;

}  // namespace
