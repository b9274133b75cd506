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
  seeded_ = Tensor::zeros({kSlots}, DType::F32, device);
  std::vector<float> mx;
  for (int i = 0; i < kSlots; ++i) mx.push_back(fp8_max(slot_dtype(recipe, i)));
  fp8_max_ = Tensor::from_vector<float>(mx, {kSlots}).to(device);
  counts_ = Tensor::zeros({kSlots, 2}, DType::I64, device);
}

void Fp8LinearState::refresh_gemm_scale(int slot, const Stream& s) {
  gemm_scale_inv_.select(0, slot).narrow(0, 0, 1).copy_(scale_inv_.narrow(0, slot, 1), s);
}

void Fp8LinearState::scale_from_row(int slot, const Stream& s) {
  ops::fp8_update_scales(history_.select(0, 0).narrow(0, slot, 1).view({1, 1}), scale_.narrow(0, slot, 1),
                         scale_inv_.narrow(0, slot, 1), fp8_max_.narrow(0, slot, 1), ops::Fp8AmaxAlgo::MostRecent,
                         recipe_.margin, /*roll=*/false, s);
  refresh_gemm_scale(slot, s);
}

void Fp8LinearState::seed_from(int slot, const Tensor& amax, const Stream& s) {
  seed_pending_[slot] = false;
  Tensor all = Tensor::full({kSlots}, -1.0, DType::F32, amax.device(), s);  // < 0: not this slot
  all.narrow(0, slot, 1).copy_(amax.view({1}), s);
  ops::fp8_seed_scales(all, seeded_, scale_, scale_inv_, fp8_max_, recipe_.margin, s);
  refresh_gemm_scale(slot, s);
}

void Fp8LinearState::current_scale(comm::Communicator& tp, int slot, const Tensor& x, const Stream& s) {
  // The tensor's own amax, agreed over TP, then its scale; a recording cast reduces into it again (a no-op:
  // the same values).
  Tensor amax = history_.select(0, 0).narrow(0, slot, 1);
  amax.zero_(s);
  ops::fp8_amax(x, amax, s);
  if (tp.size() > 1) tp.all_reduce(amax, comm::ReduceOp::Max, s)->wait_on(s);
  scale_from_row(slot, s);
}

void Fp8LinearState::seed_scale(comm::Communicator& tp, int slot, const Tensor& x, const Stream& s) {
  Tensor amax = Tensor::zeros({1}, DType::F32, x.device(), s);
  ops::fp8_amax(x, amax, s);
  if (tp.size() > 1) tp.all_reduce(amax, comm::ReduceOp::Max, s)->wait_on(s);
  seed_from(slot, amax, s);
}

Tensor Fp8LinearState::cast(comm::Communicator& tp, int slot, const Tensor& x, const Stream& s) {
  Tensor q = Tensor::empty(x.shape(), slot_dtype(recipe_, slot), x.device(), s);
  if (recipe_.scaling == Fp8Scaling::Current) current_scale(tp, slot, x, s);
  else if (seed_pending_[slot]) seed_scale(tp, slot, x, s);
  ops::fp8_cast(x, scale_.narrow(0, slot, 1), q, history_.select(0, 0).narrow(0, slot, 1), counts_.select(0, slot), s);
  return q;
}

Fp8Pair Fp8LinearState::cast_transpose(comm::Communicator& tp, int slot, const Tensor& x, bool want_q, bool record,
                                       const Stream& s) {
  const DType dt = slot_dtype(recipe_, slot);
  Fp8Pair p;
  if (want_q) p.q = Tensor::empty(x.shape(), dt, x.device(), s);
  p.qt = Tensor::empty({x.size(1), x.size(0)}, dt, x.device(), s);
  if (recipe_.scaling == Fp8Scaling::Current) current_scale(tp, slot, x, s);
  else if (seed_pending_[slot]) seed_scale(tp, slot, x, s);
  ops::fp8_cast_transpose(x, scale_.narrow(0, slot, 1), p.q, p.qt,
                          record ? history_.select(0, 0).narrow(0, slot, 1) : Tensor(),
                          record ? counts_.select(0, slot) : Tensor(), s);
  return p;
}

void Fp8LinearState::cast_weight(comm::Communicator& tp, const Tensor& w, const Stream& s) {
  Fp8Pair p = cast_transpose(tp, kWeight, w.contiguous(s), /*want_q=*/true, /*record=*/true, s);
  w_fp8_ = std::move(p.q);
  wt_fp8_ = std::move(p.qt);
}

