#include "megacore/layers/lora.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "megacore/core/log.hpp"
#include "megacore/core/random.hpp"
#include "megacore/ops/dropout.hpp"
#include "megacore/ops/gemm.hpp"

namespace megacore::layers {
namespace {

constexpr std::string_view kName = "LoRAAdapter";

Parameter make_param(std::string name, Tensor data, int partition_dim, bool tp_partial_grad) {
  Parameter p;
  p.name = std::move(name);
  p.main_grad = Tensor::zeros(data.shape(), DType::F32, data.device());
  p.data = std::move(data);
  p.partition_dim = partition_dim;
  p.sequence_parallel = tp_partial_grad;  // main_grad is summed over TP before use (see the header comment)
  return p;
}

bool trivial(const LoRASegment& g) { return g.blocks == 1 && g.col0 == 0 && g.width == g.block_width; }

// The segment's columns of a [rows, blocks·block_width] matrix, as a (strided) [rows, blocks, width] view.
Tensor segment_view(const Tensor& m, const LoRASegment& g) {
  return m.view({m.size(0), g.blocks, g.block_width}).narrow(2, g.col0, g.width);
}

// The segment's rows of a [blocks·block_width, k] weight, as a (strided) [blocks, width, k] view.
Tensor segment_rows(const Tensor& w, const LoRASegment& g) {
  return w.view({g.blocks, g.block_width, w.size(1)}).narrow(1, g.col0, g.width);
}

// Segment g's columns of a [rows, blocks·block_width] matrix held with row stride ld in m's storage
// (starting at m's first element): [rows, width] for one block, else [blocks, rows, width] (a batch of
// strided matrices, one per block) — GEMM operands without a copy.
Tensor segment_matrix(const Tensor& m, const LoRASegment& g, int64_t rows, int64_t ld) {
  if (g.blocks == 1) return Tensor(m.storage(), {rows, g.width}, {ld, 1}, m.dtype(), m.offset() + g.col0);
  return Tensor(m.storage(), {g.blocks, rows, g.width}, {g.block_width, ld, 1}, m.dtype(), m.offset() + g.col0);
}

// True when the segments cover each of the out local output features exactly once.
bool tiles_output(const std::vector<LoRASegment>& segs, int64_t out) {
  std::vector<int> hits(size_t(out), 0);
  for (const LoRASegment& g : segs)
    for (int64_t b = 0; b < g.blocks; ++b)
      for (int64_t c = g.col0; c < g.col0 + g.width; ++c) {
        const int64_t i = b * g.block_width + c;
        if (i >= out) return false;
        ++hits[size_t(i)];
      }
  return std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; });
}

bool fused_disabled_by_env() {
  const char* v = std::getenv("MEGACORE_LORA_FUSED");
  return v != nullptr && std::string_view(v) == "0";
}


}  // namespace

void lora_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& out, float alpha, float beta,
               const Stream& s, bool autotune) {
  ops::GemmOptions o;
  o.trans_a = ta;
  o.trans_b = tb;
  o.alpha = alpha;
  o.beta = beta;
  o.autotune = autotune;
  ops::gemm(a, b, out, o, s);
}

const std::vector<std::string>& lora_target_names() {
  static const std::vector<std::string> names{"q_proj",     "k_proj",      "v_proj",     "o_proj",    "gate_proj",
                                              "up_proj",    "down_proj",   "linear_qkv", "linear_proj",
                                              "linear_fc1", "linear_fc2", "w1",
                                              "w2",         "w3"};
  return names;
}

LoRABase::LoRABase(std::string_view who, std::vector<LoRASegment> segments, const LoRAOptions& options, DType dtype,
                   Device device)
    : segs_(std::move(segments)), opts_(options), dtype_(dtype), device_(device) {
  MC_CHECK(!segs_.empty(), "{}: no segments; give at least one (the whole layer)", who);
  MC_CHECK(opts_.dropout >= 0.0 && opts_.dropout < 1.0, "{}: dropout {} must be in [0, 1); set peft.dropout to e.g. 0.1",
           who, opts_.dropout);
  MC_CHECK(opts_.alpha > 0.0, "{}: alpha {} must be positive (the scale is alpha / r); set peft.alpha to e.g. 32",
           who, opts_.alpha);
  // Dropout draws: a seed stream of its own per adapter (the init offsets are unique per adapter).
  dropout_seed_ = opts_.seed ^ (0x9E3779B97F4A7C15ull * (opts_.init_offset + 1));
}

bool LoRABase::begin_forward(const ForwardContext& ctx) {
  using RP = ForwardContext::RecomputePass;
  const bool train_like = ctx.training || ctx.recompute_pass == RP::Discarded;
  const bool drop = train_like && opts_.dropout > 0.0;
  if (drop && ctx.recompute_pass != RP::Replay) counter_ = next_counter_++;  // Replay reuses the saved counter
  saved_h_.clear();
  return drop;
}

