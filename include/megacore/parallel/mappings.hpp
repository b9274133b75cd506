// Tensor- and sequence-parallel region mappings: the communication at the edges of a TP region,
// each written as an explicit forward/backward pair (there is no autograd to pair them for us).
//
// Activations use Megatron's [s, b, h] layout: the sequence is dimension 0 (sequence parallelism
// splits it into TP contiguous chunks, rank r holding rows [r·s/TP, (r+1)·s/TP)), and the hidden /
// feature dimension is the last one (a TP-split feature dimension holds rank r's slice
// [r·h/TP, (r+1)·h/TP)). Any number of dimensions in between is allowed.
//
//   mapping              forward                         backward
//   copy_to_tp           identity                        all-reduce
//   reduce_from_tp       all-reduce                      identity
//   scatter_to_sp        split along seq (keep own)      all-gather along seq
//   gather_from_sp       all-gather along seq            split along seq
//   reduce_scatter_to_sp reduce-scatter along seq        all-gather along seq
//   all_gather_from_sp   all-gather along seq            reduce-scatter along seq
//   scatter_to_tp        split along last dim            all-gather along last dim
//   gather_from_tp       all-gather along last dim       split along last dim
//
// Ownership: the all-reduce halves reduce their argument IN PLACE when it is contiguous (the
// returned tensor is the argument) because callers hand over a temporary they own — this saves an
// activation-sized copy per layer. Pass x.clone() to keep the input. Splits return views of the
// input when no copy is needed (seq splits) and contiguous copies otherwise (last-dim splits).
// Every function returns with `s` ordered after the collective (Work::wait_on: on NCCL the host does
// not wait, on MPI it does); overlap of these collectives with compute is left to the layers that
// need it.
#pragma once

#include "megacore/comm/communicator.hpp"
#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::parallel {

// ---- TP region entry/exit (replicated activations) -------------------------------------------
/// Identity: the input of a column-parallel region is already replicated on every TP rank.
Tensor copy_to_tp_forward(comm::Communicator& tp, Tensor x, const Stream& s = {});
/// All-reduce (sum): every TP rank's region consumed x, so x's gradient is the sum of theirs.
Tensor copy_to_tp_backward(comm::Communicator& tp, Tensor dy, const Stream& s = {});
/// All-reduce (sum) of the partial outputs of a row-parallel region.
Tensor reduce_from_tp_forward(comm::Communicator& tp, Tensor x, const Stream& s = {});
/// Identity: the reduced output was replicated, so each rank's partial gets the same gradient.
Tensor reduce_from_tp_backward(comm::Communicator& tp, Tensor dy, const Stream& s = {});

// ---- sequence parallelism (split along dim 0) --------------------------------------------------
/// Keeps this rank's chunk of the sequence (a view; dim 0 must be divisible by TP).
Tensor scatter_to_sp_forward(comm::Communicator& tp, const Tensor& x, const Stream& s = {});
/// All-gathers the chunks' gradients back into the full sequence.
Tensor scatter_to_sp_backward(comm::Communicator& tp, const Tensor& dy, const Stream& s = {});
/// All-gathers the sequence chunks into the full sequence (dim 0 grows TP-fold).
Tensor gather_from_sp_forward(comm::Communicator& tp, const Tensor& x, const Stream& s = {});
/// Keeps this rank's chunk of the gradient: use when every rank's gradient of the gathered
/// tensor is the same (the consumer was replicated), else use all_gather_from_sp.
Tensor gather_from_sp_backward(comm::Communicator& tp, const Tensor& dy, const Stream& s = {});
/// Sums the TP ranks' partial [s, ...] tensors and keeps this rank's chunk of the sum [s/TP, ...].
Tensor reduce_scatter_to_sp_forward(comm::Communicator& tp, const Tensor& x, const Stream& s = {});
/// All-gathers the chunk gradients: each partial input gets the full gradient.
Tensor reduce_scatter_to_sp_backward(comm::Communicator& tp, const Tensor& dy, const Stream& s = {});
/// All-gathers the sequence chunks (the entry of a TP region under SP).
Tensor all_gather_from_sp_forward(comm::Communicator& tp, const Tensor& x, const Stream& s = {});
/// Reduce-scatters the gradient: each rank's region used the whole gathered tensor, so the chunk's
/// gradient is the sum over ranks of their gradients' rows for that chunk.
Tensor all_gather_from_sp_backward(comm::Communicator& tp, const Tensor& dy, const Stream& s = {});

// ---- feature parallelism (split along the last dim) --------------------------------------------
/// Keeps this rank's slice of the last dimension (a contiguous copy; it must be divisible by TP).
Tensor scatter_to_tp_forward(comm::Communicator& tp, const Tensor& x, const Stream& s = {});
/// All-gathers the slices' gradients along the last dimension.
Tensor scatter_to_tp_backward(comm::Communicator& tp, const Tensor& dy, const Stream& s = {});
/// All-gathers the TP slices along the last dimension (e.g. gather_output of a column-parallel layer).
Tensor gather_from_tp_forward(comm::Communicator& tp, const Tensor& x, const Stream& s = {});
/// Keeps this rank's slice of the (replicated) gradient's last dimension.
Tensor gather_from_tp_backward(comm::Communicator& tp, const Tensor& dy, const Stream& s = {});

// ---- building blocks (also used by the layers) --------------------------------------------------
/// x's chunk `tp.rank()` of TP equal chunks along `dim` (0 or the last); ValueError naming the fix
/// when the dimension is not divisible by TP.
Tensor split_along(comm::Communicator& tp, const Tensor& x, int64_t dim, const Stream& s = {});
/// Concatenation along `dim` (0 or the last) of every TP rank's x, in rank order.
Tensor all_gather_along(comm::Communicator& tp, const Tensor& x, int64_t dim, const Stream& s = {});
/// This rank's chunk along dim 0 of the sum over TP ranks of x.
Tensor reduce_scatter_along_first(comm::Communicator& tp, const Tensor& x, const Stream& s = {});
/// In-place sum over TP ranks (a contiguous copy is made and reduced when x is not contiguous).
Tensor all_reduce_sum(comm::Communicator& tp, Tensor x, const Stream& s = {});

}  // namespace megacore::parallel
