#include "megacore/layers/moe_lora.hpp"

#include "megacore/ops/attention_merge.hpp"
#include "megacore/ops/gemm.hpp"

namespace megacore::layers {
namespace {

constexpr std::string_view kName = "ExpertLoRAAdapter";

Parameter expert_param(std::string name, Tensor data, int partition_dim, int64_t offset, int64_t experts) {
  Parameter p;
  p.name = std::move(name);
  p.main_grad = Tensor::zeros(data.shape(), DType::F32, data.device());
  p.data = std::move(data);
  p.partition_dim = partition_dim;
  p.expert = true;
  p.expert_offset = offset;
  p.num_experts = experts;
  return p;
}

// The per-expert products: their row counts follow the routing, so no timed autotuning.
void gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& out, float alpha, float beta, const Stream& s) {
  lora_gemm(a, ta, b, tb, out, alpha, beta, s, /*autotune=*/false);
}

// Segment g's output columns of a [rows, block_width] matrix (blocks = 1 for expert linears).
Tensor columns(const Tensor& m, const LoRASegment& g) { return g.width == m.size(1) ? m : m.narrow(1, g.col0, g.width); }

}  // namespace

void looped_gemm(const Tensor& x, const Tensor& w, std::span<const int64_t> sizes, Tensor& y, bool trans_w,
                 float alpha, float beta, const Stream& s) {
  MC_INTERNAL_ASSERT(w.dim() == 3 && int64_t(sizes.size()) == w.size(0), "looped_gemm: one weight per group");
  int64_t row = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    const int64_t n = sizes[g];
    if (n == 0) continue;
    Tensor yg = y.narrow(0, row, n);
    gemm(x.narrow(0, row, n), false, w.select(0, int64_t(g)), trans_w, yg, alpha, beta, s);
    row += n;
  }
}

ExpertLoRAAdapter::ExpertLoRAAdapter(comm::Communicator& expert_tp, Kind kind, int64_t local_experts,
                                     int64_t expert_offset, int64_t num_experts, int64_t in_features,
                                     std::vector<LoRASegment> segments, const LoRAOptions& options, DType dtype,
                                     Device device)
    : LoRABase(kName, std::move(segments), options, dtype, device), etp_(expert_tp), kind_(kind),
      local_experts_(local_experts), in_(in_features), in_local_(in_features) {
  const int64_t n = etp_.size(), r = opts_.rank;
  MC_CHECK(local_experts_ >= 1 && expert_offset >= 0 && expert_offset + local_experts_ <= num_experts,
           "{}: local experts [{}, {}) do not lie inside the {} experts", kName, expert_offset,
           expert_offset + local_experts_, num_experts);
  in_local_ = check_layout(kName, "expert-TP", kind_ == Kind::Row, in_, etp_.size());
  for (const LoRASegment& g : segs_)
    MC_CHECK(g.blocks == 1, "{}: segment {} spans {} blocks; expert linears take one block per segment", kName, g.name,
             g.blocks);
  for (size_t j = 0; j < segs_.size(); ++j) {
    const LoRASegment& g = segs_[j];
    Tensor a = Tensor::empty({local_experts_, r, in_local_}, dtype_, device_);
    for (int64_t le = 0; le < local_experts_; ++le)
      a.select(0, le).copy_(init_a(opts_.init_offset + kExpertLoRAStride * uint64_t(expert_offset + le) + j, in_,
                                   in_local_, etp_.rank()));
    const int64_t b_rows = kind_ == Kind::Column ? g.out_features / n : g.out_features;
    const std::string pre = g.name.empty() ? std::string() : g.name + ".";
    a_.push_back(expert_param(pre + "lora_A.weight", a, kind_ == Kind::Column ? -1 : 2, expert_offset, num_experts));
    b_.push_back(expert_param(pre + "lora_B.weight", Tensor::zeros({local_experts_, b_rows, r}, dtype_, device_),
                              kind_ == Kind::Column ? 1 : -1, expert_offset, num_experts));
  }
}

