// Shared pieces of the pybind11 module: each area registers itself through a bind_<area> function.
#pragma once

#include <pybind11/pybind11.h>

#include "megacore/megacore.hpp"

namespace megacore::py {

namespace pyb = pybind11;

/// The stream Python code is using on a device (megacore.current_stream / `with megacore.stream(s)`).
Stream current_stream(Device d);
/// Resolves an optional `stream` argument: None means the current stream of the tensor's device.
Stream stream_arg(const pyb::object& stream, Device d);
/// Parses "cpu"/"cuda:N" strings, ints (CUDA ordinal) and megacore.Device values.
Device device_arg(const pyb::object& o);
/// Parses "f32"/"bfloat16"/numpy-style names and megacore.DType values.
DType dtype_arg(const pyb::object& o);

/// How a tensor argument may be converted: Copy allows a copy (a non-contiguous numpy array is made
/// contiguous, anything else goes through numpy.asarray); Share is for outputs written in place, so the
/// result must use the caller's memory (a numpy array must already be contiguous; only megacore tensors,
/// numpy arrays and DLPack producers are taken).
enum class TensorArg { Copy, Share };
/// A tensor argument: a megacore.Tensor as is, a numpy array through from_numpy, any other DLPack
/// producer (torch, cupy, jax) through from_dlpack. `what` names the argument in errors.
Tensor tensor_arg(const pyb::handle& o, const std::string& what, TensorArg mode = TensorArg::Copy);

void bind_core(pyb::module_& m);
void bind_dlpack(pyb::module_& m);
void bind_data(pyb::module_& m);
void bind_comm(pyb::module_& m);
void bind_parallel(pyb::module_& m);
void bind_model(pyb::module_& m);
void bind_checkpoint(pyb::module_& m);
void bind_train(pyb::module_& m);
void bind_optim(pyb::module_& m);
void bind_pipeline(pyb::module_& m);
void bind_ops(pyb::module_& m);

}  // namespace megacore::py
