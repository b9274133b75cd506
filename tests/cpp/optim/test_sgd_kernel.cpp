// ops::multi_tensor_sgd against a double-precision reference (CPU), the CUDA kernel against the CPU one,
// and SGD / DDP + DistributedOptimizer on CUDA against their CPU runs.
//
// The kernel computes in f32; the reference in f64 from the same f32 inputs, so over 3 steps the
// difference is f32 rounding: we hold each tensor to 1e-6 relative error (||a − b|| / ||b||). The CUDA
// kernel does the same f32 operations as the CPU loop, but the compiler may fuse multiply-adds
// differently, so CUDA vs CPU is held to 1e-6 as well (and bf16 outputs to one bf16 ulp, 1e-2).
#include <cmath>
#include <memory>

#include "layers/layers_test_util.hpp"
#include "megacore/ops/optimizer.hpp"
#include "megacore/optim/distributed_optimizer.hpp"
#include "megacore/optim/optimizer.hpp"
#include "test_helpers.hpp"

using namespace megacore;
namespace ly = megacore::layers;

namespace {

struct Case {
  std::vector<Tensor> g, w, m, out;
};

Case make_case(Device d, int step) {
  Case c;
  const std::vector<int64_t> sizes = {5, 70000, 129};
  for (size_t i = 0; i < sizes.size(); ++i) {
    c.g.push_back(layers_test::randn({sizes[i]}, 100 + 10 * uint64_t(step) + i).to(d));
    c.w.push_back(layers_test::randn({sizes[i]}, 200 + i).to(d));
    c.m.push_back(Tensor::zeros({sizes[i]}, DType::F32, d));
    c.out.push_back(Tensor::zeros({sizes[i]}, DType::BF16, d));
  }
  return c;
}

}  // namespace

TEST_CASE("multi_tensor_sgd equals a double-precision reference (momentum, Nesterov, weight decay)", "[optim][sgd]") {
  for (bool nesterov : {false, true}) {
    INFO("nesterov " << nesterov);
    Case c = make_case(Device::cpu(), 0);
    std::vector<std::vector<double>> w, buf;
    for (const Tensor& t : c.w) {
      w.push_back(t.to_double_vector());
      buf.push_back(std::vector<double>(size_t(t.numel()), 0.0));
    }
    ops::SGDHyper h;
    h.lr = 0.05f;
    h.momentum = 0.5f;
    h.dampening = nesterov ? 0.f : 0.25f;
    h.nesterov = nesterov;
    h.weight_decay = 0.125f;
    h.grad_scale = 0.5f;
    for (int step = 0; step < 3; ++step) {
      Case gs = make_case(Device::cpu(), step);
      h.first_step = step == 0;
      ops::multi_tensor_sgd(gs.g, c.w, c.m, c.out, h);
      for (size_t i = 0; i < c.w.size(); ++i) {
        const std::vector<double> g = gs.g[i].to_double_vector();
        for (size_t k = 0; k < g.size(); ++k) {
          double d = g[k] * 0.5 + 0.125 * w[i][k];
          buf[i][k] = step == 0 ? d : 0.5 * buf[i][k] + (1.0 - h.dampening) * d;
          d = nesterov ? d + 0.5 * buf[i][k] : buf[i][k];
          w[i][k] -= 0.05 * d;
        }
      }
    }
    for (size_t i = 0; i < c.w.size(); ++i) {
      REQUIRE(mctest::rel_err(c.w[i].to_double_vector(), w[i]) <= 1e-6);
      REQUIRE(mctest::rel_err(c.m[i].to_double_vector(), buf[i]) <= 1e-6);
      REQUIRE(mctest::rel_err(c.out[i].to_double_vector(), c.w[i].to(DType::BF16).to_double_vector()) == 0.0);
    }
  }
  Case c = make_case(Device::cpu(), 0);
  ops::SGDHyper h;
  h.momentum = 0.9f;
  REQUIRE_THROWS_AS(ops::multi_tensor_sgd(c.g, c.w, {}, {}, h), ValueError);  // momentum needs buffers
  h.nesterov = true;
  h.dampening = 0.1f;
  REQUIRE_THROWS_AS(ops::multi_tensor_sgd(c.g, c.w, c.m, {}, h), ValueError);
}

