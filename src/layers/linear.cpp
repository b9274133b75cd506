#include "megacore/layers/linear.hpp"

#include <fmt/format.h>

#include <utility>

#include "megacore/core/allocator.hpp"
#include "megacore/core/log.hpp"
#include "megacore/ops/attention_merge.hpp"
#include "megacore/ops/gemm.hpp"
#include "megacore/ops/gemm_fp8.hpp"
#include "megacore/parallel/mappings.hpp"

namespace megacore::layers {
namespace {

namespace pm = megacore::parallel;

Tensor zeros_f32(const Shape& shape, Device d, const Stream& s) { return Tensor::zeros(shape, DType::F32, d, s); }

// The shape with the last dimension replaced.
Shape with_last(Shape shape, int64_t last) {
  shape.back() = last;
  return shape;
}

// Rows of a [..., features] tensor as a contiguous 2-D matrix.
Tensor as_rows(const Tensor& t, int64_t features, const Stream& s) {
  return t.contiguous(s).view({t.numel() / std::max<int64_t>(features, 1), features});
}

void check_activation(const Tensor& x, int64_t features, DType dtype, Device device, std::string_view layer,
                      std::string_view what, std::string_view fix) {
  MC_CHECK(x.defined(), "{}: {} is undefined; pass the output of the previous layer", layer, what);
  MC_CHECK(x.dim() >= 1 && x.size(-1) == features,
           "{}: {} has shape {} but its last dimension must be {}; {}", layer, what, shape_str(x.shape()), features, fix);
  MC_CHECK(x.dtype() == dtype, "{}: {} has dtype {} but the layer's parameters are {}; convert it with .to(DType::{})",
           layer, what, dtype_name(x.dtype()), dtype_name(dtype), dtype_name(dtype));
  MC_CHECK(x.device() == device, "{}: {} is on {} but the layer is on {}; move it with .to(Device)", layer, what,
           x.device().str(), device.str());
}

void check_sequence_chunk(const Tensor& x, std::string_view layer, std::string_view what) {
  MC_CHECK(x.dim() >= 2,
           "{}: with sequence_parallel {} must be [s/TP, ..., features] with the sequence in dim 0, got shape {}; add "
           "the sequence dimension",
           layer, what, shape_str(x.shape()));
}

// main_grad[n] += column sums of dy [rows, n], as a GEMM with a ones row so it runs on any device
// and accumulates in f32 (the BiasGrad epilogues overwrite instead of accumulating).
void accumulate_bias_grad(Tensor& main_grad, const Tensor& dy2, const Stream& s) {
  Tensor ones = Tensor::full({1, dy2.size(0)}, 1.0, dy2.dtype(), dy2.device(), s);
  Tensor g = main_grad.view({1, main_grad.numel()});
  ops::GemmOptions o;
  o.beta = 1.f;
  ops::gemm(ones, dy2, g, o, s);
}

// y2 [rows, n] += bias [n] broadcast over rows (a K = 1 GEMM: ones [rows, 1] @ bias [1, n]).
void add_bias_rows(Tensor& y2, const Tensor& bias, const Stream& s) {
  Tensor ones = Tensor::full({y2.size(0), 1}, 1.0, bias.dtype(), bias.device(), s);
  ops::GemmOptions o;
  o.beta = 1.f;
  ops::gemm(ones, bias.view({1, bias.numel()}), y2, o, s);
}

// y2 [rows, n] = x2 [rows, k] Wᵀ (+ bias [n] in the epilogue): the layers' plain forward product.
void gemm_xwt(const Tensor& x2, const Tensor& w, const Tensor& bias, Tensor& y2, const Stream& s) {
  ops::GemmOptions o;
  o.trans_b = true;
  if (bias.defined()) {
    o.epilogue = ops::GemmEpilogue::Bias;
    o.bias = bias;
  }
  ops::gemm(x2, w, y2, o, s);
}

void check_features(int64_t in, int64_t out, std::string_view layer) {
  MC_CHECK(in > 0 && out > 0, "{}: in_features {} and out_features {} must be positive", layer, in, out);
}

// One TP collective overlapped with compute (ColumnParallelLinear's overlap_grad_comm). On CUDA it
// runs on `comm`: start() records an event on `compute` (after the producer and the output buffer's
// allocation, both enqueued there) and makes `comm` wait for it before launching; finish() orders
// `comm` after the Work (Work::wait_on: nothing for NCCL on its own stream, a host wait for MPI, so call
// it only after the overlapped compute is enqueued) and makes `compute` wait for everything queued on
// `comm`, so later kernels see the result and buffers freed on
// `compute` are not reused before the collective is done with them. On the CPU both streams are the
// host stream and the events are no-ops.
// The collective's buffers are allocated on `compute`; the NCCL backend marks them as used on `comm`
// (Allocator::record_stream), which would park each of them, once freed, on a host-polled event until
// the host sees the collective finish: an event created per free, queried by every later allocation,
// and memory held back while the host runs ahead. finish() has already ordered `compute` after `comm`
// and `comm` (this layer's own stream) never touches them again, so it withdraws those marks.
class OverlappedCollective {
 public:
  OverlappedCollective(const Stream& compute, const Stream& comm) : compute_(compute), comm_(comm) {}
  OverlappedCollective(const OverlappedCollective&) = delete;
  OverlappedCollective& operator=(const OverlappedCollective&) = delete;
  ~OverlappedCollective() {
    // Only reached with a pending op when an exception unwinds between start and finish: do not leave
    // the collective running on buffers about to be freed.
    if (work_) try {
        work_->wait();
      } catch (...) {
      }
  }

