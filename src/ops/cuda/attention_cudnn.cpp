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

#include <algorithm>
#include <climits>
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

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV, kSeqQ, kSeqKV, kOffsets };

// Packed sequences (cu_seqlens) run on cuDNN's ragged layout: every tensor is described as [B, H, S, D]
// with a per-sequence start (an element offset, int32) in place of the batch stride, and a padding mask
// from the sequence lengths. The graph is built for bucketed sizes so that the batches of a training run
// (whose sequence counts and longest sequences change from step to step) share a few graphs: B and the
// maximum lengths round up to powers of two (extra sequences are empty), and so do the token totals that
// bound the backward's workspace.
int64_t pow2_at_least(int64_t v, int64_t lo) {
  int64_t r = lo;
  while (r < v) r *= 2;
  return r;
}

// The offset arrays of a packed call, in the order ragged_prepare writes them; kOffsets + i is array i's uid.
enum Off : int { oQ, oK, oV, oO, oStats, odO, odQ, odK, odV, kNumOff };

RaggedOffsets offsets_of(const AttnProblem& p, bool backward) {
  RaggedOffsets r;
  r.n = backward ? kNumOff : oStats + 1;
  const AttnTensor* t[kNumOff] = {&p.q, &p.k, &p.v, &p.o, nullptr, &p.dout, &p.dq, &p.dk, &p.dv};
  for (int i = 0; i < r.n; ++i) {
    r.mult[i] = i == oStats ? p.heads : t[i]->row_stride;
    r.kv[i] = i == oK || i == oV || i == odK || i == odV;
  }
  return r;
}

// The problem a packed call's graph is built for (bucketed sizes; see above).
AttnProblem graph_problem(const AttnProblem& p) {
  if (!p.cu_q) return p;
  AttnProblem g = p;
  g.batch = int(pow2_at_least(p.batch, 1));
  g.seqlen_q = int(pow2_at_least(p.seqlen_q, 64));
  g.seqlen_kv = int(pow2_at_least(p.seqlen_kv, 64));
  g.total_q = pow2_at_least(p.total_q, 64);
  g.total_kv = pow2_at_least(p.total_kv, 64);
  return g;
}

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
  return fmt::format("{}|{}|{},{},{}|{},{},{},{},{},{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{:x}|{}|{}", backward ? "b" : "f",
                     int(p.dtype), p.cu_q ? 1 : 0, p.cu_q ? p.total_q : 0, p.cu_q ? p.total_kv : 0, p.batch, p.heads,
                     p.kv_heads, p.head_dim, p.seqlen_q, p.seqlen_kv,
                     strides(p.q), strides(p.k), strides(p.v), strides(p.o), backward ? strides(p.dout) : "",
                     backward ? strides(p.dq) : "", backward ? strides(p.dk) : "", backward ? strides(p.dv) : "",
                     p.causal, scale_bits, backward && p.deterministic, cudnn_attention_autotune());
}

std::vector<int64_t> dims(int64_t b, int64_t h, int64_t s, int64_t d) { return {b, h, s, d}; }