TEST_CASE("multi_tensor_sgd on CUDA equals the CPU kernel", "[optim][sgd][gpu]") {
  MC_REQUIRE_GPU();
  const Device d = Device::cuda(0);
  Case cpu = make_case(Device::cpu(), 0), gpu = make_case(d, 0);
  ops::SGDHyper h;
  h.lr = 0.05f;
  h.momentum = 0.9f;
  h.nesterov = true;
  h.weight_decay = 0.01f;
  Tensor gst = Tensor::full({1}, 0.75);
  for (int step = 0; step < 3; ++step) {
    Case a = make_case(Device::cpu(), step), b = make_case(d, step);
    h.first_step = step == 0;
    ops::multi_tensor_sgd(a.g, cpu.w, cpu.m, cpu.out, h, gst);
    ops::multi_tensor_sgd(b.g, gpu.w, gpu.m, gpu.out, h, gst.to(d));
  }
  synchronize_device(d);
  for (size_t i = 0; i < cpu.w.size(); ++i) {
    REQUIRE(mctest::rel_err(gpu.w[i].to_double_vector(), cpu.w[i].to_double_vector()) <= 1e-6);
    REQUIRE(mctest::rel_err(gpu.m[i].to_double_vector(), cpu.m[i].to_double_vector()) <= 1e-6);
    REQUIRE(mctest::rel_err(gpu.out[i].to_double_vector(), cpu.out[i].to_double_vector()) <= 1e-2);
  }
}

TEST_CASE("SGD, DDP and DistributedOptimizer run on CUDA and match their CPU runs", "[optim][ddp][gpu]") {
  MC_REQUIRE_GPU();
  const Device d = Device::cuda(0);
  auto make = [](Device dev, std::vector<std::unique_ptr<ly::Parameter>>& own) {
    std::vector<ly::Parameter*> ps;
    const std::vector<Shape> shapes = {{64, 33}, {33}, {17, 64}};
    for (size_t i = 0; i < shapes.size(); ++i) {
      auto p = std::make_unique<ly::Parameter>();
      p->name = "p" + std::to_string(i) + (shapes[i].size() == 1 ? ".bias" : ".weight");
      p->data = layers_test::randn(shapes[i], 300 + i).to(DType::BF16).to(dev);
      p->main_grad = Tensor::zeros(shapes[i], DType::F32, dev);
      ps.push_back(p.get());
      own.push_back(std::move(p));
    }
    return ps;
  };
  auto set_grads = [](const std::vector<ly::Parameter*>& ps, int step) {
    for (size_t i = 0; i < ps.size(); ++i)
      ps[i]->main_grad.copy_(layers_test::randn(ps[i]->data.shape(), 400 + 10 * uint64_t(step) + i));
  };
  // SGD on CUDA vs CPU.
  {
    std::vector<std::unique_ptr<ly::Parameter>> oc, og;
    auto pc = make(Device::cpu(), oc), pg = make(d, og);
    optim::SGD sc(pc, {.momentum = 0.9f, .weight_decay = 0.01f}), sg(pg, {.momentum = 0.9f, .weight_decay = 0.01f});
    for (int step = 0; step < 3; ++step) {
      set_grads(pc, step);
      set_grads(pg, step);
      sc.step(0.1f);
      sg.step(0.1f);
    }
    synchronize_device(d);
    for (size_t i = 0; i < pc.size(); ++i)
      REQUIRE(mctest::rel_err(sg.master(i).to_double_vector(), sc.master(i).to_double_vector()) <= 1e-6);
  }
  // DDP (one rank, a CUDA compute stream) + DistributedOptimizer on CUDA vs AdamW on the CPU.
  {
    std::vector<std::unique_ptr<ly::Parameter>> oc, og;
    auto pc = make(Device::cpu(), oc), pg = make(d, og);
    optim::AdamW ref(pc);
    layers_test::NoCommCommunicator one(0, 1);
    optim::DDPConfig dc;
    dc.use_distributed_optimizer = true;
    dc.bucket_size = 1000;
    dc.compute_stream = Stream::create(d);
    optim::DistributedDataParallel ddp(pg, one, dc);
    optim::DistributedOptimizer opt(ddp);
    for (int step = 0; step < 3; ++step) {
      set_grads(pc, step);
      ddp.zero_grad();
      dc.compute_stream.synchronize();
      set_grads(pg, step);
      ddp.notify_grad_ready(pg);
      ddp.finish_grad_sync();
      ref.step(0.01f);
      opt.step(0.01f);
    }
    dc.compute_stream.synchronize();
    const auto want = ref.state(), got = opt.gathered_state();
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO(got[i].name);
      REQUIRE(got[i].name == want[i].name);
      REQUIRE(mctest::rel_err(got[i].tensor.to_double_vector(), want[i].tensor.to_double_vector()) <= 1e-5);
    }
  }
}
