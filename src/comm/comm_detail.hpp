// Private helpers shared by the communicator backends: argument checks that run before anything
// is posted (so a bad call fails on the calling rank with ValueError instead of desynchronising the
// group), the all-to-all layout, the per-op signature used by CommOptions::check_shapes, and the
// wording of errors.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "megacore/comm/communicator.hpp"

namespace megacore::comm::detail {

enum class OpKind : int64_t { AllReduce = 1, AllGather, ReduceScatter, Broadcast, AllToAll, Barrier };
std::string_view op_kind_name(OpKind k);

/// "[0, 1, 2]" (long lists are abbreviated).
std::string ranks_str(const std::vector<int>& ranks);
/// Seconds since t0, as a double.
double seconds_since(std::chrono::steady_clock::time_point t0);

/// ValueError unless t is defined, contiguous and on `device`.
void check_tensor(const Communicator& c, std::string_view op, std::string_view what, const Tensor& t,
                  Device device);
/// ValueError unless a and b have the same dtype.
void check_same_dtype(const Communicator& c, std::string_view op, const Tensor& a, const Tensor& b);
void check_root(const Communicator& c, std::string_view op, int root);

/// Element counts and offsets of an all-to-all, validated against the tensors.
struct AllToAllLayout {
  std::vector<int64_t> send_counts, send_offsets, recv_counts, recv_offsets;
};
AllToAllLayout all_to_all_layout(const Communicator& c, const Tensor& in, const Tensor& out,
                                 const std::vector<int64_t>& send_counts, const std::vector<int64_t>& recv_counts);

/// What one rank is about to do; every rank of a group must post the same signature.
struct OpSignature {
  int64_t op = 0;      ///< OpKind
  int64_t dtype = -1;  ///< DType, -1 for none (barrier)
  int64_t numel = 0;   ///< per-rank element count (all_reduce/broadcast: t; all_gather: in; reduce_scatter: out)
  int64_t extra = 0;   ///< reduce op, broadcast root, or a hash of all-to-all counts (see below)
  static constexpr int kWords = 4;
};
/// "all_reduce(sum) bf16 x1000".
std::string signature_str(const OpSignature& s);
/// Given every rank's signature (all_sigs[r]), "" when they agree, else an error naming which
/// ranks posted what. Every rank computes the same verdict from the same gathered data.
std::string signature_mismatch(const std::vector<OpSignature>& all_sigs);
/// For all_to_all: rank r's send_counts[p] must equal rank p's recv_counts[r]. `counts` holds every
/// rank's send counts followed by its recv counts (2 * size words per rank).
std::string all_to_all_count_mismatch(const std::vector<int64_t>& counts, int size);

/// The head of every CommError: "group 'tp' (world ranks [0, 1]) op all_reduce(sum) f32 x10".
std::string error_context(const Communicator& c, std::string_view what);

/// MPI_Abort(MPI_COMM_WORLD, code) when MPI is initialised and not finalised; otherwise returns (and
/// always returns in a build without MPI).
void mpi_abort_world(int code);

}  // namespace megacore::comm::detail
