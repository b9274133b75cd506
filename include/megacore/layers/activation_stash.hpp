// ActivationStash: the saved activations of one forward, moved out of the modules that hold them.
//
// Modules keep what their backward needs in members ("one forward held at a time"). A pipeline
// schedule runs several micro-batches through a model chunk before their backwards (1F1B keeps up to
// PP of them in flight on a stage), so after each forward it moves the modules' saved state into a
// stash and, before that micro-batch's backward, moves it back:
//
//   model.forward_stage(...);  ActivationStash s = model.stash_activations();   // modules now empty
//   ...                                                                         // other micro-batches
//   model.restore_activations(std::move(s));   model.backward_stage(...);
//
// Each module writes its saved members in a fixed order (stash_activations(ActivationStash&)) and
// reads them back in the same order (restore_activations(ActivationStash&)); the stash is a FIFO of
// tensor handles and integers, so moving state out and in copies no activation data. A module whose
// forward ran with ctx.training = false (or that has no forward) stashes undefined tensors, which
// restore as "nothing saved".
#pragma once

#include <cstdint>
#include <deque>
#include <utility>

#include "megacore/core/error.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::layers {

class ActivationStash {
 public:
  ActivationStash() = default;
  ActivationStash(ActivationStash&&) noexcept = default;
  ActivationStash& operator=(ActivationStash&&) noexcept = default;
  ActivationStash(const ActivationStash&) = delete;
  ActivationStash& operator=(const ActivationStash&) = delete;

  /// Moves `t` in (t becomes undefined).
  void put(Tensor& t) {
    tensors_.push_back(std::exchange(t, Tensor()));
    if (tensors_.back().defined()) bytes_ += tensors_.back().nbytes();
  }
  void put_int(int64_t v) { ints_.push_back(v); }
  void put_shape(const Shape& s) {
    put_int(int64_t(s.size()));
    for (int64_t d : s) put_int(d);
  }

  /// Moves the oldest tensor out into `t`.
  void take(Tensor& t) {
    MC_CHECK(!tensors_.empty(),
             "ActivationStash: no tensor left to restore; restore a stash only into the model (chunk) it was taken "
             "from, once");
    t = std::move(tensors_.front());
    tensors_.pop_front();
    if (t.defined()) bytes_ -= t.nbytes();
  }
  int64_t take_int() {
    MC_CHECK(!ints_.empty(),
             "ActivationStash: no value left to restore; restore a stash only into the model (chunk) it was taken "
             "from, once");
    const int64_t v = ints_.front();
    ints_.pop_front();
    return v;
  }
  Shape take_shape() {
    Shape s(static_cast<size_t>(take_int()));
    for (int64_t& d : s) d = take_int();
    return s;
  }

  /// True when everything put in has been taken out again.
  bool empty() const { return tensors_.empty() && ints_.empty(); }
  /// Number of tensor handles held (undefined ones included).
  size_t num_tensors() const { return tensors_.size(); }
  /// Bytes of the defined tensors held (views of one storage are counted once each, so this is an
  /// upper bound on the memory the stash keeps alive).
  int64_t bytes() const { return bytes_; }

 private:
  std::deque<Tensor> tensors_;
  std::deque<int64_t> ints_;
  int64_t bytes_ = 0;
};

}  // namespace megacore::layers
