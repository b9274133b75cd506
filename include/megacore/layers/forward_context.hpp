// ForwardContext: what a module's forward/backward needs beyond its inputs.
#pragma once

#include "megacore/core/stream.hpp"

namespace megacore::layers {

/// Passed to every forward(ctx, x) and backward(ctx, dy). Modules keep their own saved activations;
/// the context only says where and how to run.
struct ForwardContext {
  /// Stream all compute and collectives are issued on (host stream for CPU tensors).
  Stream stream;
  /// When false, forward saves nothing and backward is refused (evaluation / inference).
  bool training = true;
};

}  // namespace megacore::layers
