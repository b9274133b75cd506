#include "megacore/layers/embedding.hpp"

#include <algorithm>

#include "megacore/layers/linear.hpp"
#include "megacore/ops/embedding.hpp"
#include "megacore/parallel/mappings.hpp"

namespace megacore::layers {
namespace {

namespace pm = megacore::parallel;
constexpr std::string_view kName = "VocabParallelEmbedding";

template <class I>
void check_ids_cpu(const Tensor& ids, int64_t vocab) {
  const I* p = ids.data<I>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    MC_CHECK(p[i] >= 0 && int64_t(p[i]) < vocab,
             "{}.forward: token id {} at flat position {} is outside the vocabulary [0, {}); check the tokenizer "
             "against vocab_size",
             kName, int64_t(p[i]), i, vocab);
}

}  // namespace

int64_t pad_vocab_size(int64_t vocab_size, int64_t divisible_by, int tp_size) {
  const int64_t m = std::max<int64_t>(divisible_by, 1) * std::max(tp_size, 1);
  return (vocab_size + m - 1) / m * m;
}

VocabParallelEmbedding::VocabParallelEmbedding(comm::Communicator& tp, int64_t vocab_size, int64_t embedding_dim,
                                               const VocabParallelEmbeddingOptions& options)
    : tp_(tp), vocab_(vocab_size), dim_(embedding_dim), padded_(0), local_(0), start_(0), opts_(options) {
  MC_CHECK(vocab_ > 0 && dim_ > 0, "{}: vocab_size {} and embedding_dim {} must be positive", kName, vocab_, dim_);
  MC_CHECK(opts_.make_vocab_size_divisible_by > 0,
           "{}: make_vocab_size_divisible_by is {}; use a positive value (128 as Megatron)", kName,
           opts_.make_vocab_size_divisible_by);
  MC_CHECK(is_floating(opts_.params_dtype), "{}: params_dtype {} is not a float type; use f32, bf16 or f16", kName,
           dtype_name(opts_.params_dtype));
  if (opts_.padded_vocab_size > 0) {
    MC_CHECK(opts_.padded_vocab_size >= vocab_,
             "{}: padded_vocab_size {} is smaller than vocab_size {}; pass 0 to derive it or a value >= {}", kName,
             opts_.padded_vocab_size, vocab_, vocab_);
    MC_CHECK(opts_.padded_vocab_size % tp.size() == 0,
             "{}: padded_vocab_size {} is not divisible by the TP size {}; pass a multiple of {} (or 0 to derive it)",
             kName, opts_.padded_vocab_size, tp.size(), tp.size());
    padded_ = opts_.padded_vocab_size;
  } else {
    padded_ = pad_vocab_size(vocab_, opts_.make_vocab_size_divisible_by, tp.size());
  }
  local_ = padded_ / tp.size();
  start_ = int64_t(tp.rank()) * local_;

  // Draw only the real rows (vocab_size × h) so the table does not depend on the padding, i.e. on TP.
  Tensor full = init_full_weight(vocab_, dim_, opts_.init_std, opts_.seed, opts_.init_offset, opts_.params_dtype,
                                 opts_.device);
  Tensor shard = Tensor::zeros({local_, dim_}, opts_.params_dtype, opts_.device);
  const int64_t valid = valid_rows();
  if (valid > 0) shard.narrow(0, 0, valid).copy_(full.narrow(0, start_, valid));
  weight_.name = "weight";
  weight_.data = shard;
  weight_.main_grad = Tensor::zeros({local_, dim_}, DType::F32, opts_.device);
  weight_.partition_dim = 0;
}

int64_t VocabParallelEmbedding::valid_rows() const { return std::clamp<int64_t>(vocab_ - start_, 0, local_); }

Tensor VocabParallelEmbedding::forward(const ForwardContext& ctx, const Tensor& ids) {
  const Stream& s = ctx.stream;
  MC_CHECK(ids.defined(), "{}.forward: ids are undefined; pass the token ids [s, b]", kName);
  MC_CHECK(ids.dtype() == DType::I32 || ids.dtype() == DType::I64,
           "{}.forward: ids have dtype {}; token ids must be i32 or i64", kName, dtype_name(ids.dtype()));
  MC_CHECK(ids.device() == opts_.device, "{}.forward: ids are on {} but the layer is on {}; move them with .to(Device)",
           kName, ids.device().str(), opts_.device.str());
  MC_CHECK(!opts_.sequence_parallel || ids.dim() >= 1,
           "{}.forward: with sequence_parallel ids must have the sequence in dim 0 ([s, b]); add the sequence "
           "dimension",
           kName);
  Tensor idc = ids.contiguous(s);
  if (idc.device().is_cpu()) {
    if (idc.dtype() == DType::I32)
      check_ids_cpu<int32_t>(idc, vocab_);
    else
      check_ids_cpu<int64_t>(idc, vocab_);
  }
  Shape out_shape = idc.shape();
  out_shape.push_back(dim_);
  Tensor partial = Tensor::empty(out_shape, opts_.params_dtype, opts_.device, s);
  // vocab_start >= 0: ids outside this rank's rows give zero rows, so the sum over TP is the lookup.
  ops::embedding_forward(weight_.data, idc, partial, start_, s);
  Tensor y = opts_.sequence_parallel ? pm::reduce_scatter_to_sp_forward(tp_, partial, s)
                                     : pm::reduce_from_tp_forward(tp_, partial, s);
  saved_ids_ = ctx.training ? idc : Tensor();
  return y;
}

void VocabParallelEmbedding::backward(const ForwardContext& ctx, const Tensor& dy) {
  const Stream& s = ctx.stream;
  MC_CHECK(saved_ids_.defined(),
           "{}.backward: no saved ids; call forward with ctx.training = true before backward (each forward allows "
           "one backward)",
           kName);
  Shape want = saved_ids_.shape();
  want.push_back(dim_);
  if (opts_.sequence_parallel && !want.empty()) want[0] /= tp_.size();
  MC_CHECK(dy.defined() && dy.shape() == want,
           "{}.backward: dy has shape {} but forward's output had shape {}; pass the gradient of forward's output",
           kName, dy.defined() ? shape_str(dy.shape()) : std::string("undefined"), shape_str(want));
  MC_CHECK(dy.device() == opts_.device, "{}.backward: dy is on {} but the layer is on {}", kName, dy.device().str(),
           opts_.device.str());
  Tensor full = opts_.sequence_parallel ? pm::reduce_scatter_to_sp_backward(tp_, dy, s)
                                        : pm::reduce_from_tp_backward(tp_, dy, s);
  ops::embedding_backward(full.contiguous(s), saved_ids_, weight_.main_grad, /*accumulate=*/true, start_, s);
  // Padding rows stay untrained whatever ids arrived (unchecked on the GPU).
  const int64_t valid = valid_rows();
  if (valid < local_) weight_.main_grad.narrow(0, valid, local_ - valid).zero_(s);
  saved_ids_ = Tensor();
}

void VocabParallelEmbedding::stash_activations(ActivationStash& s) { s.put(saved_ids_); }
void VocabParallelEmbedding::restore_activations(ActivationStash& s) { s.take(saved_ids_); }

}  // namespace megacore::layers