// p is graph_problem(call): for packed calls its sizes are the buckets.
std::shared_ptr<Entry> build(const AttnProblem& p, bool backward, cudnnHandle_t handle) {
  auto e = std::make_shared<Entry>();
  auto g = std::make_shared<fe::graph::Graph>();
  const auto io = p.dtype == DType::BF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
  g->set_io_data_type(io).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
  using TA = fe::graph::Tensor_attributes;
  using TP = std::shared_ptr<TA>;
  const bool packed = p.cu_q != nullptr;
  const int64_t B = p.batch, H = p.heads, Hk = p.kv_heads, Sq = p.seqlen_q, Sk = p.seqlen_kv, D = p.head_dim;
  auto index_tensor = [&](const std::string& name, int64_t uid, int64_t n) {
    return g->tensor(TA().set_name(name).set_uid(uid).set_dim({n, 1, 1, 1}).set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::INT32));
  };
  // Dense: the tensor's own strides. Packed: the batch stride is replaced by the sequence's start
  // offset (ragged), so it only has to be consistent.
  auto describe = [&](TP t, const AttnTensor& a, int64_t heads, int64_t seq, Off off) -> TP {
    t->set_dim(dims(B, heads, seq, D));
    if (packed) {
      t->set_stride({seq * a.row_stride, a.head_stride, a.row_stride, 1});
      t->set_ragged_offset(index_tensor(fmt::format("offset_{}", int(off)), int64_t(kOffsets) + off, B + 1));
    } else {
      t->set_stride({a.batch_stride, a.head_stride, a.row_stride, 1});
    }
    return t;
  };
  auto input = [&](const char* name, int64_t uid, const AttnTensor& a, int64_t heads, int64_t seq, Off off) {
    return describe(g->tensor(TA().set_name(name).set_uid(uid)), a, heads, seq, off);
  };
  // lse: dense [B, H, Sq]; packed, cuDNN's token-major [Tq, H] (attention_ragged.cu converts).
  auto describe_stats = [&](TP t) -> TP {
    t->set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim({B, H, Sq, 1});
    if (packed) {
      t->set_stride({H * Sq, 1, H, 1});
      t->set_ragged_offset(index_tensor("offset_stats", int64_t(kOffsets) + oStats, B + 1));
    } else {
      t->set_stride({H * Sq, Sq, 1, 1});
    }
    return t;
  };
  auto Q = input("Q", kQ, p.q, H, Sq, oQ);
  auto K = input("K", kK, p.k, Hk, Sk, oK);
  auto V = input("V", kV, p.v, Hk, Sk, oV);
  TP seq_q, seq_kv;
  if (packed) seq_q = index_tensor("seq_q", kSeqQ, B), seq_kv = index_tensor("seq_kv", kSeqKV, B);
  if (!backward) {
    auto opts = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(p.scale);
    if (p.causal) opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
    if (packed) opts.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
    auto [O, stats] = g->sdpa(Q, K, V, opts);
    describe(O, p.o, H, Sq, oO)->set_output(true).set_uid(kO);
    describe_stats(stats)->set_output(true);
  } else {
    auto O = input("O", kO, p.o, H, Sq, oO);
    auto dO = input("dO", kdO, p.dout, H, Sq, odO);
    auto stats = describe_stats(g->tensor(TA().set_name("Stats")));
    auto opts = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(p.scale);
    if (p.causal) opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
    if (p.deterministic) opts.set_deterministic_algorithm(true);
    if (packed) {
      // The token totals bound the backward's f32 workspace (else sized for B x max length).
      opts.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
      opts.set_max_total_seq_len_q(p.total_q).set_max_total_seq_len_kv(p.total_kv);
    }
    auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, stats, opts);
    describe(dQ, p.dq, H, Sq, odQ)->set_output(true).set_uid(kdQ);
    describe(dK, p.dk, Hk, Sk, odK)->set_output(true).set_uid(kdK);
    describe(dV, p.dv, Hk, Sk, odV)->set_output(true).set_uid(kdV);
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

// Finds or builds the graph of gp (graph_problem of the call); call with st.mu held.
std::shared_ptr<Entry> entry_for(DeviceState& st, const AttnProblem& gp, bool backward) {
  if (!st.handle) check_cudnn(cudnnCreate(&st.handle), "cudnnCreate");
  const std::string key = key_of(gp, backward);
  auto it = st.graphs.find(key);
  if (it != st.graphs.end()) return it->second;
  std::shared_ptr<Entry> e;
  try {
    e = build(gp, backward, st.handle);
  } catch (const std::exception& ex) {
    e = std::make_shared<Entry>();
    e->error = fmt::format("cudnn-frontend failed to build the SDPA graph: {}", ex.what());
  }
  st.graphs.emplace(key, e);
  return e;
}

std::string static_reason(const AttnProblem& p) {
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return fmt::format("dtype {}", dtype_name(p.dtype));
  if (p.cu_q) {
    // The ragged offsets are int32 element offsets.
    int64_t q_rows = p.heads, kv_rows = 0;
    for (const AttnTensor* t : {&p.q, &p.o, &p.dout, &p.dq}) q_rows = std::max(q_rows, t->row_stride);
    for (const AttnTensor* t : {&p.k, &p.v, &p.dk, &p.dv}) kv_rows = std::max(kv_rows, t->row_stride);
    if (p.total_q * q_rows > INT32_MAX || p.total_kv * kv_rows > INT32_MAX)
      return fmt::format("packed tensors of {} / {} tokens span more than 2^31 elements (cuDNN's ragged offsets "
                         "are int32)", p.total_q, p.total_kv);
  }
  if (p.head_dim % 8 != 0 || p.head_dim > 256) return fmt::format("head_dim {}", p.head_dim);
  return "";
}

