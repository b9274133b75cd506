// The MoE all-to-all token dispatcher's communication over EP = world, one GPU per rank, NCCL:
//   mpirun -np 4 build/benchmarks/megacore_bench_moe_dispatch --out-dir benchmarks/results
//
// What is timed is exactly what MoELayer runs (layers::moe_exchange_counts and layers::moe_exchange_rows):
// the per-expert count exchange (all-to-all of E integers, read on the host), the token all-to-all
// (dispatch) and the reverse all-to-all (combine), bf16 rows of width H. The peers, measured in the same
// run on the same communicator: Communicator::all_to_all of the same bytes with equal splits, and with the
// dispatcher's uneven splits (no count exchange), each in both directions.
//
// Shape: Mixtral-like, H 4096, 8 experts, top-2, T tokens per rank (rows sent = 2 T). Routing: "even" (2 T / E
// rows per expert from every rank) and "imbalanced" (rows per expert ∝ 1/(i+1), the same on every rank: expert
// 0 takes 37 % of the slots, max/mean 2.9, so EP rank 0 receives most of the tokens).
//
// Algorithm bandwidth = bytes of tokens this rank sends in both directions (dispatch + combine, its own chunk
// included, as in the peers) / time, averaged over ranks; time is the mean over --iters of the world's step
// (barriers before and after the loop), the median of --rounds rounds in which the three are measured in turn. Target (issue 22): dispatcher ≥ 85 % of the raw all-to-all with the
// same splits.
//
// Flags: --tokens T1,T2,... (default 4096,8192,16384), --hidden H, --experts E, --topk K, --iters N, --warmup N,
// --rounds N (default 3),
// --quick (one token count, fewer iterations), --out-dir DIR (writes moe_dispatch_ep<N>_<card>.json), --cpu (CPU
// ranks over MPI: checks the benchmark itself, e.g. --cpu --quick --hidden 64; its times mean nothing).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/bench_common.hpp"

#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/layers/moe.hpp"

using namespace megacore;
using json = nlohmann::json;