  // `buffers`: the tensors the collective reads or writes (all allocated on `compute`). `after_compute`:
  // order the collective after everything enqueued on `compute` so far (its operands' producers); false
  // when they come from `comm`'s own earlier operations (a ring's forwarded chunk).
  template <class Launch>
  void start(std::vector<Tensor> buffers, Launch&& launch, bool after_compute = true) {
    if (after_compute) comm_.wait(compute_);
    work_ = launch(comm_);
    buffers_ = std::move(buffers);
  }

  void finish() {
    if (!work_) return;
    comm::WorkPtr w = std::move(work_);
    w->wait_on(comm_);
    if (comm_ == compute_) return;
    compute_.wait(comm_);
    for (const Tensor& t : buffers_) {
      const auto& st = t.storage();
      if (st && st->owned() && st->data() && st->device().is_cuda())
        Allocator::get(st->device()).release_stream_use(st->data(), comm_);
    }
    buffers_.clear();
  }

  // One step of a ring over `tp`: sends `send` to rank r + 1 and receives `recv` from rank r − 1.
  void start_ring_step(comm::Communicator& tp, const Tensor& send, const Tensor& recv, bool after_compute) {
    const int n = tp.size(), r = tp.rank();
    start({send, recv},
          [&](const Stream& cs) {
            return tp.batch_send_recv({{comm::P2POp::Send, send, (r + 1) % n}, {comm::P2POp::Recv, recv, (r + n - 1) % n}},
                                      cs);
          },
          after_compute);
  }

