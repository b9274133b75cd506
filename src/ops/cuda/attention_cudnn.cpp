// cuDNN fused SDPA through the cudnn-frontend graph API. Building a graph (heuristics, kernel
// compilation) takes milliseconds to seconds, so graphs are cached by everything that shapes them:
// device, direction, dtype, sizes, strides, mask, scale and determinism.
#include "megacore/build_config.hpp"
#include "megacore/ops/attention.hpp"
#include "ops/cuda/attention_cuda.hpp"

#include <fmt/format.h>

#include "megacore/core/error.hpp"

#if MEGACORE_WITH_CUDNN && defined(MEGACORE_WITH_CUDNN_FRONTEND)
#include <cudnn_frontend.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "core/cuda/cuda_check.hpp"
#include "megacore/core/allocator.hpp"
#include "megacore/core/stream.hpp"

namespace megacore::ops::cuda {
namespace {

namespace fe = cudnn_frontend;

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV };

struct Entry {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
  std::string error;  // non-empty: cuDNN cannot run this configuration
  bool tune = false;  // every plan was built; the first run times them and keeps the fastest
};

// One cuDNN handle per device; a handle is bound to one stream at a time, so calls on a device are
// serialised (enqueueing only; the kernels themselves run asynchronously).
struct DeviceState {
  std::mutex mu;
  cudnnHandle_t handle = nullptr;
  std::unordered_map<std::string, std::shared_ptr<Entry>> graphs;
};

DeviceState& state(int device) {
  static std::mutex mu;
  static auto* states = new std::unordered_map<int, std::unique_ptr<DeviceState>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& s = (*states)[device];
  if (!s) s = std::make_unique<DeviceState>();
  return *s;
}

void check_cudnn(cudnnStatus_t st, const char* what) {
  if (st != CUDNN_STATUS_SUCCESS) raise<CudaError>("{} failed: {}", what, cudnnGetErrorString(st));
}

std::string key_of(const AttnProblem& p, bool backward) {
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &p.scale, 4);
  auto strides = [](const AttnTensor& t) { return fmt::format("{},{},{}", t.batch_stride, t.row_stride, t.head_stride); };
  return fmt::format("{}|{}|{}|{},{},{},{},{},{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{:x}|{}|{}", backward ? "b" : "f",
                     int(p.dtype), p.cu_q ? 1 : 0, p.batch, p.heads, p.kv_heads, p.head_dim, p.seqlen_q, p.seqlen_kv,
                     strides(p.q), strides(p.k), strides(p.v), strides(p.o), backward ? strides(p.dout) : "",
                     backward ? strides(p.dq) : "", backward ? strides(p.dk) : "", backward ? strides(p.dv) : "",
                     p.causal, scale_bits, backward && p.deterministic, cudnn_attention_autotune());
}

std::vector<int64_t> dims(int64_t b, int64_t h, int64_t s, int64_t d) { return {b, h, s, d}; }
std::vector<int64_t> strides_of(const AttnTensor& t) { return {t.batch_stride, t.head_stride, t.row_stride, 1}; }

std::shared_ptr<Entry> build(const AttnProblem& p, bool backward, cudnnHandle_t handle) {
  auto e = std::make_shared<Entry>();
  auto g = std::make_shared<fe::graph::Graph>();
  const auto io = p.dtype == DType::BF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
  g->set_io_data_type(io).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
  using TA = fe::graph::Tensor_attributes;
  const int64_t B = p.batch, H = p.heads, Hk = p.kv_heads, Sq = p.seqlen_q, Sk = p.seqlen_kv, D = p.head_dim;
  auto Q = g->tensor(TA().set_name("Q").set_uid(kQ).set_dim(dims(B, H, Sq, D)).set_stride(strides_of(p.q)));
  auto K = g->tensor(TA().set_name("K").set_uid(kK).set_dim(dims(B, Hk, Sk, D)).set_stride(strides_of(p.k)));
  auto V = g->tensor(TA().set_name("V").set_uid(kV).set_dim(dims(B, Hk, Sk, D)).set_stride(strides_of(p.v)));
  const std::vector<int64_t> stats_dims{B, H, Sq, 1}, stats_strides{H * Sq, Sq, 1, 1};
  if (!backward) {
    auto opts = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(p.scale);
    if (p.causal) opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
    auto [O, stats] = g->sdpa(Q, K, V, opts);
    O->set_output(true).set_uid(kO).set_dim(dims(B, H, Sq, D)).set_stride(strides_of(p.o));
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim(stats_dims).set_stride(
        stats_strides);
  } else {
    auto O = g->tensor(TA().set_name("O").set_uid(kO).set_dim(dims(B, H, Sq, D)).set_stride(strides_of(p.o)));
    auto dO = g->tensor(TA().set_name("dO").set_uid(kdO).set_dim(dims(B, H, Sq, D)).set_stride(strides_of(p.dout)));
    auto stats = g->tensor(TA().set_name("Stats").set_uid(kStats).set_dim(stats_dims).set_stride(stats_strides)
                               .set_data_type(fe::DataType_t::FLOAT));
    auto opts = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(p.scale);
    if (p.causal) opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
    if (p.deterministic) opts.set_deterministic_algorithm(true);
    auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, stats, opts);
    dQ->set_output(true).set_uid(kdQ).set_dim(dims(B, H, Sq, D)).set_stride(strides_of(p.dq));
    dK->set_output(true).set_uid(kdK).set_dim(dims(B, Hk, Sk, D)).set_stride(strides_of(p.dk));
    dV->set_output(true).set_uid(kdV).set_dim(dims(B, Hk, Sk, D)).set_stride(strides_of(p.dv));
  }
  const bool tune = cudnn_attention_autotune();
  auto status = g->build(handle, {fe::HeurMode_t::A},
                         tune ? fe::BuildPlanPolicy_t::ALL : fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
  if (!status.is_good()) {
    e->error = fmt::format("cuDNN has no SDPA {} engine for this call ({})", backward ? "backward" : "forward",
                           status.get_message());
    return e;
  }
  e->tune = tune && g->get_execution_plan_count() > 1;
  if (e->tune) {
    e->workspace = g->get_autotune_workspace_size();  // the largest plan's, until one is chosen
  } else {
    status = g->get_workspace_size(e->workspace);
    if (!status.is_good()) {
      e->error = fmt::format("cuDNN workspace query failed ({})", status.get_message());
      return e;
    }
  }
  e->graph = std::move(g);
  return e;
}