void run(const AttnProblem& p, bool backward, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  const std::string why = static_reason(p);
  MC_CHECK(why.empty(), "cuDNN SDPA cannot run this call: {}", why);
  const AttnProblem gp = graph_problem(p);
  const bool packed = p.cu_q != nullptr;
  DeviceState& st = state(device);
  std::lock_guard<std::mutex> lock(st.mu);
  auto e = entry_for(st, gp, backward);
  MC_CHECK(e->error.empty(), "cuDNN SDPA cannot run this call: {}", e->error);
  std::unordered_map<int64_t, void*> pack{{kQ, p.q.ptr}, {kK, p.k.ptr}, {kV, p.v.ptr}, {kO, p.o.ptr}, {kStats, p.lse}};
  if (backward) {
    pack[kdO] = p.dout.ptr;
    pack[kdQ] = p.dq.ptr;
    pack[kdK] = p.dk.ptr;
    pack[kdV] = p.dv.ptr;
  }
  const Stream s = Stream::from_native(Device::cuda(device), stream);
  Allocator& alloc = Allocator::get(Device::cuda(device));
  // Scratch freed on every way out (stream-ordered: reused only by later work on this stream).
  struct Scratch {
    Allocator& alloc;
    void* ptr = nullptr;
    ~Scratch() {
      if (ptr) alloc.deallocate(ptr);
    }
  };
  Scratch index{alloc}, stats{alloc}, ws{alloc};
  // Packed: lengths and offsets (int32) and the token-major stats, made on the stream from cu_seqlens.
  if (packed) {
    const RaggedOffsets offs = offsets_of(p, backward);
    const int64_t bp = gp.batch;
    const RaggedIndexLayout lay = ragged_index_layout(bp, offs.n);
    index.ptr = alloc.allocate(size_t(lay.total) * sizeof(int32_t), s);
    auto* ix = static_cast<int32_t*>(index.ptr);
    ragged_prepare(p.cu_q, p.cu_kv, p.batch, int(bp), gp.seqlen_q, gp.seqlen_kv, offs, ix, stream);
    pack[kSeqQ] = ix, pack[kSeqKV] = ix + lay.seq_kv;
    for (int i = 0; i < offs.n; ++i) pack[kOffsets + i] = ix + lay.offsets + i * lay.offset_stride;
    stats.ptr = alloc.allocate(size_t(std::max<int64_t>(p.total_q * p.heads, 1)) * sizeof(float), s);
    pack[kStats] = stats.ptr;
    if (backward)
      ragged_lse_to_stats(p.lse, p.lse_head_stride, static_cast<float*>(stats.ptr), p.total_q, p.heads, stream);
  }
  if (e->workspace > 0) ws.ptr = alloc.allocate(size_t(e->workspace), s);
  check_cudnn(cudnnSetStream(st.handle, static_cast<cudaStream_t>(stream)), "cudnnSetStream");
  if (e->tune) {
    // Once per graph: time every plan on this call's tensors (synchronises the device) and keep the
    // fastest. Should the timing fail, the heuristic's first plan stays selected.
    e->tune = false;
    if (e->graph->autotune(st.handle, pack, ws.ptr).is_good()) {
      int64_t w = 0;
      if (e->graph->get_workspace_size(w).is_good()) e->workspace = w;
    }
  }
  auto status = e->graph->execute(st.handle, pack, ws.ptr);
  if (!status.is_good()) raise<CudaError>("cuDNN SDPA execution failed: {}", status.get_message());
  // Packed forward: cuDNN's token-major stats into lse (the rows it leaves alone are attention.cpp's, as
  // for the flash kernel: ragged_fix_orphans_*).
  if (packed && !backward)
    ragged_stats_to_lse(static_cast<float*>(stats.ptr), p.lse, p.lse_head_stride, p.total_q, p.heads, p.cu_q,
                        p.cu_kv, p.batch, stream);
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
  return entry_for(st, graph_problem(p), backward)->error;
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