Tensor LoRABase::dropped(const Tensor& x, const Stream& s) const {
  if (opts_.dropout <= 0.0 || x.size(0) == 0) return x;
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device(), s);
  ops::dropout_forward(x, y, float(opts_.dropout), dropout_seed_, counter_, s);
  return y;
}

Tensor LoRABase::dropout_grad(Tensor dx, const Stream& s) const {
  if (opts_.dropout > 0.0 && dx.size(0) > 0) ops::dropout_backward(dx, dx, float(opts_.dropout), dropout_seed_, counter_, s);
  return dx;
}

int64_t LoRABase::check_layout(std::string_view who, std::string_view group, bool row, int64_t in, int n) const {
  const int64_t r = opts_.rank;
  if (row) {
    MC_CHECK(segs_.size() == 1 && trivial(segs_[0]), "{}: a row-parallel base takes one segment covering its whole output",
             who);
    MC_CHECK(in % n == 0, "{}: in_features {} is not divisible by the {} size {}", who, in, group, n);
  }
  for (const LoRASegment& g : segs_) {
    const std::string what = g.name.empty() ? std::string("the layer") : g.name;
    MC_CHECK(r > 0 && r <= std::min(in, g.out_features),
             "{}: rank r = {} for {} must be in [1, min(in, out)] = [1, {}] (in {}, out {}); set peft.dim in that range",
             who, r, what, std::min(in, g.out_features), in, g.out_features);
    const int64_t out_local = row ? g.out_features : g.out_features / n;
    MC_CHECK(g.blocks > 0 && g.width > 0 && g.col0 >= 0 && g.col0 + g.width <= g.block_width &&
                 g.blocks * g.width == out_local,
             "{}: the placement of {} (blocks {}, block_width {}, col0 {}, width {}) does not hold its {} local outputs",
             who, what, g.blocks, g.block_width, g.col0, g.width, out_local);
  }
  return row ? in / n : in;
}

Tensor LoRABase::init_a(uint64_t offset, int64_t in, int64_t in_local, int rank) const {
  Tensor full = Tensor::empty({opts_.rank, in}, DType::F32, device_);
  Generator gen(opts_.seed, offset);
  full.uniform_(gen, -1.0 / std::sqrt(double(in)), 1.0 / std::sqrt(double(in)));
  if (in_local != in) full = full.narrow(1, int64_t(rank) * in_local, in_local).contiguous();
  return full.to(dtype_);
}

std::vector<std::pair<std::string, Parameter*>> LoRABase::named_parameters() {
  // Leaf names from the segments, not Parameter::name: a model overwrites that with the full path.
  std::vector<std::pair<std::string, Parameter*>> out;
  for (size_t j = 0; j < segs_.size(); ++j) {
    const std::string pre = segs_[j].name.empty() ? std::string() : segs_[j].name + ".";
    out.emplace_back(pre + "lora_A.weight", &a_[j]);
    out.emplace_back(pre + "lora_B.weight", &b_[j]);
  }
  return out;
}

void LoRABase::stash_activations(ActivationStash& s) {
  s.put_int(int64_t(saved_h_.size()));
  for (Tensor& h : saved_h_) s.put(h);
  saved_h_.clear();
  s.put_int(int64_t(counter_));
}

void LoRABase::restore_activations(ActivationStash& s) {
  saved_h_.assign(size_t(s.take_int()), Tensor());
  for (Tensor& h : saved_h_) s.take(h);
  counter_ = uint64_t(s.take_int());
}

LoRAAdapter::LoRAAdapter(comm::Communicator& tp, Kind kind, int64_t in_features, std::vector<LoRASegment> segments,
                         const LoRAOptions& options, DType dtype, Device device)
    : LoRABase(kName, std::move(segments), options, dtype, device), tp_(tp), kind_(kind), in_(in_features),
      in_local_(in_features) {
  const int64_t n = tp.size(), r = opts_.rank;
  in_local_ = check_layout(kName, "TP", kind_ == Kind::Row, in_, tp.size());
  for (size_t j = 0; j < segs_.size(); ++j) {
    const LoRASegment& g = segs_[j];
    const std::string pre = g.name.empty() ? std::string() : g.name + ".";
    if (kind_ == Kind::Column) {
      a_.push_back(make_param(pre + "lora_A.weight", init_a(opts_.init_offset + j, in_, in_, 0), -1,
                              /*tp_partial_grad=*/n > 1));
      b_.push_back(make_param(pre + "lora_B.weight", Tensor::zeros({g.out_features / n, r}, dtype_, device_), 0, false));
    } else {
      a_.push_back(make_param(pre + "lora_A.weight", init_a(opts_.init_offset + j, in_, in_local_, tp.rank()), 1,
                              false));
      b_.push_back(make_param(pre + "lora_B.weight", Tensor::zeros({g.out_features, r}, dtype_, device_), -1, n > 1));
    }
  }
}

