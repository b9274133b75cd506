// Collective benchmark, nccl-tests style: for all-reduce, all-gather, reduce-scatter, all-to-all and
// broadcast over 8 B … 1 GiB, the time, algorithm bandwidth and bus bandwidth of megacore's
// Communicator next to raw NCCL calls on the same GPUs, in the same run.
//   mpirun -np <GPUs> megacore_bench_collectives [--min-bytes 8] [--max-bytes 1G] [--iters 20]
//                                               [--warmup 5] [--trials 8] [--ops all_reduce,...] [--out file.json]
//                                               [--copy-engine]  (megacore's all-gathers and sum reduce-scatters
//                                                                 by copy engines: CommOptions::copy_engine)
// Every (op, size) is timed in `trials` rounds that alternate which side goes first (raw NCCL, then
// megacore; then megacore, then raw …), each round `warmup` untimed and `iters` timed calls; a side's
// time is the median of its rounds. One sample per side (the first version) let a cold first call, a
// clock change or one slow round decide a row.
// Bus bandwidth follows nccl-tests' PERFORMANCE.md: all-reduce algbw·2(n−1)/n; all-gather,
// reduce-scatter and all-to-all algbw·(n−1)/n with size the full buffer (n·count·sizeof); broadcast ×1.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/bench_common.hpp"
#include "megacore/build_config.hpp"
#include "megacore/comm/communicator.hpp"
#include "megacore/comm/nccl_communicator.hpp"
#include "megacore/core/device.hpp"
#include "megacore/core/tensor.hpp"

#if MEGACORE_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

using namespace megacore;

namespace {

#define CK(x)                                                                               \
  do {                                                                                      \
    auto e_ = (x);                                                                          \
    if (e_ != 0) {                                                                          \
      std::fprintf(stderr, "%s failed (%d) at %s:%d\n", #x, int(e_), __FILE__, __LINE__); \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                         \
    }                                                                                       \
  } while (0)

int64_t parse_size(const std::string& s) {
  double v = std::stod(s);
  char u = s.empty() ? 0 : s.back();
  if (u == 'K' || u == 'k') v *= 1024;
  if (u == 'M' || u == 'm') v *= 1024 * 1024;
  if (u == 'G' || u == 'g') v *= 1024.0 * 1024 * 1024;
  return int64_t(v);
}

struct Row {
  std::string op;
  int64_t bytes;
  double raw_us, mc_us;  // medians over the trials
  std::vector<double> raw_trials, mc_trials;
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
#if !MEGACORE_WITH_NCCL
  if (rank == 0) std::puts("megacore was built without NCCL: nothing to benchmark");
  MPI_Finalize();
  return 0;
#else
  int64_t min_bytes = 8, max_bytes = int64_t(1) << 30;
  int iters = 20, warmup = 5, trials = 8;  // even: each side goes first equally often
  bool copy_engine = false;  // megacore's all-gathers and sum reduce-scatters by copy engines (CommOptions::copy_engine)
  bool blocking = true;  // megacore's default: blocking NCCL calls (--non-blocking: every call non-blocking and polled)
  std::string out_path, ops_arg = "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--min-bytes") min_bytes = parse_size(next());
    else if (a == "--max-bytes") max_bytes = parse_size(next());
    else if (a == "--iters") iters = std::stoi(next());
    else if (a == "--warmup") warmup = std::stoi(next());
    else if (a == "--trials") trials = std::max(1, std::stoi(next()));
    else if (a == "--ops") ops_arg = next();
    else if (a == "--out") out_path = next();
    else if (a == "--blocking") blocking = true;
    else if (a == "--non-blocking") blocking = false;
    else if (a == "--copy-engine") copy_engine = true;
  }
  int ndev = cuda_device_count();
  if (ndev == 0) {
    if (rank == 0) std::puts("no CUDA device visible: nothing to benchmark");
    MPI_Finalize();
    return 0;
  }
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  int local_rank = 0;
  MPI_Comm_rank(local, &local_rank);
  int dev = local_rank % ndev;
  CK(cudaSetDevice(dev));
  Device device = Device::cuda(dev);