namespace {

struct Args {
  std::vector<int64_t> tokens{4096, 8192, 16384};
  int64_t hidden = 4096, experts = 8, topk = 2, iters = 20, warmup = 5, rounds = 3;
  std::string out_dir;
  bool cpu = false;
};

Args parse(int argc, char** argv) {
  Args a;
  bench::ArgReader r(argc, argv);
  while (r.next()) {
    const std::string& k = r.key();
    if (k == "--tokens") a.tokens = r.list();
    else if (k == "--hidden") a.hidden = r.integer();
    else if (k == "--experts") a.experts = r.integer();
    else if (k == "--topk") a.topk = r.integer();
    else if (k == "--iters") a.iters = r.integer();
    else if (k == "--warmup") a.warmup = r.integer();
    else if (k == "--rounds") a.rounds = r.integer();
    else if (k == "--quick") a.tokens = {8192}, a.iters = 5, a.warmup = 2, a.rounds = 1;
    else if (k == "--out-dir") a.out_dir = r.text();
    else if (k == "--cpu") a.cpu = true;
    else r.unknown();
  }
  if (a.hidden <= 0 || a.topk < 1 || a.topk > a.experts || a.iters < 1 || a.warmup < 0 || a.rounds < 1)
    throw std::runtime_error("need --hidden > 0, 1 <= --topk <= --experts, --iters >= 1, --warmup >= 0, --rounds >= 1");
  for (int64_t t : a.tokens)
    if (t <= 0) throw std::runtime_error("--tokens must be positive");
  return a;
}

// Rows this rank routes to each global expert: `slots` = tokens · topk spread evenly, or ∝ 1/(i+1) (each
// expert's rows at most `tokens`, as top-k never picks an expert twice for one token).
std::vector<int64_t> routing(bool even, int64_t tokens, int64_t experts, int64_t topk) {
  const int64_t slots = tokens * topk;
  std::vector<int64_t> c(size_t(experts), 0);
  if (even) {
    for (int64_t i = 0; i < experts; ++i) c[size_t(i)] = slots / experts + (i < slots % experts ? 1 : 0);
    return c;
  }
  double norm = 0;
  for (int64_t i = 0; i < experts; ++i) norm += 1.0 / double(i + 1);
  int64_t left = slots;
  for (int64_t i = 0; i < experts; ++i) {
    c[size_t(i)] = std::min<int64_t>(tokens, int64_t(double(slots) / norm / double(i + 1)));
    left -= c[size_t(i)];
  }
  for (int64_t i = experts - 1; left > 0; i = (i + experts - 1) % experts) {  // remainder to the coldest experts
    const int64_t add = std::min(left, tokens - c[size_t(i)]);
    c[size_t(i)] += add;
    left -= add;
  }
  return c;
}

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

// Mean over the ranks of a per-rank value (MPI, host).
double world_mean(double v, int n) {
  double s = 0;
  MPI_Allreduce(&v, &s, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return s / double(n);
}

double world_max(double v) {
  double m = 0;
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  return bench::mpi_main(argc, argv, "bench_moe_dispatch", [&] {
    const Args a = parse(argc, argv);
    auto mpi = comm::make_mpi_world();
    const Device dev = a.cpu ? Device::cpu() : bench::local_gpu();
    std::unique_ptr<comm::Communicator> nccl = a.cpu ? nullptr : bench::nccl_over(*mpi, dev, "ep", std::chrono::seconds(300));
    comm::Communicator* ep = a.cpu ? mpi.get() : nccl.get();
    const int n = ep->size();
    const bool root = mpi->rank() == 0;
    if (a.experts % n)
      throw std::runtime_error("--experts " + std::to_string(a.experts) + " is not divisible by the " +
                               std::to_string(n) + " ranks (EP = world); run a rank count that divides it");
    const int64_t el = a.experts / n, h = a.hidden;
    const Stream s = Stream::create(dev);
    const std::string card = a.cpu ? std::string("cpu") : cuda_device_name(dev.index);
    if (root) {
      std::printf("card: %s, EP = %d, H %lld, %lld experts, top-%lld, bf16\n", card.c_str(), n, (long long)h,
                  (long long)a.experts, (long long)a.topk);
      std::printf("%-10s %7s %9s | %9s %9s | %9s %9s | %9s %9s | %6s %6s\n", "routing", "tokens", "MB/rank",
                  "disp ms", "GB/s", "raw-eq ms", "GB/s", "raw-unev", "GB/s", "%eq", "%unev");
    }

    json rows = json::array();
    for (int64_t tokens : a.tokens) {
      for (bool even : {true, false}) {
        json row = {{"routing", even ? "even" : "imbalanced"}, {"tokens_per_rank", tokens}};
        const std::vector<int64_t> counts = routing(even, tokens, a.experts, a.topk);
        const int64_t slots = sum(counts);
        Tensor permuted = Tensor::empty({slots, h}, DType::BF16, dev, s);
        Generator g(7, uint64_t(mpi->rank()));
        permuted.normal_(g, 0.0, 1.0, s);
        const layers::MoEExchangePlan plan = layers::moe_exchange_counts(*ep, counts, el, s);
        const int64_t recv = sum(plan.recv_rows);
        const double bytes = double(slots + recv) * double(h) * 2.0;  // dispatch sends `slots`, combine `recv`
        const double mean_bytes = world_mean(bytes, n);
        row["bytes_per_rank_mean"] = mean_bytes;
        row["bytes_per_rank_max"] = world_max(bytes);
        row["rows_received_max"] = world_max(double(recv));
        const auto bw = [&](double sec) { return mean_bytes / sec / 1e9; };

        // The dispatcher as the layer runs it: counts, dispatch, combine (the expert outputs have the
        // received tokens' shape; the received tokens stand in for them).
        const auto dispatcher = [&] {
          const layers::MoEExchangePlan p = layers::moe_exchange_counts(*ep, counts, el, s);
          Tensor at_experts = layers::moe_exchange_rows(*ep, permuted, p.send_rows, p.recv_rows, s);
          layers::moe_exchange_rows(*ep, at_experts, p.recv_rows, p.send_rows, s);
        };
        // Raw NCCL all-to-all, equal splits: `slots` rows each way, split evenly over the ranks.
        const int64_t eq_rows = slots / n * n;
        Tensor eq_in = permuted.narrow(0, 0, eq_rows).contiguous(s);
        Tensor eq_out = Tensor::empty(eq_in.shape(), eq_in.dtype(), dev, s);
        const auto raw_equal = [&] {
          ep->all_to_all(eq_in, eq_out, {}, {}, s)->wait_on(s);
          ep->all_to_all(eq_out, eq_in, {}, {}, s)->wait_on(s);
        };
        // Raw NCCL all-to-all with the dispatcher's uneven splits, both directions, buffers preallocated.
        std::vector<int64_t> se = plan.send_rows, re = plan.recv_rows;  // in elements
        for (int64_t& v : se) v *= h;
        for (int64_t& v : re) v *= h;
        Tensor un_out = Tensor::empty({recv, h}, DType::BF16, dev, s);
        Tensor un_back = Tensor::empty({slots, h}, DType::BF16, dev, s);
        const auto raw_uneven = [&] {
          ep->all_to_all(permuted, un_out, se, re, s)->wait_on(s);
          ep->all_to_all(un_out, un_back, re, se, s)->wait_on(s);
        };
        // --rounds rounds, the three measured in turn in each (so drift hits all alike); the median round counts.
        // A measurement that fails is recorded with its reason and the others still run.
        const char* names[3] = {"dispatcher", "raw_all_to_all_equal", "raw_all_to_all_uneven"};
        const std::function<void()> bodies[3] = {dispatcher, raw_equal, raw_uneven};
        std::vector<double> secs[3];
        std::string errors[3];
        for (int64_t round = 0; round < a.rounds; ++round)
          for (int m = 0; m < 3; ++m) {
            if (!errors[m].empty()) continue;
            try {
              secs[m].push_back(bench::time_steps(*mpi, s, a.warmup, a.iters, bodies[m]));
            } catch (const std::exception& e) {
              errors[m] = e.what();
            }
          }
        double t[3] = {0, 0, 0};
        for (int m = 0; m < 3; ++m) {
          if (!errors[m].empty()) {
            row[names[m]] = {{"error", errors[m]}};
            continue;
          }
          std::sort(secs[m].begin(), secs[m].end());
          t[m] = secs[m][secs[m].size() / 2];
          std::vector<double> ms_rounds = secs[m];
          for (double& x : ms_rounds) x *= 1e3;
          row[names[m]] = {{"ms", t[m] * 1e3}, {"algbw_GBps", bw(t[m])}, {"ms_rounds", ms_rounds}};
        }
        const double t_disp = t[0], t_eq = t[1], t_un = t[2];
        const auto pct = [&](double base) { return t_disp > 0 && base > 0 ? base / t_disp : 0.0; };
        row["dispatcher_vs_raw_equal"] = pct(t_eq);
        row["dispatcher_vs_raw_uneven"] = pct(t_un);
        rows.push_back(row);
        if (root) {
          const auto ms = [](double t) { return t * 1e3; };
          const auto gb = [&](double t) { return t > 0 ? bw(t) : 0.0; };
          std::printf("%-10s %7lld %9.1f | %9.3f %9.1f | %9.3f %9.1f | %9.3f %9.1f | %5.1f%% %5.1f%%\n",
                      even ? "even" : "imbalanced", (long long)tokens, mean_bytes / 1e6, ms(t_disp), gb(t_disp),
                      ms(t_eq), gb(t_eq), ms(t_un), gb(t_un), 100 * pct(t_eq), 100 * pct(t_un));
          std::fflush(stdout);
        }
      }
    }

    json r = {{"benchmark", "moe_dispatch"},
              {"card", card},
              {"gpus", n},
              {"expert_parallel", n},
              {"hidden", h},
              {"experts", a.experts},
              {"topk", a.topk},
              {"dtype", "bf16"},
              {"iters", a.iters},
              {"timed", "dispatcher = moe_exchange_counts + moe_exchange_rows dispatch + combine (as MoELayer); "
                        "raw = Communicator::all_to_all both directions, same communicator"},
              {"algbw", "bytes this rank sends in both directions (own chunk included) / time, mean over ranks"},
              {"target", "dispatcher >= 85% of raw all-to-all with the same splits"},
              {"results", rows}};
    if (root) bench::write_result(r.dump(2), a.out_dir, "moe_dispatch_ep" + std::to_string(n), card);
  });
}