 private:
  Stream compute_, comm_;
  comm::WorkPtr work_;
  std::vector<Tensor> buffers_;
};

// The adapter must be of the layer's kind and input width, and each segment's placement must tile the
// layer's local output features (a segment may cover only part of them: q_proj alone in the fused QKV).
void check_adapter(const LoRAAdapter& a, LoRAAdapter::Kind kind, int64_t in, int64_t out_local, std::string_view layer) {
  bool fits = a.kind() == kind && a.in_features() == in;
  for (const LoRASegment& g : a.segments()) fits = fits && g.blocks * g.block_width == out_local;
  MC_CHECK(fits,
           "{}.attach_lora: the adapter ({}, in_features {}) does not fit this {} layer (in_features {}, {} local "
           "outputs); build it for this layer",
           layer, a.kind() == LoRAAdapter::Kind::Column ? "column-parallel" : "row-parallel", a.in_features(),
           kind == LoRAAdapter::Kind::Column ? "column-parallel" : "row-parallel", in, out_local);
}

// Frozen parameters keep no gradient buffer; unfreezing gives them a zeroed one again.
void set_grad_buffer(Parameter& p, bool frozen) {
  if (!p.data.defined()) return;
  if (frozen) p.main_grad = Tensor();
  else if (!p.main_grad.defined()) p.main_grad = Tensor::zeros(p.data.shape(), DType::F32, p.data.device());
}

Parameter make_param(std::string name, Tensor data, int partition_dim) {
  Parameter p;
  p.name = std::move(name);
  p.main_grad = zeros_f32(data.shape(), data.device(), {});
  p.data = std::move(data);
  p.partition_dim = partition_dim;
  return p;
}

}  // namespace

Tensor init_full_weight(int64_t out_features, int64_t in_features, double std, uint64_t seed, uint64_t offset,
                        DType dtype, Device device, const Stream& s) {
  MC_CHECK(std >= 0, "init_full_weight: std is {}; pass a non-negative standard deviation (0.02)", std);
  Tensor w = Tensor::empty({out_features, in_features}, DType::F32, device, s);
  Generator g(seed, offset);
  w.normal_(g, 0.0, std, s);
  return w.to(dtype, s);
}

// ---- ParallelLinearBase ------------------------------------------------------------------------------

ParallelLinearBase::ParallelLinearBase(comm::Communicator& tp, LoRAAdapter::Kind kind, int64_t in_features,
                                       int64_t out_features, std::string_view name)
    : tp_(tp), in_(in_features), out_(out_features), kind_(kind), name_(name) {}

std::vector<Parameter*> ParallelLinearBase::parameters() {
  std::vector<Parameter*> p{&weight_};
  if (bias_.data.defined()) p.push_back(&bias_);
  return p;
}

void ParallelLinearBase::zero_grad() {
  for (Parameter* p : parameters())
    if (p->main_grad.defined()) p->main_grad.zero_();
}

void ParallelLinearBase::stash_activations(ActivationStash& s) {
  s.put(saved_input_);
  s.put(saved_input_t_);
  s.put(saved_input_t_scale_inv_);
  s.put_shape(std::exchange(saved_shape_, Shape{}));
  if (lora_) lora_->stash_activations(s);
}

void ParallelLinearBase::restore_activations(ActivationStash& s) {
  s.take(saved_input_);
  s.take(saved_input_t_);
  s.take(saved_input_t_scale_inv_);
  saved_shape_ = s.take_shape();
  if (lora_) lora_->restore_activations(s);
}

void ParallelLinearBase::attach_lora(std::unique_ptr<LoRAAdapter> adapter) {
  MC_CHECK(adapter != nullptr, "{}.attach_lora: the adapter is null", name_);
  MC_CHECK(!lora_, "{}.attach_lora: an adapter is already attached; merge_lora first to attach another", name_);
  check_adapter(*adapter, kind_, in_, weight_.data.size(0), name_);
  adapter->bind(weight_, name_);
  lora_ = std::move(adapter);
}

void ParallelLinearBase::merge_lora(const Stream& s) {
  if (!lora_) return;
  lora_->merge_into(weight_.data, s);
  lora_->unbind(weight_, s);
  lora_.reset();
}

void ParallelLinearBase::set_frozen(bool frozen) {
  frozen_ = frozen;
  set_grad_buffer(weight_, frozen);
  set_grad_buffer(bias_, frozen);
}

bool ParallelLinearBase::enable_fp8(const Fp8Recipe& recipe, std::string_view name) {
  const Tensor& w = weight_.data;
  MC_CHECK(w.dtype() == DType::BF16 || w.dtype() == DType::F32,
           "{}.enable_fp8: the weight is {}; FP8 layers need bf16 (or f32) parameters (set trainer.precision = bf16)",
           name_, dtype_name(w.dtype()));
  if (recipe.scaling == Fp8Scaling::None) {
    fp8_.reset();
    return false;
  }
  if (w.size(0) % 16 != 0 || w.size(1) % 16 != 0) {
    log_line(LogLevel::Info, "fp8",
             fmt::format("{} {}: weight shard {} has a dimension that is not a multiple of 16; this layer stays in {}",
                         name_, name, shape_str(w.shape()), dtype_name(w.dtype())));
    fp8_.reset();
    return false;
  }
  fp8_ = std::make_unique<Fp8LinearState>(recipe, w.device());
  return true;
}

void ParallelLinearBase::fp8_begin_step(const Stream& s) {
  if (fp8_) fp8_->begin_step(tp_, s);
}

bool ParallelLinearBase::fp8_applies(int64_t rows) {
  if (!fp8_ || lora_) return false;
  if (rows % 16 == 0 && rows > 0) return true;
  log_once(LogLevel::Info, fmt::format("fp8-rows-{}-{}", name_, rows), "fp8",
           fmt::format("{}: {} rows are not a multiple of 16; products of this size run in {}", name_, rows,
                       dtype_name(weight_.data.dtype())));
  return false;
}

Tensor ParallelLinearBase::product(const ForwardContext& ctx, const Tensor& x2, const Tensor& bias,
                                   bool keep_fp8_input) {
  saved_input_t_ = Tensor();
  saved_input_t_scale_inv_ = Tensor();
  if (lora_ && lora_->fused_for(weight_.data)) return lora_->forward_fused(ctx, x2, weight_.data, bias);
  if (fp8_applies(x2.size(0))) {
    const Stream& s = ctx.stream;
    Tensor xq;
    if (ctx.training && keep_fp8_input && fp8_->recipe().wgrad && !frozen_) {
      // One pass gives the forward's codes and the weight gradient's transposed ones.
      Fp8Pair p = fp8_->cast_transpose(tp_, Fp8LinearState::kInput, x2, /*want_q=*/true, /*record=*/true, s);
      xq = std::move(p.q);
      saved_input_t_ = std::move(p.qt);
      saved_input_t_scale_inv_ = fp8_->scale_inv(Fp8LinearState::kInput).clone(s);
    } else {
      xq = fp8_->cast(tp_, Fp8LinearState::kInput, x2, s);
    }
    const Tensor& wq = fp8_->weight(tp_, weight_.data, s);
    Tensor y2 = Tensor::empty({x2.size(0), wq.size(0)}, weight_.data.dtype(), weight_.data.device(), s);
    ops::gemm_fp8(xq, wq, y2, fp8_->scale_inv(Fp8LinearState::kInput), fp8_->scale_inv(Fp8LinearState::kWeight),
                  {.fast_accum = true}, s);
    if (bias.defined()) add_bias_rows(y2, bias, s);
    return y2;
  }
  Tensor y2 = Tensor::empty({x2.size(0), weight_.data.size(0)}, weight_.data.dtype(), weight_.data.device(),
                            ctx.stream);
  gemm_xwt(x2, weight_.data, bias, y2, ctx.stream);
  if (lora_) lora_->forward(ctx, x2, y2);
  return y2;
}

std::pair<Stream, Stream> ParallelLinearBase::overlap_streams(const Stream& given, int priority) {
  const Device dev = weight_.data.device();
  if (!dev.is_cuda()) return {given, given};
  // A host Stream with CUDA tensors means the legacy default stream: name it so events can be recorded.
  const Stream s = given.device().is_cpu() ? Stream::default_stream(dev) : given;
  if (comm_stream_.device() != dev || comm_stream_.is_default())
    comm_stream_ = Stream::create(dev, /*non_blocking=*/true, priority);
  return {s, comm_stream_};
}

bool ParallelLinearBase::sp_forward_overlap_applies(bool asked) {
  if (!asked || tp_.size() == 1) return false;
  if (!fp8_ && !lora_) return true;
  log_once(LogLevel::Info, fmt::format("sp-forward-overlap-{}-{}", name_, fp8_ ? "fp8" : "lora"), "tp",
           fmt::format("{}: the overlapped sequence-parallel forward does not apply with {}; the forward all-gathers / "
                       "reduce-scatters serially",
                       name_, fp8_ ? "FP8 (its per-tensor input scale needs the whole input)" : "a LoRA adapter"));
  return false;
}

// The adapter's input gradient buffer takes the base's product with beta = 1, so no separate add.
Tensor ParallelLinearBase::backward_products(const ForwardContext& ctx, const Tensor& x2, const Tensor& dy2) {
  const Stream& s = ctx.stream;
  Tensor xt = std::exchange(saved_input_t_, Tensor()), xt_scale_inv = std::exchange(saved_input_t_scale_inv_, Tensor());
  const auto bf16_wgrad = [&] {
    MC_CHECK(x2.defined(), "{}.backward: forward kept only the FP8 input for an FP8 weight gradient, but FP8 no longer "
             "applies (an adapter was attached in between); run forward again", name_);
    ops::GemmOptions wg;
    wg.trans_a = true;
    wg.beta = 1.f;
    ops::gemm(dy2, x2, weight_.main_grad, wg, s);  // dW += dY^T X
  };
  if (fp8_applies(dy2.size(0))) {
    using St = Fp8LinearState;
    const bool wgrad8 = !frozen_ && fp8_->recipe().wgrad;
    Tensor dy = dy2.contiguous(s);
    Fp8Pair dyq;
    if (wgrad8) dyq = fp8_->cast_transpose(tp_, St::kGradOutput, dy, /*want_q=*/true, /*record=*/true, s);
    else dyq.q = fp8_->cast(tp_, St::kGradOutput, dy, s);
    if (wgrad8) {
      if (!xt.defined()) {
        // The input was kept in its dtype (the sequence-parallel column layer's chunk): cast it again, counted once.
        xt = fp8_->cast_transpose(tp_, St::kInput, x2, /*want_q=*/false, /*record=*/false, s).qt;
        xt_scale_inv = fp8_->scale_inv(St::kInput);
      }
      // dW += dYᵀ X with both operands K(= rows)-contiguous, f32 (or the grad buffer's dtype) accumulated.
      ops::gemm_fp8(dyq.qt, xt, weight_.main_grad, fp8_->scale_inv(St::kGradOutput), xt_scale_inv, {.beta = 1.f}, s);
    } else if (!frozen_) {
      bf16_wgrad();
    }
    const Tensor& wt = fp8_->weight_t(tp_, weight_.data, s);
    Tensor dx = Tensor::empty({dy2.size(0), wt.size(0)}, weight_.data.dtype(), weight_.data.device(), s);
    ops::gemm_fp8(dyq.q, wt, dx, fp8_->scale_inv(St::kGradOutput), fp8_->scale_inv(St::kWeight), {}, s);
    return dx;
  }
  if (!frozen_) bf16_wgrad();
  if (!lora_) return ops::matmul(dy2, weight_.data, {}, s);
  Tensor dx = lora_->backward(ctx, x2, dy2);
  ops::GemmOptions o;
  o.beta = 1.f;
  ops::gemm(dy2, weight_.data, dx, o, s);
  return dx;
}

// ---- ColumnParallelLinear ---------------------------------------------------------------------------

ColumnParallelLinear::ColumnParallelLinear(comm::Communicator& tp, int64_t in_features, int64_t out_features,
                                           const ColumnParallelLinearOptions& options)
    : ParallelLinearBase(tp, LoRAAdapter::Kind::Column, in_features, out_features, "ColumnParallelLinear"),
      out_local_(0), opts_(options) {
  constexpr std::string_view kName = "ColumnParallelLinear";
  check_features(in_, out_, kName);
  MC_CHECK(out_ % tp.size() == 0,
           "{}: out_features {} is not divisible by the TP size {}; make out_features a multiple of {} (or pad it)",
           kName, out_, tp.size(), tp.size());
  MC_CHECK(!(opts_.gather_output && opts_.sequence_parallel),
           "{}: gather_output and sequence_parallel cannot both be set (a sequence-parallel region ends in a "
           "row-parallel layer's reduce-scatter); turn gather_output off",
           kName);
  MC_CHECK(is_floating(opts_.params_dtype), "{}: params_dtype {} is not a float type; use f32, bf16 or f16", kName,
           dtype_name(opts_.params_dtype));
  MC_CHECK(!opts_.overlap_sp_forward || opts_.sequence_parallel,
           "{}: overlap_sp_forward overlaps the sequence-parallel all-gather and needs sequence_parallel; set "
           "sequence_parallel or turn overlap_sp_forward off",
           kName);
  out_local_ = out_ / tp.size();
  Tensor full = init_full_weight(out_, in_, opts_.init_std, opts_.seed, opts_.init_offset, opts_.params_dtype,
                                 opts_.device);
  weight_ = make_param("weight", full.narrow(0, tp.rank() * out_local_, out_local_).contiguous(), 0);
  if (opts_.bias) bias_ = make_param("bias", Tensor::zeros({out_local_}, opts_.params_dtype, opts_.device), 0);
}

Tensor ColumnParallelLinear::forward(const ForwardContext& ctx, const Tensor& x) {
  constexpr std::string_view kName = "ColumnParallelLinear.forward";
  const Stream& s = ctx.stream;
  check_activation(x, in_, opts_.params_dtype, opts_.device, kName, "the input",
                   fmt::format("the layer was built with in_features = {}", in_));
  if (opts_.sequence_parallel) check_sequence_chunk(x, kName, "the input");
  if (opts_.sequence_parallel && sp_forward_overlap_applies(opts_.overlap_sp_forward)) {
    Tensor y = forward_sp_overlapped(s, x);
    saved_input_t_ = Tensor();
    saved_input_t_scale_inv_ = Tensor();
    saved_input_ = ctx.training ? x : Tensor();
    saved_shape_ = x.shape();
    return y;
  }
  Tensor total = opts_.sequence_parallel ? pm::all_gather_from_sp_forward(tp_, x, s) : pm::copy_to_tp_forward(tp_, x, s);
  Tensor x2 = as_rows(total, in_, s);
  // With SP the bf16 chunk is smaller than the gathered input's FP8 codes (TP > 2) and is kept, unless the recipe
  // keeps the gathered codes (Fp8Recipe::keep_gathered_input).
  const bool keep_fp8 = !opts_.sequence_parallel || (fp8_ && fp8_->recipe().keep_gathered_input);
  Tensor y2 = product(ctx, x2, opts_.bias ? bias_.data : Tensor(), keep_fp8);
  saved_input_ = ctx.training && !saved_input_t_.defined() ? x : Tensor();
  saved_shape_ = x.shape();
  Tensor y = y2.view(with_last(total.shape(), out_local_));
  return opts_.gather_output ? pm::gather_from_tp_forward(tp_, y, s) : y;
}

Tensor ColumnParallelLinear::backward(const ForwardContext& ctx, const Tensor& dy) {
  constexpr std::string_view kName = "ColumnParallelLinear.backward";
  const Stream& s = ctx.stream;
  MC_CHECK(has_saved_input(),
           "{}: no saved input; call forward with ctx.training = true before backward (each forward allows one "
           "backward)",
           kName);
  const int64_t dy_features = opts_.gather_output ? out_ : out_local_;
  check_activation(dy, dy_features, opts_.params_dtype, opts_.device, kName, "dy",
                   "pass the gradient of forward's output, which has the same shape");
  Tensor dyl = opts_.gather_output ? pm::gather_from_tp_backward(tp_, dy, s) : dy;
  if (opts_.overlap_grad_comm && tp_.size() > 1 && !lora_ && !frozen_ && !fp8_) return backward_overlapped(s, dyl);
  // With SP the input is re-gathered here instead of being kept whole since forward (unless forward kept its
  // transposed FP8 codes instead: saved_input_ is then empty).
  Tensor total = opts_.sequence_parallel && saved_input_.defined()
                     ? pm::all_gather_from_sp_forward(tp_, saved_input_, s)
                     : saved_input_;
  Shape total_shape = total.defined() ? total.shape() : saved_shape_;
  if (!total.defined() && opts_.sequence_parallel) total_shape[0] *= tp_.size();
  Tensor x2 = total.defined() ? as_rows(total, in_, s) : Tensor();
  const int64_t rows = x2.defined() ? x2.size(0) : saved_input_t_.size(1);
  Tensor dy2 = as_rows(dyl, out_local_, s);
  MC_CHECK(dy2.size(0) == rows,
           "{}: dy has shape {} but forward's output had {} rows; pass the gradient of forward's output", kName,
           shape_str(dy.shape()), rows);
  if (opts_.bias && !frozen_) accumulate_bias_grad(bias_.main_grad, dy2, s);
  Tensor dx = backward_products(ctx, x2, dy2).view(total_shape);
  saved_input_ = Tensor();
  return opts_.sequence_parallel ? pm::all_gather_from_sp_backward(tp_, dx, s) : pm::copy_to_tp_backward(tp_, dx, s);
}

// The ring all-gather + GEMM (see the header comment). The chunks received from the other ranks go to one
// buffer of TP − 1 chunks (step i's arrival in slot i), from where the next step forwards them.
Tensor ColumnParallelLinear::forward_sp_overlapped(const Stream& given, const Tensor& x) {
  const auto [s, comm_s] = overlap_streams(given, opts_.comm_stream_priority);
  const int n = tp_.size(), r = tp_.rank();
  Tensor held = as_rows(x, in_, s);
  const int64_t m = held.size(0);
  const DType dt = weight_.data.dtype();
  Tensor arrived = Tensor::empty({(n - 1) * m, in_}, dt, opts_.device, s);
  Tensor y2 = Tensor::empty({n * m, out_local_}, dt, opts_.device, s);
  const Tensor bias = opts_.bias ? bias_.data : Tensor();
  for (int i = 0; i < n; ++i) {
    OverlappedCollective pass(s, comm_s);
    Tensor next;
    if (i + 1 < n) {
      next = arrived.narrow(0, i * m, m);
      pass.start_ring_step(tp_, held, next, /*after_compute=*/i == 0);
    }
    Tensor rows = y2.narrow(0, int64_t((r - i + n) % n) * m, m);
    gemm_xwt(held, weight_.data, bias, rows, s);
    pass.finish();
    held = next;
  }
  Shape total_shape = x.shape();
  total_shape[0] *= n;
  return y2.view(with_last(total_shape, out_local_));
}

Tensor ColumnParallelLinear::backward_overlapped(const Stream& given, const Tensor& dyl) {
  constexpr std::string_view kName = "ColumnParallelLinear.backward";
  const auto [s, comm_s] = overlap_streams(given, opts_.comm_stream_priority);
  const int64_t tpn = tp_.size();

  Shape total_shape = saved_input_.shape();
  if (opts_.sequence_parallel) total_shape[0] *= tpn;
  int64_t rows = 1;
  for (int64_t d : total_shape) rows *= d;
  rows /= in_;
  Tensor dy2 = as_rows(dyl, out_local_, s);
  MC_CHECK(dy2.size(0) == rows,
           "{}: dy has shape {} but forward's output had {} rows; pass the gradient of forward's output", kName,
           shape_str(dyl.shape()), rows);

  // SP: re-gather the saved input chunk while the grad-input GEMM runs.
  Tensor total = saved_input_;
  OverlappedCollective gather(s, comm_s);
  if (opts_.sequence_parallel) {
    Tensor chunk = saved_input_.contiguous(s);
    total = Tensor::empty(total_shape, chunk.dtype(), chunk.device(), s);
    gather.start({chunk, total}, [&](const Stream& cs) { return tp_.all_gather(chunk, total, cs); });
  }
  Tensor dx = ops::matmul(dy2, weight_.data, {}, s);  // dX = dY W, [rows, in], contiguous
  gather.finish();

  // The input-gradient collective runs while the weight-gradient GEMM computes.
  Tensor result;
  OverlappedCollective reduce(s, comm_s);
  if (opts_.sequence_parallel) {
    Shape chunk_shape = total_shape;
    chunk_shape[0] /= tpn;
    result = Tensor::empty(chunk_shape, dx.dtype(), dx.device(), s);
    reduce.start({dx, result}, [&](const Stream& cs) { return tp_.reduce_scatter(dx, result, comm::ReduceOp::Sum, cs); });
  } else {
    result = dx.view(total_shape);
    reduce.start({dx}, [&](const Stream& cs) { return tp_.all_reduce(dx, comm::ReduceOp::Sum, cs); });
  }
  Tensor x2 = as_rows(total, in_, s);
  ops::GemmOptions wg;
  wg.trans_a = true;
  wg.beta = 1.f;
  ops::gemm(dy2, x2, weight_.main_grad, wg, s);  // dW += dY^T X
  if (opts_.bias) accumulate_bias_grad(bias_.main_grad, dy2, s);
  reduce.finish();
  saved_input_ = Tensor();
  return result;
}

// ---- RowParallelLinear ------------------------------------------------------------------------------

RowParallelLinear::RowParallelLinear(comm::Communicator& tp, int64_t in_features, int64_t out_features,
                                     const RowParallelLinearOptions& options)
    : ParallelLinearBase(tp, LoRAAdapter::Kind::Row, in_features, out_features, "RowParallelLinear"), in_local_(0),
      opts_(options) {
  constexpr std::string_view kName = "RowParallelLinear";
  check_features(in_, out_, kName);
  MC_CHECK(in_ % tp.size() == 0,
           "{}: in_features {} is not divisible by the TP size {}; make in_features a multiple of {} (or pad it)",
           kName, in_, tp.size(), tp.size());
  MC_CHECK(!opts_.sequence_parallel || opts_.input_is_parallel,
           "{}: sequence_parallel needs input_is_parallel = true (the input must come split from a column-parallel "
           "layer); set input_is_parallel",
           kName);
  MC_CHECK(is_floating(opts_.params_dtype), "{}: params_dtype {} is not a float type; use f32, bf16 or f16", kName,
           dtype_name(opts_.params_dtype));
  MC_CHECK(!opts_.overlap_sp_forward || opts_.sequence_parallel,
           "{}: overlap_sp_forward overlaps the sequence-parallel reduce-scatter and needs sequence_parallel; set "
           "sequence_parallel or turn overlap_sp_forward off",
           kName);
  in_local_ = in_ / tp.size();
  Tensor full = init_full_weight(out_, in_, opts_.init_std, opts_.seed, opts_.init_offset, opts_.params_dtype,
                                 opts_.device);
  weight_ = make_param("weight", full.narrow(1, tp.rank() * in_local_, in_local_).contiguous(), 1);
  if (opts_.bias) {
    bias_ = make_param("bias", Tensor::zeros({out_}, opts_.params_dtype, opts_.device), -1);
    bias_.sequence_parallel = opts_.sequence_parallel;
  }
}

Tensor RowParallelLinear::forward(const ForwardContext& ctx, const Tensor& x) {
  constexpr std::string_view kName = "RowParallelLinear.forward";
  const Stream& s = ctx.stream;
  const int64_t x_features = opts_.input_is_parallel ? in_local_ : in_;
  check_activation(x, x_features, opts_.params_dtype, opts_.device, kName, "the input",
                   opts_.input_is_parallel
                       ? fmt::format("with input_is_parallel it is this rank's slice in_features / TP = {} / {}", in_,
                                     tp_.size())
                       : fmt::format("without input_is_parallel it is the full in_features = {}", in_));
  if (opts_.sequence_parallel) check_sequence_chunk(x, kName, "the input");
  Tensor xin = opts_.input_is_parallel ? x : pm::scatter_to_tp_forward(tp_, x, s);
  Tensor x2 = as_rows(xin, in_local_, s);
  Tensor y;
  if (opts_.sequence_parallel && sp_forward_overlap_applies(opts_.overlap_sp_forward)) {
    MC_CHECK(xin.size(0) % tp_.size() == 0,
             "{}: the input's sequence dimension {} is not divisible by the TP size {}, which the sequence-parallel "
             "reduce-scatter needs; use a sequence length that is a multiple of {}",
             kName, xin.size(0), tp_.size(), tp_.size());
    Shape chunk_shape = with_last(xin.shape(), out_);
    chunk_shape[0] /= tp_.size();
    saved_input_t_ = Tensor();
    saved_input_t_scale_inv_ = Tensor();
    y = forward_sp_overlapped(s, x2, x2.size(0) / tp_.size()).view(chunk_shape);
  } else {
    // The low-rank path joins before the reduction: B is replicated, h a TP-partial sum.
    Tensor partial2 = product(ctx, x2, Tensor(), /*keep_fp8_input=*/true);
    Tensor partial = partial2.view(with_last(xin.shape(), out_));
    y = opts_.sequence_parallel ? pm::reduce_scatter_to_sp_forward(tp_, partial, s)
                                : pm::reduce_from_tp_forward(tp_, partial, s);
  }
  if (opts_.bias) {
    // After the reduction, so the bias is added once and not TP times.
    Tensor y2 = y.view({y.numel() / out_, out_});
    add_bias_rows(y2, bias_.data, s);
  }
  saved_input_ = ctx.training && !saved_input_t_.defined() ? xin : Tensor();
  saved_shape_ = xin.shape();
  return y;
}

// The ring GEMM + reduce-scatter (see the header comment): returns this rank's chunk of the summed product,
// [m, out]. Step i's partial and receive buffers are slot i mod 2; a slot is written again two steps later,
// after the compute stream has waited for the exchange that used it.
Tensor RowParallelLinear::forward_sp_overlapped(const Stream& given, const Tensor& x2, int64_t m) {
  const auto [s, comm_s] = overlap_streams(given, opts_.comm_stream_priority);
  const int n = tp_.size(), r = tp_.rank();
  const DType dt = weight_.data.dtype();
  Tensor partial[2], arrived[2];
  for (int k = 0; k < 2; ++k) {
    partial[k] = Tensor::empty({m, out_}, dt, opts_.device, s);
    if (k < n - 1) arrived[k] = Tensor::empty({m, out_}, dt, opts_.device, s);  // TP 2 receives once
  }
  OverlappedCollective pass[2] = {OverlappedCollective(s, comm_s), OverlappedCollective(s, comm_s)};
  for (int i = 0; i < n; ++i) {
    Tensor& p = partial[i % 2];
    gemm_xwt(x2.narrow(0, int64_t((r - i - 1 + 2 * n) % n) * m, m), weight_.data, Tensor(), p, s);
    if (i > 0) {
      pass[(i - 1) % 2].finish();
      ops::accumulate(p, arrived[(i - 1) % 2], s);
    }
    if (i + 1 < n) pass[i % 2].start_ring_step(tp_, p, arrived[i % 2], /*after_compute=*/true);
  }
  return partial[(n - 1) % 2];
}

Tensor RowParallelLinear::backward(const ForwardContext& ctx, const Tensor& dy) {
  constexpr std::string_view kName = "RowParallelLinear.backward";
  const Stream& s = ctx.stream;
  MC_CHECK(has_saved_input(),
           "{}: no saved input; call forward with ctx.training = true before backward (each forward allows one "
           "backward)",
           kName);
  check_activation(dy, out_, opts_.params_dtype, opts_.device, kName, "dy",
                   "pass the gradient of forward's output, which has the same shape");
  if (opts_.sequence_parallel) check_sequence_chunk(dy, kName, "dy");
  Tensor dy_total = opts_.sequence_parallel ? pm::reduce_scatter_to_sp_backward(tp_, dy, s)
                                            : pm::reduce_from_tp_backward(tp_, dy, s);
  Tensor x2 = saved_input_.defined() ? as_rows(saved_input_, in_local_, s) : Tensor();
  const int64_t rows = x2.defined() ? x2.size(0) : saved_input_t_.size(1);
  Tensor dy2 = as_rows(dy_total, out_, s);
  MC_CHECK(dy2.size(0) == rows,
           "{}: dy has shape {} but forward's output had {} rows{}; pass the gradient of forward's output", kName,
           shape_str(dy.shape()), rows / (opts_.sequence_parallel ? tp_.size() : 1),
           opts_.sequence_parallel ? " on this rank" : "");
  // With SP each rank sees only its sequence chunk's dy: a partial bias gradient (flagged on the param).
  if (opts_.bias && !frozen_) accumulate_bias_grad(bias_.main_grad, as_rows(dy, out_, s), s);
  const Shape in_shape = saved_input_.defined() ? saved_input_.shape() : saved_shape_;
  Tensor dx = backward_products(ctx, x2, dy2).view(in_shape);
  saved_input_ = Tensor();
  return opts_.input_is_parallel ? dx : pm::scatter_to_tp_backward(tp_, dx, s);
}

void allreduce_sequence_parallel_grads(comm::Communicator& tp, const std::vector<Parameter*>& params,
                                       const Stream& s) {
  if (tp.size() == 1) return;
  for (Parameter* p : params)
    if (p && p->sequence_parallel) {
      MC_CHECK(p->main_grad.is_contiguous(), "allreduce_sequence_parallel_grads: main_grad of '{}' is not contiguous; "
               "allocate gradients contiguous", p->name);
      tp.all_reduce(p->main_grad, comm::ReduceOp::Sum, s)->wait_on(s);
    }
}


}  // namespace megacore::layers