// Finds or builds the graph; call with st.mu held.
std::shared_ptr<Entry> entry_for(DeviceState& st, const AttnProblem& p, bool backward) {
  if (!st.handle) check_cudnn(cudnnCreate(&st.handle), "cudnnCreate");
  const std::string key = key_of(p, backward);
  auto it = st.graphs.find(key);
  if (it != st.graphs.end()) return it->second;
  std::shared_ptr<Entry> e;
  try {
    e = build(p, backward, st.handle);
  } catch (const std::exception& ex) {
    e = std::make_shared<Entry>();
    e->error = fmt::format("cudnn-frontend failed to build the SDPA graph: {}", ex.what());
  }
  st.graphs.emplace(key, e);
  return e;
}

std::string static_reason(const AttnProblem& p) {
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return fmt::format("dtype {}", dtype_name(p.dtype));
  if (p.cu_q)
    return "packed sequences (cu_seqlens) are not wired to cuDNN's ragged layout yet";
  if (p.head_dim % 8 != 0 || p.head_dim > 256) return fmt::format("head_dim {}", p.head_dim);
  return "";
}

void run(const AttnProblem& p, bool backward, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  const std::string why = static_reason(p);
  MC_CHECK(why.empty(), "cuDNN SDPA cannot run this call: {}", why);
  DeviceState& st = state(device);
  std::lock_guard<std::mutex> lock(st.mu);
  auto e = entry_for(st, p, backward);
  MC_CHECK(e->error.empty(), "cuDNN SDPA cannot run this call: {}", e->error);
  std::unordered_map<int64_t, void*> pack{{kQ, p.q.ptr}, {kK, p.k.ptr}, {kV, p.v.ptr}, {kO, p.o.ptr}, {kStats, p.lse}};
  if (backward) {
    pack[kdO] = p.dout.ptr;
    pack[kdQ] = p.dq.ptr;
    pack[kdK] = p.dk.ptr;
    pack[kdV] = p.dv.ptr;
  }
  Allocator& alloc = Allocator::get(Device::cuda(device));
  void* ws = e->workspace > 0 ? alloc.allocate(size_t(e->workspace), Stream::from_native(Device::cuda(device), stream))
                              : nullptr;
  check_cudnn(cudnnSetStream(st.handle, static_cast<cudaStream_t>(stream)), "cudnnSetStream");
  if (e->tune) {
    // Once per graph: time every plan on this call's tensors (synchronises the device) and keep the
    // fastest. Should the timing fail, the heuristic's first plan stays selected.
    e->tune = false;
    if (e->graph->autotune(st.handle, pack, ws).is_good()) {
      int64_t w = 0;
      if (e->graph->get_workspace_size(w).is_good()) e->workspace = w;
    }
  }
  auto status = e->graph->execute(st.handle, pack, ws);
  if (ws) alloc.deallocate(ws);  // stream-ordered: reused only by later work on this stream
  if (!status.is_good()) raise<CudaError>("cuDNN SDPA execution failed: {}", status.get_message());
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool cudnn_sdpa_built() { return true; }

std::string cudnn_unsupported_reason(const AttnProblem& p, bool backward, int device) {
  std::string why = static_reason(p);
  if (!why.empty()) return why;
  cuda_impl::DeviceGuard guard(device);
  DeviceState& st = state(device);
  std::lock_guard<std::mutex> lock(st.mu);
  return entry_for(st, p, backward)->error;
}

void cudnn_forward(const AttnProblem& p, int device, void* stream) { run(p, false, device, stream); }
void cudnn_backward(const AttnProblem& p, int device, void* stream) { run(p, true, device, stream); }

}  // namespace megacore::ops::cuda

#else  // no cuDNN SDPA in this build

namespace megacore::ops::cuda {
bool cudnn_sdpa_built() { return false; }
std::string cudnn_unsupported_reason(const AttnProblem&, bool, int) {
  return "megacore was built without cuDNN SDPA (cuDNN and cudnn-frontend headers are needed at build time)";
}
void cudnn_forward(const AttnProblem&, int, void*) {
  raise<CudaError>("megacore was built without cuDNN SDPA; use AttentionBackend::Flash or rebuild with cuDNN and "
                   "cudnn-frontend");
}
void cudnn_backward(const AttnProblem& p, int d, void* s) { cudnn_forward(p, d, s); }
}  // namespace megacore::ops::cuda

#endif
