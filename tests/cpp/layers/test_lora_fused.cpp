// LoRA's fused path (layers/lora.hpp: the base weight and the A's in one [W ; A] buffer, one GEMM over
// the input) against the unfused path on the same layer: outputs, input gradients and the A/B gradients
// on fresh random inputs. Both run the same arithmetic in another order, so f32 agrees to 1e-6 relative
// (on CUDA in bf16: 2e-2, the bf16 rounding of the intermediate products). Covered: a column-parallel
// layer with a bias and grouped q/k/v segments (every output column covered, and only q and v), a whole
// row-parallel layer, A moved out of the buffer (as a DDP buffer does), the base weight moved out (falls
// back to the unfused path), merge, and MEGACORE_LORA_FUSED=0.
#include <cstdlib>
#include <memory>
#include <random>

#include "megacore/layers/linear.hpp"
#include "test_helpers.hpp"

using namespace megacore;
namespace ly = megacore::layers;
using mctest::SoloCommunicator;

namespace {

Tensor randn(const Shape& shape, uint64_t seed, uint64_t offset, DType dt = DType::F32, Device d = Device::cpu()) {
  Tensor t = Tensor::empty(shape);
  Generator g(seed, offset);
  t.normal_(g);
  return t.to(dt).to(d);
}

std::vector<double> host(const Tensor& t) { return t.to(Device::cpu()).contiguous().to_double_vector(); }

// Grouped QKV placement of a query-group layout: `blocks` groups of [hpg query heads ; k ; v], head dim d.
std::vector<ly::LoRASegment> qkv_segments(bool with_k, int64_t blocks, int64_t hpg, int64_t d) {
  const int64_t bw = (hpg + 2) * d;
  std::vector<ly::LoRASegment> s{{.name = "q_proj", .out_features = blocks * hpg * d, .blocks = blocks,
                                  .block_width = bw, .col0 = 0, .width = hpg * d}};
  if (with_k)
    s.push_back({.name = "k_proj", .out_features = blocks * d, .blocks = blocks, .block_width = bw,
                 .col0 = hpg * d, .width = d});
  s.push_back({.name = "v_proj", .out_features = blocks * d, .blocks = blocks, .block_width = bw,
               .col0 = (hpg + 1) * d, .width = d});
  return s;
}

struct Run {
  Tensor y, dx;
  std::vector<Tensor> da, db;
};

// One forward and backward of `lin` (adapter attached, B set) on x / dy.
template <class Linear>
Run run(Linear& lin, const Tensor& x, const Tensor& dy) {
  ly::ForwardContext ctx;
  Run r;
  r.y = lin.forward(ctx, x);
  r.dx = lin.backward(ctx, dy);
  for (size_t j = 0; j < lin.lora()->segments().size(); ++j) {
    r.da.push_back(lin.lora()->lora_a(j).main_grad.clone());
    r.db.push_back(lin.lora()->lora_b(j).main_grad.clone());
  }
  return r;
}

void check_same(const Run& fused, const Run& plain, double tol) {
  CHECK(mctest::rel_err(host(fused.y), host(plain.y)) <= tol);
  CHECK(mctest::rel_err(host(fused.dx), host(plain.dx)) <= tol);
  for (size_t j = 0; j < plain.da.size(); ++j) {
    INFO("segment " << j);
    CHECK(mctest::rel_err(host(fused.da[j]), host(plain.da[j])) <= tol);
    CHECK(mctest::rel_err(host(fused.db[j]), host(plain.db[j])) <= tol);
  }
}

std::unique_ptr<ly::ColumnParallelLinear> column_with_lora(comm::Communicator& tp, int64_t in, int64_t out,
                                                           std::vector<ly::LoRASegment> segs, bool fused, DType dt,
                                                           Device dev, uint64_t seed) {
  auto lin = std::make_unique<ly::ColumnParallelLinear>(
      tp, in, out, ly::ColumnParallelLinearOptions{.bias = true, .params_dtype = dt, .device = dev, .seed = seed});
  lin->bias().data.copy_(randn({out}, seed, 50, dt, dev));
  lin->attach_lora(std::make_unique<ly::LoRAAdapter>(
      tp, ly::LoRAAdapter::Kind::Column, in, std::move(segs),
      ly::LoRAOptions{.rank = 3, .alpha = 6, .seed = seed, .fused = fused}, dt, dev));
  lin->set_frozen(true);
  for (size_t j = 0; j < lin->lora()->segments().size(); ++j) {
    Tensor& b = lin->lora()->lora_b(j).data;
    b.copy_(randn(b.shape(), seed, 60 + j, dt, dev));
  }
  return lin;
}

std::unique_ptr<ly::RowParallelLinear> row_with_lora(comm::Communicator& tp, int64_t in, int64_t out, bool fused,
                                                     DType dt, Device dev, uint64_t seed) {
  auto lin = std::make_unique<ly::RowParallelLinear>(
      tp, in, out, ly::RowParallelLinearOptions{.bias = true, .params_dtype = dt, .device = dev, .seed = seed});
  lin->bias().data.copy_(randn({out}, seed, 51, dt, dev));
  lin->attach_lora(std::make_unique<ly::LoRAAdapter>(
      tp, ly::LoRAAdapter::Kind::Row, in,
      std::vector<ly::LoRASegment>{{.out_features = out, .block_width = out, .width = out}},
      ly::LoRAOptions{.rank = 4, .alpha = 8, .seed = seed, .fused = fused}, dt, dev));
  lin->set_frozen(true);
  Tensor& b = lin->lora()->lora_b(0).data;
  b.copy_(randn(b.shape(), seed, 70, dt, dev));
  return lin;
}

// Fused vs unfused on a grouped-QKV column layer (with and without k_proj) and a row layer.
void compare_paths(DType dt, Device dev, double tol) {
  const uint64_t seed = std::random_device{}();
  INFO("seed " << seed << " dtype " << dtype_name(dt));
  SoloCommunicator tp;
  const int64_t s = 6, b = 2, in = 24, blocks = 2, hpg = 2, d = 4, out = blocks * (hpg + 2) * d;
  const Tensor x = randn({s, b, in}, seed, 1, dt, dev), dy = randn({s, b, out}, seed, 2, dt, dev);
  for (bool with_k : {true, false}) {
    INFO("segments q" << (with_k ? ", k" : "") << ", v");
    auto fused = column_with_lora(tp, in, out, qkv_segments(with_k, blocks, hpg, d), true, dt, dev, seed);
    auto plain = column_with_lora(tp, in, out, qkv_segments(with_k, blocks, hpg, d), false, dt, dev, seed);
    REQUIRE(fused->lora()->fused_for(fused->weight().data));
    REQUIRE_FALSE(plain->lora()->fused_for(plain->weight().data));
    check_same(run(*fused, x, dy), run(*plain, x, dy), tol);
  }
  const int64_t rin = 16, rout = 12;
  const Tensor rx = randn({s, b, rin}, seed, 3, dt, dev), rdy = randn({s, b, rout}, seed, 4, dt, dev);
  auto fused = row_with_lora(tp, rin, rout, true, dt, dev, seed);
  auto plain = row_with_lora(tp, rin, rout, false, dt, dev, seed);
  REQUIRE(fused->lora()->fused_for(fused->weight().data));
  check_same(run(*fused, rx, rdy), run(*plain, rx, rdy), tol);
}

}  // namespace