const Tensor& Fp8LinearState::weight(comm::Communicator& tp, const Tensor& w, const Stream& s) {
  if (!w_fp8_.defined()) cast_weight(tp, w, s);
  return w_fp8_;
}

const Tensor& Fp8LinearState::weight_t(comm::Communicator& tp, const Tensor& w, const Stream& s) {
  if (!wt_fp8_.defined()) cast_weight(tp, w, s);
  return wt_fp8_;
}

bool Fp8LinearState::weight_amax_needed() const {
  return recipe_.scaling == Fp8Scaling::Current || (recipe_.scaling == Fp8Scaling::Delayed && seed_pending_[kWeight]);
}

void Fp8LinearState::set_weight_amax(const Tensor& amax, const Stream& s) {
  if (recipe_.scaling == Fp8Scaling::Current) {
    history_.select(0, 0).narrow(0, kWeight, 1).copy_(amax.view({1}), s);  // as current_scale
    scale_from_row(kWeight, s);
  } else {
    seed_from(kWeight, amax, s);  // as seed_scale (a no-op on the device for a slot seeded already)
  }
}

void Fp8LinearState::cast_weight_piece(const Tensor& x, Tensor& q, const Stream& s) {
  ops::fp8_cast(x, scale_.narrow(0, kWeight, 1), q, history_.select(0, 0).narrow(0, kWeight, 1),
                counts_.select(0, kWeight), s);
}

void Fp8LinearState::set_weight_codes(Tensor q, const Stream& s) {
  MC_CHECK(q.dtype() == DType::F8E4M3 && q.dim() == 2 && q.is_contiguous(),
           "Fp8LinearState.set_weight_codes: the codes must be a contiguous F8E4M3 matrix (got {} {})",
           dtype_name(q.dtype()), shape_str(q.shape()));
  // The transpose moves bytes only: a strided copy of the codes seen as u8.
  wt_fp8_ = q.view_as_dtype(DType::U8).transpose(0, 1).contiguous(s).view_as_dtype(DType::F8E4M3);
  w_fp8_ = std::move(q);
}

void Fp8LinearState::begin_step(comm::Communicator& tp, const Stream& s) {
  if (recipe_.scaling == Fp8Scaling::Delayed && tp.size() > 1) {
    Tensor row0 = amax_row();
    tp.all_reduce(row0, comm::ReduceOp::Max, s)->wait_on(s);
  }
  begin_step_reduced(s);
}

void Fp8LinearState::begin_step_reduced(const Stream& s) {
  w_fp8_ = Tensor();
  wt_fp8_ = Tensor();
  if (recipe_.scaling != Fp8Scaling::Delayed) return;
  ops::fp8_update_scales(history_, scale_, scale_inv_, fp8_max_, recipe_.amax_compute_algo, recipe_.margin, true, s);
  gemm_scale_inv_.narrow(1, 0, 1).copy_(scale_inv_.view({kSlots, 1}), s);
}

std::vector<std::pair<std::string, Tensor>> Fp8LinearState::state() {
  return {{"amax_history", history_}, {"scale", scale_}, {"scale_inv", scale_inv_}, {"counts", counts_},
          {"seeded", seeded_}};
}

void fp8_begin_step(const std::vector<Fp8LinearState*>& states, comm::Communicator& group, const Stream& s) {
  std::vector<Fp8LinearState*> delayed;
  for (Fp8LinearState* st : states)
    if (st && st->recipe().scaling == Fp8Scaling::Delayed) delayed.push_back(st);
  if (group.size() > 1 && !delayed.empty()) {
    constexpr int64_t k = Fp8LinearState::kSlots;
    const Device dev = delayed.front()->amax_row().device();
    Tensor packed = Tensor::empty({int64_t(delayed.size()) * k}, DType::F32, dev, s);
    for (size_t i = 0; i < delayed.size(); ++i) packed.narrow(0, int64_t(i) * k, k).copy_(delayed[i]->amax_row(), s);
    group.all_reduce(packed, comm::ReduceOp::Max, s)->wait_on(s);
    for (size_t i = 0; i < delayed.size(); ++i) {
      Tensor row = delayed[i]->amax_row();
      row.copy_(packed.narrow(0, int64_t(i) * k, k), s);
    }
  }
  for (Fp8LinearState* st : states)
    if (st) st->begin_step_reduced(s);
}

}  // namespace megacore::layers
