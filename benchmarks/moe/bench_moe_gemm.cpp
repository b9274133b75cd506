// Expert GEMMs of an MoE layer on one GPU: ops::grouped_gemm_* on each CUDA path (auto: megacore's
// default choice; sm90: megacore's Hopper grouped kernel; grouped: one cuBLAS grouped launch; loop: one
// cuBLASLt product per expert) against one dense ops::gemm of the same FLOPs (all N rows through one
// weight) and against the memory roofline (the bytes the op must move at the device-to-device copy
// bandwidth measured at the start of the run), in the same run, for fc1
// (SwiGLU gate+up, [2*FFN, H] per expert) and fc2 ([H, FFN]): forward, dgrad and wgrad (bf16 inputs,
// f32 main grad accumulated with beta = 1).
//
//   build/benchmarks/megacore_bench_moe --out-dir benchmarks/results
//   build/benchmarks/megacore_bench_moe --model mixtral --tokens 4096,16384 --quick
//   build/benchmarks/megacore_bench_moe --model fine --rows-per-expert 32,128,512
//
// Flags: --model mixtral|1b|fine|all (mixtral: H 4096, FFN 14336, 8 experts top-2; 1b: H 2048,
// FFN 5632, 8 experts top-2; fine: H 2048, FFN 1408, 64 and 128 experts top-8, as Qwen-MoE /
// DeepSeek-MoE-small), --tokens T1,T2,... (tokens per rank for mixtral/1b; rows N = k T),
// --rows-per-expert R1,R2,... (fine: tokens = R E / k, so the even split gives R rows per expert),
// --samples S, --quick (one token count, fewer samples), --no-stream-sweep (skip the loop on 1/2/4/8
// streams), --out-dir DIR (writes moe_gemm_<card>.json).
// Splits: "even" (N / E rows per expert) and "imbalanced" (fixed-seed random shares from 0.25x to
// 2.5x of even, expert 1 empty). The auto column is what a model gets; its path is printed beside it.
// Target (issue 22): auto >= 85 % of what the shape allows: the dense GEMM's time, or the roofline's where
// the op must move more bytes than the copy bandwidth carries in that time (attainable = max of the two); for wgrad
// also the time of the dense GEMM of the same FLOPs that reads and writes the same f32 main grad (dsame: the
// grouped op's dw is E times the dense GEMM's, and its f32 read-modify-write is most of the op's memory traffic).
// auto, dense, grouped, loop and sm90 are timed in turn, window by window, so clock drift over the run does not tilt
// their ratios (the loop's stream sweep is timed on its own); each window runs one path back to back for about
// 2 ms, so the host's launch time stays out of it (time_ms_interleaved says why not single calls).
// The summary at the end sums each layer's six ops (fc1 and fc2; forward, dgrad, wgrad).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/bench_common.hpp"
#include "megacore/megacore.hpp"

using namespace megacore;
using json = nlohmann::json;

