#include "megacore/layers/fp8.hpp"

#include "megacore/core/error.hpp"

namespace megacore::layers {

Fp8Scaling fp8_scaling_from_name(std::string_view name) {
  if (name == "none") return Fp8Scaling::None;
  if (name == "delayed") return Fp8Scaling::Delayed;
  if (name == "current") return Fp8Scaling::Current;
  raise<ConfigError>("unknown FP8 scaling '{}'; use none, delayed or current", name);
}

std::string_view fp8_scaling_name(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::None: return "none";
    case Fp8Scaling::Delayed: return "delayed";
    case Fp8Scaling::Current: return "current";
  }
  return "?";
}

namespace {
DType slot_dtype(const Fp8Recipe& r, int slot) {
  return slot == Fp8LinearState::kGradOutput ? r.grad_dtype : DType::F8E4M3;
}
}  // namespace

Fp8LinearState::Fp8LinearState(const Fp8Recipe& recipe, Device device) : recipe_(recipe) {
  MC_CHECK(recipe.scaling != Fp8Scaling::None, "Fp8LinearState: the recipe's scaling is none; do not enable FP8");
  MC_CHECK(recipe.amax_history_len >= 1, "Fp8LinearState: amax_history_len is {}; it must be >= 1 (1024)",
           recipe.amax_history_len);
  MC_CHECK(is_fp8(recipe.grad_dtype), "Fp8LinearState: grad_dtype {} is not an FP8 dtype (f8e5m2 or f8e4m3)",
           dtype_name(recipe.grad_dtype));
  // Current scaling keeps only the amax of the cast being made.
  const int64_t len = recipe.scaling == Fp8Scaling::Current ? 1 : recipe.amax_history_len;
  history_ = Tensor::zeros({len, kSlots}, DType::F32, device);
  scale_ = Tensor::full({kSlots}, 1.0, DType::F32, device);
  scale_inv_ = Tensor::full({kSlots}, 1.0, DType::F32, device);
  gemm_scale_inv_ = Tensor::full({kSlots, 4}, 1.0, DType::F32, device);
  std::vector<float> mx;
  for (int i = 0; i < kSlots; ++i) mx.push_back(fp8_max(slot_dtype(recipe, i)));
  fp8_max_ = Tensor::from_vector<float>(mx, {kSlots}).to(device);
  counts_ = Tensor::zeros({kSlots, 2}, DType::I64, device);
}

Tensor Fp8LinearState::cast(comm::Communicator& tp, int slot, const Tensor& x, const Stream& s) {
  Tensor q = Tensor::empty(x.shape(), slot_dtype(recipe_, slot), x.device(), s);
  Tensor amax = history_.select(0, 0).narrow(0, slot, 1);
  Tensor sc = scale_.narrow(0, slot, 1);
  if (recipe_.scaling == Fp8Scaling::Current) {
    // This tensor's own amax, agreed over TP, then its scale; the cast below reduces into it again
    // (a no-op: the same values).
    amax.zero_(s);
    ops::fp8_amax(x, amax, s);
    if (tp.size() > 1) tp.all_reduce(amax, comm::ReduceOp::Max, s)->wait_on(s);
    ops::fp8_update_scales(amax.view({1, 1}), sc, scale_inv_.narrow(0, slot, 1), fp8_max_.narrow(0, slot, 1),
                           ops::Fp8AmaxAlgo::MostRecent, recipe_.margin, /*roll=*/false, s);
    gemm_scale_inv_.select(0, slot).narrow(0, 0, 1).copy_(scale_inv_.narrow(0, slot, 1), s);
  }
  ops::fp8_cast(x, sc, q, amax, counts_.select(0, slot), s);
  return q;
}

void Fp8LinearState::cast_weight(comm::Communicator& tp, const Tensor& w, const Stream& s) {
  w_fp8_ = cast(tp, kWeight, w.contiguous(s), s);
  wt_fp8_ = w_fp8_.transpose(0, 1).contiguous(s);
}

const Tensor& Fp8LinearState::weight(comm::Communicator& tp, const Tensor& w, const Stream& s) {
  if (!w_fp8_.defined()) cast_weight(tp, w, s);
  return w_fp8_;
}

const Tensor& Fp8LinearState::weight_t(comm::Communicator& tp, const Tensor& w, const Stream& s) {
  if (!wt_fp8_.defined()) cast_weight(tp, w, s);
  return wt_fp8_;
}

void Fp8LinearState::begin_step(comm::Communicator& tp, const Stream& s) {
  w_fp8_ = Tensor();
  wt_fp8_ = Tensor();
  if (recipe_.scaling != Fp8Scaling::Delayed) return;
  Tensor row0 = history_.select(0, 0);
  if (tp.size() > 1) tp.all_reduce(row0, comm::ReduceOp::Max, s)->wait_on(s);
  ops::fp8_update_scales(history_, scale_, scale_inv_, fp8_max_, recipe_.amax_compute_algo, recipe_.margin, true, s);
  gemm_scale_inv_.narrow(1, 0, 1).copy_(scale_inv_.view({kSlots, 1}), s);
}

std::vector<std::pair<std::string, Tensor>> Fp8LinearState::state() {
  return {{"amax_history", history_}, {"scale", scale_}, {"scale_inv", scale_inv_}, {"counts", counts_}};
}

}  // namespace megacore::layers
