// TP/SP region mappings. The communicators gather and scatter along the flat (first) dimension, so a
// seq (dim 0) gather is one collective on contiguous memory, while a last-dim gather goes through a
// [TP, ..., h/TP] buffer that is then permuted into [..., TP, h/TP] = [..., h].
#include "megacore/parallel/mappings.hpp"

#include <fmt/format.h>


namespace megacore::parallel {
namespace {

int64_t normalize_dim(const Tensor& x, int64_t dim, std::string_view op) {
  MC_CHECK(x.defined(), "{}: the tensor is undefined; pass the activation produced by the previous layer", op);
  MC_CHECK(x.dim() >= 1, "{}: a 0-d tensor has no dimension to split or gather; give it at least one dimension", op);
  int64_t d = dim < 0 ? dim + x.dim() : dim;
  MC_CHECK(d == 0 || d == x.dim() - 1,
           "{}: only the sequence dimension (0) or the last dimension can be split or gathered, got dim {} of a "
           "{}-d tensor; move the dimension first (permute) or use dim 0 / -1",
           op, dim, x.dim());
  return d;
}

}  // namespace

Tensor split_along(comm::Communicator& tp, const Tensor& x, int64_t dim, const Stream& s) {
  const int64_t d = normalize_dim(x, dim, "split_along");
  const int64_t n = x.size(d), parts = tp.size();
  MC_CHECK(n % parts == 0,
           "split_along: dimension {} of {} has size {}, which is not divisible by the {} ranks of group '{}'; pad it to "
           "a multiple of {}{}",
           d, shape_str(x.shape()), n, parts, tp.name(), parts,
           d == 0 ? " (for sequence parallelism: make the sequence length a multiple of TP)" : "");
  if (parts == 1) return x;
  const int64_t chunk = n / parts;
  // A dim-0 chunk of a contiguous tensor is contiguous: no copy.
  return x.narrow(d, tp.rank() * chunk, chunk).contiguous(s);
}

Tensor all_gather_along(comm::Communicator& tp, const Tensor& x, int64_t dim, const Stream& s) {
  const int64_t d = normalize_dim(x, dim, "all_gather_along");
  const int64_t parts = tp.size();
  if (parts == 1) return x;
  Tensor in = x.contiguous(s);
  if (d == 0) {
    Shape out_shape = in.shape();
    out_shape[0] *= parts;
    Tensor out = Tensor::empty(out_shape, in.dtype(), in.device(), s);
    tp.all_gather(in, out, s)->wait_on(s);
    return out;
  }
  // Last dim: gather into [TP, ..., h/TP], then move the TP axis next to the feature axis.
  Shape buf_shape{parts};
  buf_shape.insert(buf_shape.end(), in.shape().begin(), in.shape().end());
  Tensor buf = Tensor::empty(buf_shape, in.dtype(), in.device(), s);
  tp.all_gather(in, buf, s)->wait_on(s);
  const int64_t nd = in.dim();
  std::vector<int64_t> perm;
  for (int64_t i = 1; i < nd; ++i) perm.push_back(i);
  perm.push_back(0);
  perm.push_back(nd);
  Shape out_shape = in.shape();
  out_shape.back() *= parts;
  return buf.permute(perm).contiguous(s).view(out_shape);
}

Tensor reduce_scatter_along_first(comm::Communicator& tp, const Tensor& x, const Stream& s) {
  normalize_dim(x, 0, "reduce_scatter_along_first");
  const int64_t parts = tp.size();
  MC_CHECK(x.size(0) % parts == 0,
           "reduce_scatter_along_first: dimension 0 of {} has size {}, which is not divisible by the {} ranks of group "
           "'{}'; make the sequence length a multiple of TP",
           shape_str(x.shape()), x.size(0), parts, tp.name());
  if (parts == 1) return x;
  Tensor in = x.contiguous(s);
  Shape out_shape = in.shape();
  out_shape[0] /= parts;
  Tensor out = Tensor::empty(out_shape, in.dtype(), in.device(), s);
  tp.reduce_scatter(in, out, comm::ReduceOp::Sum, s)->wait_on(s);
  return out;
}

Tensor all_reduce_sum(comm::Communicator& tp, Tensor x, const Stream& s) {
  MC_CHECK(x.defined(), "all_reduce_sum: the tensor is undefined; pass the activation or gradient to reduce");
  if (tp.size() == 1) return x;
  if (!x.is_contiguous()) x = x.contiguous(s);
  tp.all_reduce(x, comm::ReduceOp::Sum, s)->wait_on(s);
  return x;
}

Tensor copy_to_tp_forward(comm::Communicator&, Tensor x, const Stream&) { return x; }
Tensor copy_to_tp_backward(comm::Communicator& tp, Tensor dy, const Stream& s) {
  return all_reduce_sum(tp, std::move(dy), s);
}
Tensor reduce_from_tp_forward(comm::Communicator& tp, Tensor x, const Stream& s) {
  return all_reduce_sum(tp, std::move(x), s);
}
Tensor reduce_from_tp_backward(comm::Communicator&, Tensor dy, const Stream&) { return dy; }

Tensor scatter_to_sp_forward(comm::Communicator& tp, const Tensor& x, const Stream& s) {
  return split_along(tp, x, 0, s);
}
Tensor scatter_to_sp_backward(comm::Communicator& tp, const Tensor& dy, const Stream& s) {
  return all_gather_along(tp, dy, 0, s);
}
Tensor gather_from_sp_forward(comm::Communicator& tp, const Tensor& x, const Stream& s) {
  return all_gather_along(tp, x, 0, s);
}
Tensor gather_from_sp_backward(comm::Communicator& tp, const Tensor& dy, const Stream& s) {
  return split_along(tp, dy, 0, s);
}
Tensor reduce_scatter_to_sp_forward(comm::Communicator& tp, const Tensor& x, const Stream& s) {
  return reduce_scatter_along_first(tp, x, s);
}
Tensor reduce_scatter_to_sp_backward(comm::Communicator& tp, const Tensor& dy, const Stream& s) {
  return all_gather_along(tp, dy, 0, s);
}
Tensor all_gather_from_sp_forward(comm::Communicator& tp, const Tensor& x, const Stream& s) {
  return all_gather_along(tp, x, 0, s);
}
Tensor all_gather_from_sp_backward(comm::Communicator& tp, const Tensor& dy, const Stream& s) {
  return reduce_scatter_along_first(tp, dy, s);
}
Tensor scatter_to_tp_forward(comm::Communicator& tp, const Tensor& x, const Stream& s) {
  return split_along(tp, x, -1, s);
}
Tensor scatter_to_tp_backward(comm::Communicator& tp, const Tensor& dy, const Stream& s) {
  return all_gather_along(tp, dy, -1, s);
}
Tensor gather_from_tp_forward(comm::Communicator& tp, const Tensor& x, const Stream& s) {
  return all_gather_along(tp, x, -1, s);
}
Tensor gather_from_tp_backward(comm::Communicator& tp, const Tensor& dy, const Stream& s) {
  return split_along(tp, dy, -1, s);
}

}  // namespace megacore::parallel
