// Typed collectives: comm::all_reduce / all_gather / reduce_scatter / broadcast on std::span<T>.
//
// Thin templates over the runtime Communicator (communicator.hpp): the element type picks the DType at
// compile time (core/element_traits.hpp), the span is wrapped as a 1-D tensor without a copy, and the
// backend's own operation runs, so MPI and NCCL communicators take the same calls. An element type with
// no DType (double, a user struct) is a static_assert at the call naming the supported types.
//
// Memory: the spans must live where the communicator's tensors live (Communicator::device(): host
// memory for MPI, that CUDA device's memory for NCCL). Operations are asynchronous like the runtime
// ones: keep the spans alive and wait on the returned Work before reading them. all_reduce_value is the
// synchronous one-scalar form, for host values (metrics) on either backend.
//
//   std::vector<float> grad_sq(n);
//   comm::all_reduce(dp, std::span(grad_sq), comm::ReduceOp::Sum)->wait();
//   double worst = comm::all_reduce_value(world, step_seconds_f32, comm::ReduceOp::Max);
#pragma once

#include <cstdint>
#include <ranges>
#include <span>
#include <type_traits>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/element_traits.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::comm {

namespace detail {
/// A 1-D tensor over n elements at p on the communicator's device (no copy, not owned).
template <class T>
Tensor wrap_span(const Communicator& c, T* p, size_t n) {
  constexpr DType dt = element_dtype<T>();
  return Tensor::from_blob(const_cast<std::remove_cv_t<T>*>(p), {int64_t(n)}, {1}, dt, c.device());
}
/// A dynamic-extent span over a contiguous range (std::span(std::array) would have a static extent).
template <class R>
auto as_span(R& r) {
  using E = std::remove_reference_t<std::ranges::range_reference_t<R&>>;
  return std::span<E>(std::ranges::data(r), size_t(std::ranges::size(r)));
}
}  // namespace detail

/// In place: every rank ends with op over all ranks' `data`.
/// @param c     the group (MPI: host memory; NCCL: memory on c.device())
/// @param data  [n] elements of T, read and written; n must be the same on every rank
/// @param op    Sum, Avg, Max or Min
/// @param s     stream the operation is ordered on (NCCL); ignored by MPI
template <class T>
[[nodiscard]] WorkPtr all_reduce(Communicator& c, std::span<T> data, ReduceOp op = ReduceOp::Sum,
                                 const Stream& s = {}) {
  static_assert(!std::is_const_v<T>, "comm::all_reduce writes its span: pass std::span<T>, not std::span<const T>");
  Tensor t = detail::wrap_span(c, data.data(), data.size());
  return c.all_reduce(t, op, s);
}

/// out holds rank r's `in` at [r * n, (r + 1) * n).
/// @param in   [n] elements of T, read
/// @param out  [c.size() * n] elements of T, written (ValueError naming the size otherwise)
template <class T, class U>
  requires std::is_same_v<std::remove_const_t<T>, U>
[[nodiscard]] WorkPtr all_gather(Communicator& c, std::span<T> in, std::span<U> out, const Stream& s = {}) {
  MC_CHECK(out.size() == in.size() * size_t(c.size()),
           "comm::all_gather on '{}': out has {} elements but needs size() * in.size() = {} * {} = {}; size it so",
           c.name(), out.size(), c.size(), in.size(), in.size() * size_t(c.size()));
  Tensor ti = detail::wrap_span(c, in.data(), in.size());
  Tensor to = detail::wrap_span(c, out.data(), out.size());
  return c.all_gather(ti, to, s);
}

/// Rank r gets op over all ranks of in[r * n, (r + 1) * n).
/// @param in   [c.size() * n] elements of T, read
/// @param out  [n] elements of T, written (ValueError naming the size otherwise)
template <class T, class U>
  requires std::is_same_v<std::remove_const_t<T>, U>
[[nodiscard]] WorkPtr reduce_scatter(Communicator& c, std::span<T> in, std::span<U> out, ReduceOp op = ReduceOp::Sum,
                                     const Stream& s = {}) {
  MC_CHECK(in.size() == out.size() * size_t(c.size()),
           "comm::reduce_scatter on '{}': in has {} elements but needs size() * out.size() = {} * {} = {}; size it so",
           c.name(), in.size(), c.size(), out.size(), out.size() * size_t(c.size()));
  Tensor ti = detail::wrap_span(c, in.data(), in.size());
  Tensor to = detail::wrap_span(c, out.data(), out.size());
  return c.reduce_scatter(ti, to, op, s);
}

/// In place: every rank ends with `root`'s data.
/// @param data  [n] elements of T: read on root, written elsewhere
/// @param root  rank in c
template <class T>
[[nodiscard]] WorkPtr broadcast(Communicator& c, std::span<T> data, int root, const Stream& s = {}) {
  static_assert(!std::is_const_v<T>, "comm::broadcast writes its span: pass std::span<T>, not std::span<const T>");
  MC_CHECK(root >= 0 && root < c.size(), "comm::broadcast on '{}': root {} is not a rank of a group of {}", c.name(),
           root, c.size());
  Tensor t = detail::wrap_span(c, data.data(), data.size());
  return c.broadcast(t, root, s);
}

// Contiguous ranges (std::vector<T>, std::array<T, N>, ...) go through the span overloads. Lvalues
// only: the operation outlives the call, so a temporary container would be freed under it.
template <std::ranges::contiguous_range R>
  requires std::ranges::sized_range<R>
[[nodiscard]] WorkPtr all_reduce(Communicator& c, R& data, ReduceOp op = ReduceOp::Sum, const Stream& s = {}) {
  return all_reduce(c, detail::as_span(data), op, s);
}
template <std::ranges::contiguous_range R>
  requires std::ranges::sized_range<R>
[[nodiscard]] WorkPtr broadcast(Communicator& c, R& data, int root, const Stream& s = {}) {
  return broadcast(c, detail::as_span(data), root, s);
}

/// Synchronous reduction of one host value over c (either backend: NCCL stages it through c.device()).
/// Returns op over every rank's `value`.
template <class T>
T all_reduce_value(Communicator& c, T value, ReduceOp op = ReduceOp::Sum, const Stream& s = {}) {
  constexpr DType dt = element_dtype<T>();
  Tensor host = Tensor::empty({1}, dt);
  *static_cast<T*>(host.data_ptr()) = value;
  if (c.device().is_cpu()) {
    c.all_reduce(host, op, s)->wait();
    return *static_cast<T*>(host.data_ptr());
  }
  Tensor dev = host.to(c.device(), s);
  c.all_reduce(dev, op, s)->wait();
  Tensor back = Tensor::empty({1}, dt);
  back.copy_(dev, s);
  s.synchronize();
  return *static_cast<T*>(back.data_ptr());
}

}  // namespace megacore::comm