TEST_CASE("LoRA fused path: same outputs and gradients as the unfused path", "[lora][layers]") {
  compare_paths(DType::F32, Device::cpu(), 1e-6);
}

TEST_CASE("LoRA fused path on CUDA in bf16: same outputs and gradients as the unfused path", "[lora][layers][gpu]") {
  MC_REQUIRE_GPU();
  compare_paths(DType::BF16, Device::cuda(0), 2e-2);
  compare_paths(DType::F32, Device::cuda(0), 3e-3);  // cuBLASLt may round f32 inputs to TF32
}

TEST_CASE("LoRA fused path: A moved out of the buffer, the weight moved out, merge, MEGACORE_LORA_FUSED=0",
          "[lora][layers]") {
  const uint64_t seed = std::random_device{}();
  INFO("seed " << seed);
  SoloCommunicator tp;
  const int64_t in = 24, out = 32;
  const Tensor x = randn({5, in}, seed, 1), dy = randn({5, out}, seed, 2);
  auto make = [&](bool fused) {
    return column_with_lora(tp, in, out, qkv_segments(true, 2, 2, 4), fused, DType::F32, Device::cpu(), seed);
  };
  auto fused = make(true), plain = make(false);
  // The weight and the A's view one buffer.
  CHECK(fused->weight().data.storage() == fused->lora()->lora_a(0).data.storage());
  CHECK(fused->weight().data.storage() == fused->lora()->lora_a(2).data.storage());

  // A re-pointed at storage of its own (what a DDP buffer does) and changed there: the fused forward
  // sees the new values.
  for (auto* lin : {fused.get(), plain.get()}) {
    ly::Parameter& a = lin->lora()->lora_a(1);
    a.data = a.data.clone();
    a.data.copy_(randn(a.data.shape(), seed, 9));
  }
  CHECK(fused->weight().data.storage() != fused->lora()->lora_a(1).data.storage());
  check_same(run(*fused, x, dy), run(*plain, x, dy), 1e-6);

  // The base weight moved out of the buffer: the layer falls back to the unfused path, still correct.
  {
    auto moved = make(true);
    moved->weight().data = moved->weight().data.clone();
    CHECK_FALSE(moved->lora()->fused_for(moved->weight().data));
    auto ref = make(false);
    check_same(run(*moved, x, dy), run(*ref, x, dy), 1e-6);
  }

  // Merge: the weight gets its own storage with W + s·B A; the merged layer computes the adapted output.
  {
    auto m = make(true);
    ly::ForwardContext eval;
    eval.training = false;
    const Tensor adapted = m->forward(eval, x);
    m->merge_lora();
    CHECK(m->lora() == nullptr);
    CHECK(m->weight().data.numel() == m->weight().data.storage()->nbytes() / int64_t(sizeof(float)));
    CHECK(mctest::rel_err(host(m->forward(eval, x)), host(adapted)) <= 1e-6);
  }

  // The environment switch: MEGACORE_LORA_FUSED=0 keeps adapters attached from then on unfused.
  ::setenv("MEGACORE_LORA_FUSED", "0", 1);
  auto off = make(true);
  ::unsetenv("MEGACORE_LORA_FUSED");
  CHECK_FALSE(off->lora()->fused_for(off->weight().data));
  auto on = make(true);
  CHECK(on->lora()->fused_for(on->weight().data));

  // Dropout > 0 keeps the unfused path (the adapter's input is dropout(x)).
  ly::ColumnParallelLinear d(tp, in, out, {.bias = false});
  d.attach_lora(std::make_unique<ly::LoRAAdapter>(
      tp, ly::LoRAAdapter::Kind::Column, in,
      std::vector<ly::LoRASegment>{{.out_features = out, .block_width = out, .width = out}},
      ly::LoRAOptions{.rank = 2, .dropout = 0.1}, DType::F32, Device::cpu()));
  CHECK_FALSE(d.lora()->fused_for(d.weight().data));
}
