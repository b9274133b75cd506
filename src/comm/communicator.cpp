#include "megacore/comm/communicator.hpp"
#include "megacore/comm/abort.hpp"

#include <fmt/ranges.h>

#include <cstdio>
#include <cstdlib>
#include <map>

#include "comm/comm_detail.hpp"

namespace megacore::comm {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

std::string_view backend_name(Backend b) { return b == Backend::MPI ? "mpi" : "nccl"; }

namespace detail {

std::string_view op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::AllReduce: return "all_reduce";
    case OpKind::AllGather: return "all_gather";
    case OpKind::ReduceScatter: return "reduce_scatter";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::AllToAll: return "all_to_all";
    case OpKind::Barrier: return "barrier";
  }
  return "?";
}

std::string ranks_str(const std::vector<int>& ranks) {
  constexpr size_t kMax = 16;  // a 1024-rank group in an error message helps nobody
  if (ranks.size() <= kMax) return fmt::format("[{}]", fmt::join(ranks, ", "));
  std::vector<int> head(ranks.begin(), ranks.begin() + kMax / 2);
  return fmt::format("[{}, ... ({} ranks) ..., {}]", fmt::join(head, ", "), ranks.size(), ranks.back());
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string error_context(const Communicator& c, std::string_view what) {
  return fmt::format("group '{}' ({}, rank {} of {}, world ranks {}) op {}", c.name(), backend_name(c.backend()),
                     c.rank(), c.size(), ranks_str(c.world_ranks()), what);
}

void check_tensor(const Communicator& c, std::string_view op, std::string_view what, const Tensor& t,
                  Device device) {
  MC_CHECK(t.defined(), "{} on group '{}': {} is an undefined tensor", op, c.name(), what);
  MC_CHECK(t.device() == device, "{} on group '{}': {} is on {}, but this {} communicator works on {}{}", op,
           c.name(), what, t.device().str(), backend_name(c.backend()), device.str(),
           device.is_cpu() ? " (use an NCCL communicator for CUDA tensors)" : "");
  MC_CHECK(t.is_contiguous(), "{} on group '{}': {} must be contiguous, got {} with strides {}; call .contiguous()",
           op, c.name(), what, t.str(), shape_str(t.strides()));
}

void check_same_dtype(const Communicator& c, std::string_view op, const Tensor& a, const Tensor& b) {
  MC_CHECK(a.dtype() == b.dtype(), "{} on group '{}': input is {} but output is {}; both need the same dtype", op,
           c.name(), dtype_name(a.dtype()), dtype_name(b.dtype()));
}

void check_root(const Communicator& c, std::string_view op, int root) {
  MC_CHECK(root >= 0 && root < c.size(), "{} on group '{}': root {} is out of range [0, {})", op, c.name(), root,
           c.size());
}

AllToAllLayout all_to_all_layout(const Communicator& c, const Tensor& in, const Tensor& out,
                                 const std::vector<int64_t>& send_counts, const std::vector<int64_t>& recv_counts) {
  const int n = c.size();
  AllToAllLayout l;
  auto fill = [&](const std::vector<int64_t>& given, const Tensor& t, std::string_view which,
                  std::vector<int64_t>& counts, std::vector<int64_t>& offsets) {
    if (given.empty()) {
      MC_CHECK(t.numel() % n == 0,
               "all_to_all on group '{}': {} has {} elements, not divisible by the group size {}; pass explicit "
               "{}_counts for an uneven split",
               c.name(), which == "send" ? "in" : "out", t.numel(), n, which);
      counts.assign(n, t.numel() / n);
    } else {
      MC_CHECK(int(given.size()) == n, "all_to_all on group '{}': {}_counts has {} entries, need one per rank ({})",
               c.name(), which, given.size(), n);
      counts = given;
    }
    offsets.assign(n, 0);
    int64_t total = 0;
    for (int p = 0; p < n; ++p) {
      MC_CHECK(counts[p] >= 0, "all_to_all on group '{}': {}_counts[{}] = {} is negative", c.name(), which, p,
               counts[p]);
      offsets[p] = total;
      total += counts[p];
    }
    MC_CHECK(total == t.numel(), "all_to_all on group '{}': {}_counts add up to {} but {} has {} elements", c.name(),
             which, total, which == "send" ? "in" : "out", t.numel());
  };
  fill(send_counts, in, "send", l.send_counts, l.send_offsets);
  fill(recv_counts, out, "recv", l.recv_counts, l.recv_offsets);
  return l;
}

std::string signature_str(const OpSignature& s) {
  auto k = OpKind(s.op);
  std::string head(op_kind_name(k));
  if (k == OpKind::AllReduce || k == OpKind::ReduceScatter) {
    head += fmt::format("({})", reduce_op_name(ReduceOp(s.extra)));
  } else if (k == OpKind::Broadcast) {
    head += fmt::format("(root={})", s.extra);
  }
  if (k == OpKind::Barrier) return head;
  std::string dt = s.dtype >= 0 && s.dtype < kNumDTypes ? std::string(dtype_name(DType(s.dtype))) : "?";
  if (k == OpKind::AllToAll) return fmt::format("{} {}", head, dt);
  return fmt::format("{} {} x{}", head, dt, s.numel);
}

std::string signature_mismatch(const std::vector<OpSignature>& all_sigs) {
  // Group ranks by what they posted; the usual case (a single group) costs one pass.
  std::vector<std::pair<OpSignature, std::vector<int>>> groups;
  for (int r = 0; r < int(all_sigs.size()); ++r) {
    const auto& s = all_sigs[r];
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) {
      return g.first.op == s.op && g.first.dtype == s.dtype && g.first.numel == s.numel && g.first.extra == s.extra;
    });
    if (it == groups.end()) groups.push_back({s, {r}});
    else it->second.push_back(r);
  }
  if (groups.size() <= 1) return "";
  std::string msg = "ranks posted different operations:";
  for (const auto& [sig, ranks] : groups) msg += fmt::format(" ranks {}: {};", ranks_str(ranks), signature_str(sig));
  msg.pop_back();
  return msg;
}

std::string all_to_all_count_mismatch(const std::vector<int64_t>& counts, int size) {
  std::string msg;
  int shown = 0;
  for (int r = 0; r < size; ++r) {
    for (int p = 0; p < size; ++p) {
      int64_t sent = counts[size_t(r) * 2 * size + p];              // r's send_counts[p]
      int64_t expected = counts[size_t(p) * 2 * size + size + r];   // p's recv_counts[r]
      if (sent != expected && shown++ < 8) {
        msg += fmt::format(" rank {} sends {} elements to rank {}, which expects {};", r, sent, p, expected);
      }
    }
  }
  if (msg.empty()) return "";
  msg.pop_back();
  return "all_to_all counts do not match:" + msg;
}

}  // namespace detail
void abort_job(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  detail::mpi_abort_world(code);  // returns only when MPI is not initialised (or is already finalised)
  std::_Exit(code);
}

}  // namespace megacore::comm