void LoRAAdapter::forward(const ForwardContext& ctx, const Tensor& x2, Tensor& y2) {
  const Stream& s = ctx.stream;
  Tensor xd = begin_forward(ctx) ? dropped(x2, s) : x2;
  for (size_t j = 0; j < segs_.size(); ++j) {
    const LoRASegment& g = segs_[j];
    Tensor h = Tensor::empty({x2.size(0), opts_.rank}, dtype_, device_, s);
    lora_gemm(xd, false, a_[j].data, true, h, 1.f, 0.f, s);  // h = xd Aᵀ
    if (trivial(g)) {
      lora_gemm(h, false, b_[j].data, true, y2, float(scale()), 1.f, s);  // y += scale · h Bᵀ
    } else {
      Tensor view = segment_view(y2, g);
      Tensor acc = view.contiguous(s).view({x2.size(0), g.blocks * g.width});
      lora_gemm(h, false, b_[j].data, true, acc, float(scale()), 1.f, s);
      view.copy_(acc.view({x2.size(0), g.blocks, g.width}), s);
    }
    if (ctx.training) saved_h_.push_back(h);
  }
  if (!ctx.training) saved_h_.clear();
}

Tensor LoRAAdapter::backward(const ForwardContext& ctx, const Tensor& x2, const Tensor& dy2) {
  const Stream& s = ctx.stream;
  MC_CHECK(saved_h_.size() == segs_.size(),
           "{}.backward: nothing saved; call forward with ctx.training = true before backward", kName);
  Tensor xd = opts_.dropout > 0.0 ? dropped(x2, s) : x2;
  const float sc = float(scale());
  const int64_t rows = dy2.size(0), r = opts_.rank, sum_r = r * int64_t(segs_.size());
  Tensor dx = Tensor::empty(x2.shape(), dtype_, device_, s);
  // Fused: the dh of every segment side by side, for one dx product with F's stacked A rows.
  const bool stacked = fused_.defined();
  Tensor dh_all = stacked ? Tensor::empty({rows, sum_r}, dtype_, device_, s) : Tensor();
  if (stacked) refresh_fused_a(s);
  for (size_t j = 0; j < segs_.size(); ++j) {
    const LoRASegment& g = segs_[j];
    Tensor dy = trivial(g) ? dy2 : segment_view(dy2, g).contiguous(s).view({rows, g.blocks * g.width});
    lora_gemm(dy, true, saved_h_[j], false, b_[j].main_grad, sc, 1.f, s);  // dB += scale · dyᵀ h
    Tensor dh = stacked ? dh_all.narrow(1, int64_t(j) * r, r) : Tensor::empty({rows, r}, dtype_, device_, s);
    lora_gemm(dy, false, b_[j].data, false, dh, sc, 0.f, s);                // dh = scale · dy B
    lora_gemm(dh, true, xd, false, a_[j].main_grad, 1.f, 1.f, s);           // dA += dhᵀ xd
    if (!stacked) lora_gemm(dh, false, a_[j].data, false, dx, 1.f, j == 0 ? 0.f : 1.f, s);  // dxd (+)= dh A
  }
  if (stacked) lora_gemm(dh_all, false, fused_.narrow(0, fused_.size(0) - sum_r, sum_r), false, dx, 1.f, 0.f, s);
  // Every segment saw the same dropped input: one mask for the summed input gradient.
  saved_h_.clear();
  return dropout_grad(dx, s);
}

void LoRAAdapter::bind(Parameter& weight, std::string_view layer) {
  fused_ = Tensor();
  fused_bias_ = Tensor();
  if (!opts_.fused || fused_disabled_by_env()) return;
  if (opts_.dropout > 0.0) {
    log_once(LogLevel::Info, "lora_dropout_unfused", "LoRA",
             fmt::format("dropout {} > 0: the adapters' input is dropout(x), not the base's x, so the low-rank path "
                         "runs unfused (its own GEMM over the activations, e.g. in {}); peft.dropout = 0 fuses it "
                         "into the base GEMM",
                         opts_.dropout, layer));
    return;
  }
  const Tensor& w = weight.data;
  if (!w.defined() || w.dim() != 2 || w.dtype() != dtype_ || w.device() != device_ || !w.is_contiguous() ||
      w.size(1) != in_local_)
    return;
  const int64_t out = w.size(0), r = opts_.rank;
  fused_tiles_ = tiles_output(segs_, out);
  Tensor f = Tensor::empty({out + r * int64_t(segs_.size()), in_local_}, dtype_, device_);
  f.narrow(0, 0, out).copy_(w);
  for (size_t j = 0; j < a_.size(); ++j) {
    Tensor rows = f.narrow(0, out + int64_t(j) * r, r);
    rows.copy_(a_[j].data);
    a_[j].data = rows;
  }
  weight.data = f.narrow(0, 0, out);
  fused_ = f;
}