  // One unique id for each communicator, made on rank 0 and broadcast over MPI.
  auto uid = comm::nccl_unique_id();
  MPI_Bcast(uid.data(), int(uid.size()), MPI_BYTE, 0, MPI_COMM_WORLD);
  comm::CommOptions opt;
  opt.name = "bench";
  opt.nccl_blocking = blocking;
  opt.copy_engine = copy_engine;
  auto mc = comm::make_nccl_communicator(rank, world, uid, device, opt);
  ncclUniqueId raw_id;
  if (rank == 0) CK(ncclGetUniqueId(&raw_id));
  MPI_Bcast(&raw_id, sizeof(raw_id), MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t raw;
  CK(ncclCommInitRank(&raw, world, raw_id, rank));

  Stream stream = Stream::create(device);
  cudaStream_t cs = static_cast<cudaStream_t>(stream.native());
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  std::vector<std::string> ops;
  for (size_t p = 0; p <= ops_arg.size();) {
    size_t q = ops_arg.find(',', p);
    if (q == std::string::npos) q = ops_arg.size();
    ops.push_back(ops_arg.substr(p, q - p));
    p = q + 1;
  }
  // Buffers sized for the largest case (the input of reduce-scatter / output of all-gather is n× count).
  int64_t max_elems = std::max<int64_t>(max_bytes / 4, world);
  Tensor buf_a = Tensor::empty({max_elems}, DType::F32, device, stream);
  Tensor buf_b = Tensor::empty({max_elems}, DType::F32, device, stream);
  buf_a.fill_(1.0, stream);
  buf_b.fill_(0.0, stream);
  stream.synchronize();

  auto time_it = [&](const std::function<void()>& fn) {
    for (int i = 0; i < warmup; ++i) fn();
    CK(cudaStreamSynchronize(cs));
    MPI_Barrier(MPI_COMM_WORLD);
    CK(cudaEventRecord(e0, cs));
    for (int i = 0; i < iters; ++i) fn();
    CK(cudaEventRecord(e1, cs));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    double us = 1000.0 * ms / iters, worst = 0;
    MPI_Allreduce(&us, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return worst;
  };

  std::vector<Row> rows;
  if (rank == 0) {
    std::printf("# megacore collectives (%s communicator) vs raw NCCL %d (blocking), %d ranks, device %s, f32, median of %d "
                "alternating rounds of %d iters (time: slowest rank)\n",
                blocking ? "blocking" : "non-blocking", comm::nccl_version(), world, cuda_device_name(dev).c_str(), trials,
                iters);
    std::printf("%-15s %12s %12s %12s %10s %10s %12s %12s %8s\n", "op", "bytes", "raw_us", "mc_us", "raw_busbw",
                "mc_busbw", "mc/raw_bw", "added_us", "");
  }
  for (const std::string& op : ops) {
    for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
      // `bytes` is the size nccl-tests reports: the full buffer for the gather/scatter family.
      bool whole = op == "all_gather" || op == "reduce_scatter" || op == "all_to_all";
      int64_t count = bytes / 4;
      if (whole) count = count / world;
      if (count < 1) continue;
      int64_t full = whole ? count * world : count;
      Tensor a = buf_a.slice(0, 0, whole ? full : count);
      Tensor b = buf_b.slice(0, 0, whole && op == "reduce_scatter" ? count : full);
      std::function<void()> raw_fn, mc_fn;
      if (op == "all_reduce") {
        raw_fn = [&] { CK(ncclAllReduce(a.data_ptr(), a.data_ptr(), count, ncclFloat, ncclSum, raw, cs)); };
        mc_fn = [&] { mc->all_reduce(a, comm::ReduceOp::Sum, stream); };
      } else if (op == "all_gather") {
        Tensor in = a.slice(0, 0, count);
        raw_fn = [&, in] { CK(ncclAllGather(in.data_ptr(), b.data_ptr(), count, ncclFloat, raw, cs)); };
        mc_fn = [&, in] { mc->all_gather(in, b, stream); };
      } else if (op == "reduce_scatter") {
        raw_fn = [&] { CK(ncclReduceScatter(a.data_ptr(), b.data_ptr(), count, ncclFloat, ncclSum, raw, cs)); };
        mc_fn = [&] { mc->reduce_scatter(a, b, comm::ReduceOp::Sum, stream); };
      } else if (op == "all_to_all") {
        raw_fn = [&] {
          CK(ncclGroupStart());
          for (int p = 0; p < world; ++p) {
            CK(ncclSend(static_cast<float*>(a.data_ptr()) + p * count, count, ncclFloat, p, raw, cs));
            CK(ncclRecv(static_cast<float*>(b.data_ptr()) + p * count, count, ncclFloat, p, raw, cs));
          }
          CK(ncclGroupEnd());
        };
        mc_fn = [&] { mc->all_to_all(a, b, {}, {}, stream); };
      } else if (op == "broadcast") {
        raw_fn = [&] { CK(ncclBroadcast(a.data_ptr(), a.data_ptr(), count, ncclFloat, 0, raw, cs)); };
        mc_fn = [&] { mc->broadcast(a, 0, stream); };
      } else {
        if (rank == 0) std::fprintf(stderr, "unknown op %s\n", op.c_str());
        break;
      }
      std::vector<double> raw_t, mc_t;
      for (int t = 0; t < trials; ++t) {
        if (t % 2 == 0) {
          raw_t.push_back(time_it(raw_fn));
          mc_t.push_back(time_it(mc_fn));
        } else {
          mc_t.push_back(time_it(mc_fn));
          raw_t.push_back(time_it(raw_fn));
        }
      }
      const double raw_us = bench::median(raw_t), mc_us = bench::median(mc_t);
      rows.push_back({op, full * 4, raw_us, mc_us, raw_t, mc_t});
      if (rank == 0) {
        double n = world;
        double factor = op == "all_reduce" ? 2 * (n - 1) / n : op == "broadcast" ? 1.0 : (n - 1) / n;
        double raw_bw = double(full * 4) / raw_us / 1e3 * factor, mc_bw = double(full * 4) / mc_us / 1e3 * factor;
        std::printf("%-15s %12lld %12.2f %12.2f %10.2f %10.2f %11.1f%% %12.2f\n", op.c_str(), (long long)(full * 4),
                    raw_us, mc_us, raw_bw, mc_bw, 100.0 * mc_bw / raw_bw, mc_us - raw_us);
      }
    }
  }
  mc->barrier();
  if (rank == 0 && !out_path.empty()) {
    nlohmann::json j;
    j["card"] = cuda_device_name(dev);
    j["ranks"] = world;
    j["nccl_version"] = comm::nccl_version();
    j["dtype"] = "f32";
    j["iters"] = iters;
    j["trials"] = trials;
    j["statistic"] = "median over alternating rounds (raw first in even rounds, megacore first in odd ones)";
    j["peer"] = "raw NCCL (ncclCommInitRank, blocking) in the same run";
    j["megacore_mode"] = blocking ? "blocking" : "non-blocking";
    j["megacore_copy_engine"] = mc->copy_engine_active();
    j["busbw_formula"] = "nccl-tests PERFORMANCE.md";
    for (const Row& r : rows) {
      double n = world;
      double factor = r.op == "all_reduce" ? 2 * (n - 1) / n : r.op == "broadcast" ? 1.0 : (n - 1) / n;
      j["rows"].push_back({{"op", r.op}, {"bytes", r.bytes}, {"raw_us", r.raw_us}, {"megacore_us", r.mc_us},
                           {"raw_busbw_GBps", double(r.bytes) / r.raw_us / 1e3 * factor},
                           {"megacore_busbw_GBps", double(r.bytes) / r.mc_us / 1e3 * factor},
                           {"raw_us_trials", r.raw_trials}, {"megacore_us_trials", r.mc_trials},
                           {"raw_us_best", *std::min_element(r.raw_trials.begin(), r.raw_trials.end())},
                           {"megacore_us_best", *std::min_element(r.mc_trials.begin(), r.mc_trials.end())}});
    }
    std::ofstream(out_path) << j.dump(2) << "\n";
    std::printf("wrote %s\n", out_path.c_str());
  }
  ncclCommDestroy(raw);
  mc.reset();
  MPI_Finalize();
  return 0;
#endif
}
