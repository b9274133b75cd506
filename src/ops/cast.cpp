#include "megacore/ops/cast.hpp"

#include "megacore/ops/ops_common.hpp"
#include "megacore/ops/optimizer.hpp"

namespace megacore::ops {

// A cast is a scale by one: the multi-tensor scale kernel converts between any two float dtypes with
// 16-byte accesses, and its CPU path rounds once, like the kernel.
void cast(const Tensor& src, Tensor& dst, const Stream& s) {
  const char* op = "cast";
  detail::check_float_input(src, op, "src");
  detail::check_float_input(dst, op, "dst");
  detail::check_shape(dst, src.shape(), op, "dst");
  detail::check_same_device(dst, src.device(), op, "dst");
  multi_tensor_scale({src}, {dst}, 1.f, {}, s);
}

}  // namespace megacore::ops
