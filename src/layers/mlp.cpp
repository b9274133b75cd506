#include "megacore/layers/mlp.hpp"

#include "megacore/ops/activation.hpp"

namespace megacore::layers {
namespace {

constexpr std::string_view kName = "MLP";

bool is_swiglu(const MLPOptions& o) { return o.activation == ActivationType::SwiGLU; }

// Validated before fc1/fc2 are built so the error names the MLP's argument, not fc1's width.
int64_t checked_fc1_width(comm::Communicator& tp, int64_t hidden, int64_t ffn, const MLPOptions& o) {
  MC_CHECK(hidden > 0 && ffn > 0, "{}: hidden_size {} and ffn_hidden_size {} must be positive", kName, hidden, ffn);
  MC_CHECK(ffn % tp.size() == 0,
           "{}: ffn_hidden_size {} is not divisible by the TP size {}; make ffn_hidden_size a multiple of {}", kName,
           ffn, tp.size(), tp.size());
  return is_swiglu(o) ? 2 * ffn : ffn;
}

ColumnParallelLinearOptions fc1_options(const MLPOptions& o) {
  ColumnParallelLinearOptions c;
  c.bias = o.bias;
  c.sequence_parallel = o.sequence_parallel;
  c.params_dtype = o.params_dtype;
  c.device = o.device;
  c.init_std = o.init_std;
  c.seed = o.seed;
  c.init_offset = o.init_offset;
  return c;
}

RowParallelLinearOptions fc2_options(const MLPOptions& o) {
  RowParallelLinearOptions r;
  r.bias = o.bias;
  r.input_is_parallel = true;
  r.sequence_parallel = o.sequence_parallel;
  r.params_dtype = o.params_dtype;
  r.device = o.device;
  r.init_std = o.output_init_std >= 0 ? o.output_init_std : o.init_std;
  r.seed = o.seed;
  r.init_offset = o.init_offset + 2;
  return r;
}

}  // namespace

MLP::MLP(comm::Communicator& tp, int64_t hidden_size, int64_t ffn_hidden_size, const MLPOptions& options)
    : tp_(tp),
      hidden_(hidden_size),
      ffn_(ffn_hidden_size),
      opts_(options),
      fc1_(tp, hidden_size, checked_fc1_width(tp, hidden_size, ffn_hidden_size, options), fc1_options(options)),
      fc2_(tp, ffn_hidden_size, hidden_size, fc2_options(options)) {
  if (is_swiglu(opts_)) {
    // fc1 drew a fused [2·ffn, h] weight; replace its shard by [gate rows r ; up rows r] of the
    // separately drawn full gate and up weights (independent of TP).
    const int64_t f_local = ffn_ / tp.size();
    const int64_t row0 = int64_t(tp.rank()) * f_local;
    Tensor gate = init_full_weight(ffn_, hidden_, opts_.init_std, opts_.seed, opts_.init_offset, opts_.params_dtype,
                                   opts_.device);
    Tensor up = init_full_weight(ffn_, hidden_, opts_.init_std, opts_.seed, opts_.init_offset + 1,
                                 opts_.params_dtype, opts_.device);
    Tensor& w = fc1_.weight().data;
    w.narrow(0, 0, f_local).copy_(gate.narrow(0, row0, f_local));
    w.narrow(0, f_local, f_local).copy_(up.narrow(0, row0, f_local));
    for (Parameter* p : fc1_.parameters()) p->partition_chunks = 2;  // the bias too, when there is one
  }
}

Tensor MLP::forward(const ForwardContext& ctx, const Tensor& x) {
  const Stream& s = ctx.stream;
  Tensor h = fc1_.forward(ctx, x);  // [..., fc1_width / TP]
  Shape act_shape = h.shape();
  act_shape.back() = ffn_ / tp_.size();
  Tensor a = Tensor::empty(act_shape, opts_.params_dtype, opts_.device, s);
  if (is_swiglu(opts_))
    ops::swiglu_forward(h, a, s);
  else
    ops::activation_forward(ops::Activation::GeluTanh, h, a, s);
  saved_fc1_out_ = ctx.training ? h : Tensor();
  return fc2_.forward(ctx, a);
}

Tensor MLP::backward(const ForwardContext& ctx, const Tensor& dy) {
  const Stream& s = ctx.stream;
  MC_CHECK(saved_fc1_out_.defined(),
           "{}.backward: no saved activations; call forward with ctx.training = true before backward (each forward "
           "allows one backward)",
           kName);
  Tensor da = fc2_.backward(ctx, dy);
  Tensor dh = Tensor::empty(saved_fc1_out_.shape(), opts_.params_dtype, opts_.device, s);
  if (is_swiglu(opts_))
    ops::swiglu_backward(da.contiguous(s), saved_fc1_out_, dh, s);
  else
    ops::activation_backward(ops::Activation::GeluTanh, da.contiguous(s), saved_fc1_out_, dh, s);
  saved_fc1_out_ = Tensor();
  return fc1_.backward(ctx, dh);
}

std::vector<Parameter*> MLP::parameters() {
  std::vector<Parameter*> p = fc1_.parameters();
  for (Parameter* q : fc2_.parameters()) p.push_back(q);
  return p;
}

void MLP::zero_grad() {
  fc1_.zero_grad();
  fc2_.zero_grad();
}

void MLP::stash_activations(ActivationStash& s) {
  fc1_.stash_activations(s);
  fc2_.stash_activations(s);
  s.put(saved_fc1_out_);
}

void MLP::restore_activations(ActivationStash& s) {
  fc1_.restore_activations(s);
  fc2_.restore_activations(s);
  s.take(saved_fc1_out_);
}

}  // namespace megacore::layers