void LoRAAdapter::unbind(Parameter& weight, const Stream& s) {
  if (!fused_.defined()) return;
  if (weight.data.defined() && weight.data.storage() == fused_.storage()) weight.data = weight.data.clone(s);
  fused_ = Tensor();
  fused_bias_ = Tensor();
}

bool LoRAAdapter::fused_for(const Tensor& weight) const {
  const int64_t sum_r = opts_.rank * int64_t(segs_.size());
  return fused_.defined() && weight.defined() && weight.storage() == fused_.storage() &&
         weight.offset() == fused_.offset() && weight.size(0) == fused_.size(0) - sum_r && weight.is_contiguous();
}

void LoRAAdapter::refresh_fused_a(const Stream& s) {
  const int64_t r = opts_.rank, out = fused_.size(0) - r * int64_t(segs_.size());
  for (size_t j = 0; j < a_.size(); ++j) {
    Tensor rows = fused_.narrow(0, out + int64_t(j) * r, r);
    if (a_[j].data.data_ptr() != rows.data_ptr()) rows.copy_(a_[j].data, s);  // moved by a DDP buffer
  }
}

Tensor LoRAAdapter::forward_fused(const ForwardContext& ctx, const Tensor& x2, const Tensor& weight,
                                  const Tensor& bias) {
  const Stream& s = ctx.stream;
  MC_INTERNAL_ASSERT(fused_for(weight), "LoRAAdapter.forward_fused: the weight is not in the fused buffer");
  refresh_fused_a(s);
  const int64_t rows = x2.size(0), r = opts_.rank, ldz = fused_.size(0), out = weight.size(0);
  // Z = x Fᵀ = [x Wᵀ (+ bias) | h_0 | h_1 ..]: one read of x.
  Tensor z = Tensor::empty({rows, ldz}, dtype_, device_, s);
  ops::GemmOptions o;
  o.trans_b = true;
  if (bias.defined()) {
    if (!fused_bias_.defined()) fused_bias_ = Tensor::zeros({ldz}, dtype_, device_, s);
    fused_bias_.narrow(0, 0, out).copy_(bias, s);
    o.epilogue = ops::GemmEpilogue::Bias;
    o.bias = fused_bias_;
  }
  ops::gemm(x2, fused_, z, o, s);
  Tensor y2 = Tensor::empty({rows, out}, dtype_, device_, s);
  if (!fused_tiles_) y2.copy_(Tensor(z.storage(), {rows, out}, {ldz, 1}, dtype_, z.offset()), s);
  saved_h_.clear();
  for (size_t j = 0; j < segs_.size(); ++j) {
    const LoRASegment& g = segs_[j];
    Tensor h(z.storage(), {rows, r}, {ldz, 1}, dtype_, z.offset() + out + int64_t(j) * r);
    Tensor dst = segment_matrix(y2, g, rows, out);
    ops::GemmOptions so;
    so.trans_b = true;
    so.alpha = float(scale());
    so.beta = 1.f;
    if (fused_tiles_) so.c = segment_matrix(z, g, rows, ldz);  // y_j = scale · h_j B_jᵀ + Z's segment columns
    const Tensor& b = b_[j].data;
    ops::gemm(h, g.blocks == 1 ? b : b.view({g.blocks, g.width, r}), dst, so, s);
    if (ctx.training) saved_h_.push_back(h.contiguous(s));
  }
  return y2;
}

void LoRAAdapter::merge_into(Tensor& weight, const Stream& s) const {
  const int64_t k = weight.size(1);
  for (size_t j = 0; j < segs_.size(); ++j) {
    const LoRASegment& g = segs_[j];
    Tensor rows = trivial(g) ? weight : segment_rows(weight, g);
    Tensor acc = rows.contiguous(s).to(DType::F32, s).contiguous(s).view({b_[j].data.size(0), k});
    Tensor bf = b_[j].data.to(DType::F32, s), af = a_[j].data.to(DType::F32, s);
    lora_gemm(bf, false, af, false, acc, float(scale()), 1.f, s);  // W + scale · B A, in f32
    Tensor merged = acc.to(weight.dtype(), s);
    rows.copy_(trivial(g) ? merged : merged.view({g.blocks, g.width, k}), s);
  }
}

}  // namespace megacore::layers