void ExpertLoRAAdapter::forward(const ForwardContext& ctx, const Tensor& x, std::span<const int64_t> sizes, Tensor& y) {
  const Stream& s = ctx.stream;
  MC_CHECK(int64_t(sizes.size()) == local_experts_ && x.size(1) == in_local_,
           "{}.forward: x [{}, {}] with {} groups does not match {} local experts of {} input features", kName,
           x.size(0), x.size(1), sizes.size(), local_experts_, in_local_);
  Tensor xd = begin_forward(ctx) ? dropped(x, s) : x;
  for (size_t j = 0; j < segs_.size(); ++j) {
    Tensor h = Tensor::empty({x.size(0), opts_.rank}, dtype_, device_, s);
    looped_gemm(xd, a_[j].data, sizes, h, /*trans_w=*/true, 1.f, 0.f, s);  // h_e = xd_e A_eᵀ
    Tensor dst = columns(y, segs_[j]);
    looped_gemm(h, b_[j].data, sizes, dst, /*trans_w=*/true, float(scale()), 1.f, s);  // y_e += scale · h_e B_eᵀ
    if (ctx.training) saved_h_.push_back(h);
  }
}

Tensor ExpertLoRAAdapter::backward(const ForwardContext& ctx, const Tensor& x, std::span<const int64_t> sizes,
                                   const Tensor& dy) {
  const Stream& s = ctx.stream;
  MC_CHECK(saved_h_.size() == segs_.size(),
           "{}.backward: nothing saved; call forward with ctx.training = true before backward", kName);
  Tensor xd = dropped(x, s);
  const float sc = float(scale());
  const int64_t rows = dy.size(0), r = opts_.rank;
  const bool partial_sum = etp_.size() > 1;
  Tensor dx = Tensor::empty({rows, in_local_}, dtype_, device_, s);
  for (size_t j = 0; j < segs_.size(); ++j) {
    Tensor dyj = columns(dy, segs_[j]).contiguous(s);
    Tensor dh = Tensor::empty({rows, r}, dtype_, device_, s);
    looped_gemm(dyj, b_[j].data, sizes, dh, /*trans_w=*/false, sc, 0.f, s);  // dh_e = scale · dy_e B_e
    // The gradient that is an expert-TP partial sum goes through a temporary summed over expert-TP.
    Parameter& pa = a_[j];
    Parameter& pb = b_[j];
    Tensor partial = partial_sum ? Tensor::zeros((kind_ == Kind::Column ? pa : pb).main_grad.shape(), DType::F32,
                                                 device_, s)
                                 : Tensor();
    Tensor& ga = partial_sum && kind_ == Kind::Column ? partial : pa.main_grad;
    Tensor& gb = partial_sum && kind_ == Kind::Row ? partial : pb.main_grad;
    int64_t row = 0;
    for (size_t e = 0; e < sizes.size(); ++e) {
      const int64_t n = sizes[e];
      if (n == 0) continue;
      Tensor gbe = gb.select(0, int64_t(e)), gae = ga.select(0, int64_t(e));
      gemm(dyj.narrow(0, row, n), true, saved_h_[j].narrow(0, row, n), false, gbe, sc, 1.f, s);  // dB += sc dyᵀ h
      gemm(dh.narrow(0, row, n), true, xd.narrow(0, row, n), false, gae, 1.f, 1.f, s);           // dA += dhᵀ xd
      row += n;
    }
    if (partial_sum) {
      etp_.all_reduce(partial, comm::ReduceOp::Sum, s)->wait_on(s);
      Tensor& g = kind_ == Kind::Column ? pa.main_grad : pb.main_grad;
      ops::accumulate_f32(g, partial, s);
    }
    looped_gemm(dh, a_[j].data, sizes, dx, /*trans_w=*/false, 1.f, j == 0 ? 0.f : 1.f, s);  // dxd (+)= dh_e A_e
  }
  saved_h_.clear();
  return dropout_grad(dx, s);
}

void ExpertLoRAAdapter::merge_into(Tensor& weight, const Stream& s) const {
  MC_CHECK(weight.dim() == 3 && weight.size(0) == local_experts_ && weight.size(2) == in_local_,
           "{}.merge_into: weight {} is not [{}, out, {}]", kName, shape_str(weight.shape()), local_experts_, in_local_);
  for (size_t j = 0; j < segs_.size(); ++j) {
    const LoRASegment& g = segs_[j];
    for (int64_t e = 0; e < local_experts_; ++e) {
      Tensor we = weight.select(0, e);
      Tensor rows = g.width == we.size(0) ? we : we.narrow(0, g.col0, g.width);
      Tensor acc = rows.to(DType::F32, s).contiguous(s);
      Tensor bf = b_[j].data.select(0, e).to(DType::F32, s).contiguous(s);
      Tensor af = a_[j].data.select(0, e).to(DType::F32, s).contiguous(s);
      gemm(bf, false, af, false, acc, float(scale()), 1.f, s);  // W_e + scale · B_e A_e, in f32
      rows.copy_(acc.to(weight.dtype(), s), s);
    }
  }
}

}  // namespace megacore::layers