namespace {

struct ModelShape {
  const char* name;
  int64_t hidden, ffn;
  int experts, topk;
};

struct Args {
  std::vector<ModelShape> models;
  std::vector<int64_t> tokens{4096, 8192, 16384};
  std::vector<int64_t> rows_per_expert{32, 64, 128, 256, 512};  // fine-grained models
  int samples = 10;
  bool quick = false;
  bool stream_sweep = true;
  std::string out_dir;
};

Args parse(int argc, char** argv) {
  const ModelShape mixtral{"mixtral-8x7b", 4096, 14336, 8, 2}, small{"1.1b-moe", 2048, 5632, 8, 2};
  const ModelShape fine64{"fine-64e", 2048, 1408, 64, 8}, fine128{"fine-128e", 2048, 1408, 128, 8};
  Args a;
  std::string model = "all";
  bench::ArgReader r(argc, argv);
  while (r.next()) {
    const std::string& k = r.key();
    if (k == "--model") model = r.text();
    else if (k == "--tokens") a.tokens = r.list();
    else if (k == "--rows-per-expert") a.rows_per_expert = r.list();
    else if (k == "--samples") a.samples = int(r.integer());
    else if (k == "--quick") a.quick = true;
    else if (k == "--no-stream-sweep") a.stream_sweep = false;
    else if (k == "--out-dir") a.out_dir = r.text();
    else r.unknown();
  }
  if (model == "mixtral" || model == "all") a.models.push_back(mixtral);
  if (model == "1b" || model == "all") a.models.push_back(small);
  if (model == "fine" || model == "all") a.models.push_back(fine64), a.models.push_back(fine128);
  if (a.models.empty()) throw std::runtime_error("--model takes mixtral, 1b, fine or all, got '" + model + "'");
  if (a.quick) a.tokens.resize(1), a.rows_per_expert.resize(1), a.samples = 5;
  for (int64_t t : a.tokens)
    if (t < 1) throw std::runtime_error("--tokens must be positive");
  for (int64_t t : a.rows_per_expert)
    if (t < 1) throw std::runtime_error("--rows-per-expert must be positive");
  return a;
}

/// Token counts to run for model m: --tokens, or for the fine-grained models R E / k per --rows-per-expert R.
std::vector<int64_t> tokens_for(const Args& a, const ModelShape& m) {
  if (m.experts <= 8) return a.tokens;
  std::vector<int64_t> t;
  for (int64_t r : a.rows_per_expert) t.push_back(std::max<int64_t>(1, r * m.experts / m.topk));
  return t;
}

/// Median milliseconds per call of each fn() over `samples` event-timed windows made in turn (fn 0, fn 1, ...,
/// fn 0, ...) after warm-up, so clock and temperature drift over the run reaches every fn alike. Each window runs
/// the fn back to back until it spans about kWindowMs (reps fixed per fn from the warm-up): the host enqueues the
/// next call while the GPU runs the last, so the host's planning and launch are not timed beyond the first call of
/// a window, and the GPU stays under load as in a training step (a single call after a synchronize times the
/// launch; an idle or memory-bound gap before it lets a compute-bound kernel start at a higher clock).
constexpr double kWindowMs = 2.0;
std::vector<double> time_ms_interleaved(const std::vector<std::function<void()>>& fns, const Stream& s,
                                        int samples) {
  std::vector<int> reps;
  for (const auto& fn : fns) {
    fn();
    Event a(true), b(true);
    a.record(s);
    for (int i = 0; i < 3; ++i) fn();
    b.record(s);
    b.synchronize();
    const double per = std::max(a.elapsed_ms(b) / 3.0, 1e-3);
    reps.push_back(int(std::clamp(std::ceil(kWindowMs / per), 1.0, 200.0)));
  }
  std::vector<std::vector<double>> ms(fns.size());
  for (int i = 0; i < samples; ++i)
    for (size_t f = 0; f < fns.size(); ++f) {
      Event a(true), b(true);
      a.record(s);
      for (int r = 0; r < reps[f]; ++r) fns[f]();
      b.record(s);
      b.synchronize();
      ms[f].push_back(a.elapsed_ms(b) / reps[f]);
    }
  std::vector<double> med;
  for (auto& v : ms) {
    std::sort(v.begin(), v.end());
    med.push_back(v[v.size() / 2]);
  }
  return med;
}

/// Median milliseconds per call of fn() over `samples` event-timed windows after warm-up.
double time_ms(const std::function<void()>& fn, const Stream& s, int samples) {
  return time_ms_interleaved({fn}, s, samples)[0];
}

/// Rows per expert: even, or fixed-seed shares between 0.25x and 2.5x of even with expert 1 empty.
std::vector<int64_t> split(int64_t n, int experts, bool imbalanced) {
  std::vector<double> w(size_t(experts), 1.0);
  if (imbalanced) {
    std::mt19937_64 rng(1234);
    std::uniform_real_distribution<double> u(0.25, 2.5);
    for (auto& v : w) v = u(rng);
    w[1] = 0.0;
  }
  double total = 0;
  for (double v : w) total += v;
  std::vector<int64_t> sizes(static_cast<size_t>(experts));
  int64_t used = 0;
  for (int e = 0; e < experts; ++e) used += (sizes[size_t(e)] = int64_t(double(n) * w[size_t(e)] / total));
  sizes[0] += n - used;  // rounding remainder
  return sizes;
}

Tensor dev_randn(const Shape& shape, DType dt, uint64_t seed) {
  Tensor t = Tensor::empty(shape, dt, Device::cuda(0));
  Generator g(seed, 0);
  t.normal_(g, 0.0, 0.5);
  return t;
}

std::string sizes_str(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    if (!cuda_available()) throw std::runtime_error("no CUDA device: this benchmark runs on a GPU");
    const Device dev = Device::cuda(0);
    const Stream s = Stream::default_stream(dev);
    const std::string card = cuda_device_name(0);
    json rows = json::array();
    std::printf("card: %s\n", card.c_str());
    // The card's device-to-device copy bandwidth (bytes read + written per second), for the roofline.
    double copy_bw = 0;
    {
      const int64_t n = int64_t(1) << 29;  // 1 GiB of bf16 each way
      Tensor src = Tensor::zeros({n}, DType::BF16, dev), dst = Tensor::empty({n}, DType::BF16, dev);
      const double ms = time_ms([&] { dst.copy_(src, s); }, s, a.samples);
      copy_bw = 2.0 * double(n) * 2.0 / (ms * 1e-3);
      std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy_bw / 1e9);
    }
    std::printf("TFLOP/s; auto = megacore's default path (shown beside it)\n");
    std::printf("loop1 = one GEMM per expert on one stream; loop = the same on the streams in force "
                "(MEGACORE_MOE_GEMM_STREAMS; default: wgrad %d, forward and dgrad 1)\n",
                ops::kGroupedGemmWgradStreams);
    std::printf("dense = one GEMM of the same FLOPs over all N rows into one expert's output; dsame (wgrad) = one GEMM "
                "of the same FLOPs into the same f32 main grad as the grouped op (N / E rows, E experts' dw as one "
                "matrix); att = max(dense, memory roofline); tgt = max(att, dsame), the target's yardstick\n");
    std::printf("%-13s %6s %-10s %-10s %9s %-7s %9s %9s %9s %9s %9s %9s %8s %8s %8s %8s\n", "model", "tokens", "split",
                "op", "auto", "path", "sm90", "grouped", "loop1", "loop", "dense", "dsame", "auto/dns", "auto/att",
                "auto/tgt", "auto/best");
    const ops::GroupedGemmPath setting = ops::grouped_gemm_path();
    for (const auto& m : a.models)
      for (int64_t tokens : tokens_for(a, m)) {
        const int64_t n = tokens * m.topk;
        const int g = m.experts;
        // fc1: [N, H] -> [N, 2 FFN]; fc2: [N, FFN] -> [N, H].
        struct Layer {
          const char* name;
          int64_t out_f, in_f;
        };
        for (const Layer& l : {Layer{"fc1", 2 * m.ffn, m.hidden}, Layer{"fc2", m.hidden, m.ffn}}) {
          Tensor x = dev_randn({n, l.in_f}, DType::BF16, 1), w = dev_randn({g, l.out_f, l.in_f}, DType::BF16, 2);
          Tensor y = Tensor::empty({n, l.out_f}, DType::BF16, dev), dy = dev_randn({n, l.out_f}, DType::BF16, 3);
          Tensor dx = Tensor::empty({n, l.in_f}, DType::BF16, dev);
          Tensor dw = Tensor::zeros({g, l.out_f, l.in_f}, DType::F32, dev);
          Tensor w0 = w.select(0, 0), dw0 = dw.select(0, 0);
          const double flops = 2.0 * double(n) * double(l.out_f) * double(l.in_f);
          for (bool imbalanced : {false, true}) {
            const std::vector<int64_t> sizes = split(n, g, imbalanced);
            struct Op {
              const char* name;
              std::function<void()> grouped, dense;
            };
            ops::GemmOptions fwd_o, dgrad_o, wgrad_o;
            fwd_o.trans_b = true;
            wgrad_o.trans_a = true, wgrad_o.beta = 1.f;
            const std::vector<Op> op_list{
                {"fwd", [&] { ops::grouped_gemm_forward(x, w, sizes, y, s); },
                 [&] { ops::gemm(x, w0, y, fwd_o, s); }},
                {"dgrad", [&] { ops::grouped_gemm_dgrad(dy, w, sizes, dx, s); },
                 [&] { ops::gemm(dy, w0, dx, dgrad_o, s); }},
                {"wgrad", [&] { ops::grouped_gemm_wgrad(dy, x, sizes, dw, 1.f, s); },
                 [&] { ops::gemm(dy, x, dw0, wgrad_o, s); }},
            };
            for (size_t i = 0; i < op_list.size(); ++i) {
              const Op& op = op_list[i];
              // The op forced onto one path (the setting in force restored after each call), and its time alone.
              auto forced = [&](ops::GroupedGemmPath p) {
                return std::function<void()>([&, p] {
                  ops::set_grouped_gemm_path(p);
                  op.grouped();
                  ops::set_grouped_gemm_path(setting);
                });
              };
              auto on_path = [&](ops::GroupedGemmPath p) { return time_ms(forced(p), s, a.samples); };
              const bool wgrad = i == 2;  // bf16 -> f32: no cuBLAS grouped kernel, every path loops
              // The path auto takes: the Hopper kernel where it runs (it counts its launches), else cuBLAS's.
              const int64_t sm90_before = ops::grouped_gemm_sm90_launches();
              op.grouped();
              const bool auto_sm90 = ops::grouped_gemm_sm90_launches() > sm90_before;
              const char* chosen =
                  auto_sm90 ? "sm90"
                            : ops::grouped_gemm_path_name(
                                  ops::grouped_gemm_choice(setting, sizes, l.out_f * l.in_f, !wgrad));
              const bool has_sm90 = ops::grouped_gemm_sm90_available(dev);
              // auto, the dense GEMM (the target's ratio), the cuBLAS grouped launch, the per-expert loop (on the
              // streams in force) and the Hopper kernel timed in turn, window by window, so that clock and temperature
              // drift over the run reach every path alike and auto_vs_best compares like with like.
              std::vector<std::function<void()>> paired{op.grouped, op.dense, forced(ops::GroupedGemmPath::Grouped),
                                                        forced(ops::GroupedGemmPath::Loop)};
              if (has_sm90) paired.push_back(forced(ops::GroupedGemmPath::Sm90));
              // wgrad: the dense GEMM of the same FLOPs that also writes the same f32 main grad: dw of all experts as
              // one [E out_f, in_f] matrix, beta 1, reduced over N / E rows (dy viewed as [N / E, E out_f]). The
              // other dense GEMM reduces over all N rows into one expert's dw, so it reads and writes 1/E of the main
              // grad bytes the grouped op must; this one reads and writes the same main grad and does the same FLOPs,
              // without groups (it reads N / E rows of x where the grouped op reads all N).
              const bool same_out = wgrad && n % g == 0;
              Tensor dy_same, x_same, dw_same;
              if (same_out) {
                dy_same = dy.view({n / g, g * l.out_f}), x_same = x.narrow(0, 0, n / g);
                dw_same = dw.view({g * l.out_f, l.in_f});
                paired.push_back([&] { ops::gemm(dy_same, x_same, dw_same, wgrad_o, s); });
              }
              const std::vector<double> t_paired = time_ms_interleaved(paired, s, a.samples);
              const double t_auto = t_paired[0], t_dense = t_paired[1], t_grouped = t_paired[2], t_loop = t_paired[3];
              const double t_sm90 = has_sm90 ? t_paired[4] : 0.0;
              const double t_same = same_out ? t_paired.back() : 0.0;
              // The loop on 1, 2, 4 and 8 CUDA streams (t_loop: on the streams in force).
              json loop_by_streams = json::object();
              const int streams_setting = ops::grouped_gemm_loop_streams();
              for (int k : {1, 2, 4, 8}) {
                if (!a.stream_sweep && k != 1) continue;
                ops::set_grouped_gemm_loop_streams(k);
                loop_by_streams[std::to_string(k)] = on_path(ops::GroupedGemmPath::Loop);
                ops::set_grouped_gemm_loop_streams(streams_setting);
              }
              const double t_loop1 = loop_by_streams["1"].get<double>();
              const double t_best = std::min({t_grouped, t_loop, has_sm90 ? t_sm90 : t_loop});
              // Bytes every path must move at least: the experts' weights (bf16; wgrad reads and writes their f32
              // main grads) and the rows in and out.
              const double wbytes = double(g) * double(l.out_f) * double(l.in_f);
              const double min_bytes = wgrad ? wbytes * 8.0 + 2.0 * double(n) * double(l.out_f + l.in_f)
                                             : wbytes * 2.0 + 2.0 * double(n) * double(l.out_f + l.in_f);
              const double roofline_ms = min_bytes / copy_bw * 1e3;
              const double t_attainable = std::max(t_dense, roofline_ms);
              // The target's yardstick: the attainable time, and for wgrad at least the dense GEMM of the same output.
              const double t_target = std::max(t_attainable, t_same);
              auto tf = [&](double ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0; };
              const std::string opname = std::string(l.name) + "_" + op.name;
              std::printf("%-13s %6lld %-10s %-10s %9.1f %-7s %9.1f %9.1f %9.1f %9.1f %9.1f %9s %7.1f%% %7.1f%% %7.1f%% %7.1f%%\n",
                          m.name, (long long)tokens, imbalanced ? "imbalanced" : "even", opname.c_str(), tf(t_auto),
                          chosen, tf(t_sm90), tf(t_grouped), tf(t_loop1), tf(t_loop), tf(t_dense),
                          same_out ? std::to_string(int(std::lround(tf(t_same)))).c_str() : "-", 100.0 * t_dense / t_auto,
                          100.0 * t_attainable / t_auto, 100.0 * t_target / t_auto, 100.0 * t_best / t_auto);
              rows.push_back({{"model", m.name},
                              {"hidden", m.hidden},
                              {"ffn", m.ffn},
                              {"experts", g},
                              {"topk", m.topk},
                              {"tokens", tokens},
                              {"rows", n},
                              {"split", imbalanced ? "imbalanced" : "even"},
                              {"group_sizes", sizes},
                              {"op", opname},
                              {"shape_MxK", std::to_string(l.out_f) + "x" + std::to_string(l.in_f)},
                              {"dtype", i == 2 ? "bf16 -> f32 main grad (beta 1)" : "bf16"},
                              {"flops", flops},
                              {"rows_per_expert_mean", double(n) / g},
                              {"path_setting", ops::grouped_gemm_path_name(setting)},
                              {"auto_path", chosen},
                              {"auto_ms", t_auto},
                              {"sm90_ms", has_sm90 ? json(t_sm90) : json(nullptr)},
                              {"sm90_tflops", has_sm90 ? json(tf(t_sm90)) : json(nullptr)},
                              {"roofline_ms", roofline_ms},
                              {"attainable_ms", t_attainable},
                              {"auto_vs_attainable", t_attainable / t_auto},
                              {"dense_same_output_ms", same_out ? json(t_same) : json(nullptr)},
                              {"dense_same_output_tflops", same_out ? json(tf(t_same)) : json(nullptr)},
                              {"auto_vs_dense_same_output", same_out ? json(t_same / t_auto) : json(nullptr)},
                              {"target_ms", t_target},
                              {"auto_vs_target", t_target / t_auto},
                              {"grouped_ms", t_grouped},
                              {"loop_ms", t_loop},
                              {"loop_streams", ops::grouped_gemm_loop_streams_for(wgrad)},
                              {"loop_ms_by_streams", loop_by_streams},
                              {"min_bytes", min_bytes},
                              {"dense_ms", t_dense},
                              {"auto_tflops", tf(t_auto)},
                              {"grouped_tflops", tf(t_grouped)},
                              {"loop_tflops", tf(t_loop)},
                              {"dense_tflops", tf(t_dense)},
                              {"auto_vs_dense", t_dense / t_auto},
                              {"auto_vs_best", t_best / t_auto},
                              {"grouped_vs_loop", t_loop / t_grouped},
                              {"card", card}});
            }
          }
        }
      }
    // Per layer (model, tokens, split): the six ops' attainable time over their auto time, summed, i.e. what the
    // MoE layer's expert GEMMs (forward and backward) get of what the shapes allow; and the rows below 85 %.
    json layers = json::array();
    int below = 0, below_t = 0;
    for (const json& row : rows) {
      auto L = std::find_if(layers.begin(), layers.end(), [&](const json& l) {
        return l["model"] == row["model"] && l["tokens"] == row["tokens"] && l["split"] == row["split"];
      });
      if (L == layers.end()) {
        layers.push_back({{"model", row["model"]},
                          {"tokens", row["tokens"]},
                          {"rows_per_expert_mean", row["rows_per_expert_mean"]},
                          {"split", row["split"]},
                          {"attainable_ms", 0.0},
                          {"target_ms", 0.0},
                          {"auto_ms", 0.0},
                          {"rows_below_85pct", 0},
                          {"rows_below_85pct_of_target", 0}});
        L = layers.end() - 1;
      }
      const int low = row["auto_vs_attainable"].get<double>() < 0.85 ? 1 : 0;
      const int low_t = row["auto_vs_target"].get<double>() < 0.85 ? 1 : 0;
      (*L)["attainable_ms"] = (*L)["attainable_ms"].get<double>() + row["attainable_ms"].get<double>();
      (*L)["target_ms"] = (*L)["target_ms"].get<double>() + row["target_ms"].get<double>();
      (*L)["rows_below_85pct_of_target"] = (*L)["rows_below_85pct_of_target"].get<int>() + low_t;
      below_t += low_t;
      (*L)["auto_ms"] = (*L)["auto_ms"].get<double>() + row["auto_ms"].get<double>();
      (*L)["rows_below_85pct"] = (*L)["rows_below_85pct"].get<int>() + low;
      below += low;
    }
    std::printf("\nper layer (fc1 + fc2, forward + dgrad + wgrad): attainable / auto, target / auto\n");
    for (auto& L : layers) {
      L["auto_vs_attainable"] = L["attainable_ms"].get<double>() / L["auto_ms"].get<double>();
      L["auto_vs_target"] = L["target_ms"].get<double>() / L["auto_ms"].get<double>();
      std::printf("%-13s %6lld %-10s %6.1f%% %6.1f%%  (of 6 ops below 85 %%: %d of attainable, %d of target)\n",
                  L["model"].get<std::string>().c_str(), (long long)L["tokens"].get<int64_t>(),
                  L["split"].get<std::string>().c_str(), 100.0 * L["auto_vs_attainable"].get<double>(),
                  100.0 * L["auto_vs_target"].get<double>(), L["rows_below_85pct"].get<int>(),
                  L["rows_below_85pct_of_target"].get<int>());
    }
    std::printf("rows below 85 %% of attainable: %d of %zu; of the target: %d\n", below, rows.size(), below_t);
    const json result = {
        {"benchmark", "moe_gemm"},
        {"card", card},
        {"copy_bandwidth_gbs", copy_bw / 1e9},
        {"target", "auto >= 85% of the dense GEMM of the same FLOPs (issue 22), read as target_ms: forward and dgrad "
                   "attainable_ms (max of the dense GEMM's time and the memory roofline), wgrad also at least "
                   "dense_same_output_ms (the dense GEMM of the same FLOPs that reads and writes the same f32 main "
                   "grad); and auto >= the fastest path"},
        {"note", "auto = the op with megacore's path setting (MEGACORE_MOE_GEMM, default auto; auto_path says what it "
                 "took); sm90 / grouped / loop = the op forced onto megacore's Hopper grouped kernel / one cuBLAS "
                 "grouped launch / one cuBLASLt GEMM per expert; dense = one ops::gemm over all N rows with expert "
                 "0's weight (same FLOPs, 1/E of the weight bytes). cuBLAS has no grouped kernel for bf16 -> f32 "
                 "(wgrad into the f32 main grad), so its grouped path loops there. loop_ms_by_streams: the loop on "
                 "1/2/4/8 CUDA streams; min_bytes: the bytes every path must move (bf16 weights, or for wgrad the f32 "
                 "main grads read and written, plus the rows in and out); roofline_ms = min_bytes / the measured "
                 "device-to-device copy bandwidth; attainable_ms = max(dense_ms, roofline_ms). auto, dense, grouped, "
                 "loop (on the streams in force) and sm90 are timed in turn, each in windows of about 2 ms of "
                 "back-to-back calls (ms per call: the median over --samples windows), so drift over the run reaches "
                 "them alike and the host's launch time stays out; loop_ms_by_streams is timed on its own. "
                 "dense_same_output_ms (wgrad): one ops::gemm of the same FLOPs into the same f32 main grad, beta 1 "
                 "(dy viewed as [N / E, E out_f] times N / E rows of x into all experts' dw as one [E out_f, in_f] "
                 "matrix), timed in the same turns; target_ms = max(attainable_ms, dense_same_output_ms). "
                 "layers: per model, tokens and "
                 "split, the six ops' attainable_ms, target_ms and auto_ms summed (the layer's expert GEMMs forward "
                 "and backward)"},
        {"rows_below_85pct_of_attainable", below},
        {"rows_below_85pct_of_target", below_t},
        {"layers", layers},
        {"rows", rows}};
    if (!a.out_dir.empty()) {
      std::string c = card;
      std::replace(c.begin(), c.end(), ' ', '_');
      const std::string path = a.out_dir + "/moe_gemm_" + c + ".json";
      std::ofstream(path) << result.dump(2) << "\n";
      std::printf("wrote %s\n", path.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_moe_gemm: %s\n", e.what());
    return 1;
  }
  return 0;
}
