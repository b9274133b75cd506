// LoRA on the routed experts of a MoELayer (layers/moe_lora.hpp), on one rank.
//
// Reference: the same layer with the adapters merged (W_e' = W_e + s · B_e A_e) and unfrozen. Its output and input
// gradient must equal the adapter layer's, and since W' is linear in A and B the chain rule gives the adapter
// gradients from the merged weights' gradient: dB_e = s · dW_e' A_eᵀ, dA_e = s · B_eᵀ dW_e' (segment rows of
// fc1 for gate / up). Only f32 rounding differs (relative error 1e-5). B is drawn at random (PEFT initialises it
// to zero, which would make every check trivial). The CUDA test runs the adapter layer on the GPU and compares
// with the CPU run.
#include "moe_test_util.hpp"
#include "megacore/ops/gemm.hpp"

using namespace megacore;
using namespace layers_test;
namespace ly = megacore::layers;

namespace {

constexpr int64_t kH = 16, kF = 12, kE = 4, kR = 3;

ly::MoEOptions options(bool swiglu, DType dt, Device dev) {
  ly::MoEOptions o;
  o.num_experts = kE;
  o.topk = 2;
  o.ffn_hidden_size = kF;
  o.activation = swiglu ? ly::ActivationType::SwiGLU : ly::ActivationType::GELU;
  o.init_std = 0.3;
  o.params_dtype = dt;
  o.device = dev;
  return o;
}

void attach(ly::MoELayer& m, bool swiglu) {
  const std::vector<std::string> segs = swiglu ? std::vector<std::string>{"gate_proj", "up_proj"}
                                               : std::vector<std::string>{};
  m.attach_lora(segs, !swiglu, true, ly::LoRAOptions{.rank = kR, .alpha = 6, .seed = 5, .init_offset = 1000});
  // Random B (the same on every device), so the low-rank path contributes.
  uint64_t off = 50;
  for (ly::ExpertLoRAAdapter* a : {m.fc1_lora(), m.fc2_lora()})
    for (auto& [name, p] : a->named_parameters())
      if (name.find("lora_B") != std::string::npos) {
        Tensor b = scaled(randn(p->data.shape(), off++), 0.5);
        p->data.copy_(b.to(p->data.dtype()).to(p->data.device()));
      }
}

struct Run {
  Tensor y, dx;
  std::vector<Tensor> grads;  // main_grads of the adapters, in named_parameters order (f32, CPU)
};

Run run_adapters(bool swiglu, DType dt, Device dev) {
  SoloMoEGroups solo;
  ly::MoELayer m(solo.groups(), kH, options(swiglu, dt, dev));
  attach(m, swiglu);
  m.set_frozen(true);
  REQUIRE_FALSE(m.fc1_weight().main_grad.defined());
  ly::ForwardContext ctx;
  const Tensor x = randn({6, 2, kH}, 1).to(dt).to(dev), dy = randn({6, 2, kH}, 2).to(dt).to(dev);
  Run r;
  r.y = m.forward(ctx, x).to(Device::cpu()).to(DType::F32);
  r.dx = m.backward(ctx, dy).to(Device::cpu()).to(DType::F32);
  for (ly::ExpertLoRAAdapter* a : {m.fc1_lora(), m.fc2_lora()})
    for (auto& [name, p] : a->named_parameters()) r.grads.push_back(p->main_grad.to(Device::cpu()));
  REQUIRE(m.parameters().size() == r.grads.size());  // frozen: only the adapters are trainable
  return r;
}

Tensor mm(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  ops::GemmOptions o;
  o.trans_a = ta, o.trans_b = tb;
  return ops::matmul(a.contiguous(), b.contiguous(), o);
}

void check_against_merged(bool swiglu) {
  INFO((swiglu ? "SwiGLU" : "GELU"));
  const Run got = run_adapters(swiglu, DType::F32, Device::cpu());
  SoloMoEGroups solo;
  ly::MoELayer ref(solo.groups(), kH, options(swiglu, DType::F32, Device::cpu()));
  attach(ref, swiglu);
  // Keep A and B before merging for the chain rule.
  std::vector<Tensor> a1, b1;
  for (size_t j = 0; j < ref.fc1_lora()->segments().size(); ++j)
    a1.push_back(ref.fc1_lora()->lora_a(j).data.clone()), b1.push_back(ref.fc1_lora()->lora_b(j).data.clone());
  const Tensor a2 = ref.fc2_lora()->lora_a(0).data.clone(), b2 = ref.fc2_lora()->lora_b(0).data.clone();
  const double s = ref.fc1_lora()->scale();
  const Tensor w1_before = ref.fc1_weight().data.clone();
  ref.merge_lora();
  REQUIRE(ref.fc1_lora() == nullptr);
  // The merge itself: W_e + s · B_e A_e, segment by segment.
  for (int64_t e = 0; e < kE; ++e)
    for (size_t j = 0; j < a1.size(); ++j) {
      const int64_t row0 = swiglu && j == 1 ? kF : 0;
      Tensor want = w1_before.select(0, e).narrow(0, row0, kF).contiguous().clone();
      Tensor ba = mm(b1[j].select(0, e), a1[j].select(0, e), false, false);
      for (int64_t i = 0; i < want.numel(); ++i) want.data<float>()[i] += float(s) * ba.data<float>()[i];
      require_close(ref.fc1_weight().data.select(0, e).narrow(0, row0, kF).contiguous(), want, 1e-6, "merged fc1");
    }
  ly::ForwardContext ctx;
  const Tensor x = randn({6, 2, kH}, 1), dy = randn({6, 2, kH}, 2);
  require_close(got.y, ref.forward(ctx, x), 1e-5, "output = merged model's");
  require_close(got.dx, ref.backward(ctx, dy), 1e-5, "input gradient = merged model's");
  const Tensor g1 = ref.fc1_weight().main_grad, g2 = ref.fc2_weight().main_grad;
  size_t k = 0;
  for (size_t j = 0; j < a1.size(); ++j, k += 2) {
    const int64_t row0 = swiglu && j == 1 ? kF : 0;
    for (int64_t e = 0; e < kE; ++e) {
      const Tensor dw = g1.select(0, e).narrow(0, row0, kF).contiguous();
      require_close(got.grads[k].select(0, e).contiguous(), scaled(mm(b1[j].select(0, e), dw, true, false), s), 1e-5,
                    "fc1 lora_A gradient");
      require_close(got.grads[k + 1].select(0, e).contiguous(), scaled(mm(dw, a1[j].select(0, e), false, true), s), 1e-5,
                    "fc1 lora_B gradient");
    }
  }
  for (int64_t e = 0; e < kE; ++e) {
    const Tensor dw = g2.select(0, e).contiguous();
    require_close(got.grads[k].select(0, e).contiguous(), scaled(mm(b2.select(0, e), dw, true, false), s), 1e-5,
                  "fc2 lora_A gradient");
    require_close(got.grads[k + 1].select(0, e).contiguous(), scaled(mm(dw, a2.select(0, e), false, true), s), 1e-5,
                  "fc2 lora_B gradient");
  }
}

}  // namespace

TEST_CASE("LoRA on MoE experts: output, input and adapter gradients equal the merged layer's", "[lora][moe][layers]") {
  check_against_merged(true);
  check_against_merged(false);
}

TEST_CASE("LoRA on MoE experts: init independent of the expert placement; dropout; bad input", "[lora][moe][layers]") {
  // Expert 2's A drawn by a rank holding experts [2, 4) equals the single rank's.
  NoCommCommunicator c(0, 1);
  auto segs = std::vector<ly::LoRASegment>{{.name = "gate_proj", .out_features = kF, .block_width = 2 * kF, .width = kF}};
  const ly::LoRAOptions o{.rank = kR, .alpha = 6, .seed = 5, .init_offset = 7};
  ly::ExpertLoRAAdapter all(c, ly::LoRAAdapter::Kind::Column, kE, 0, kE, kH, segs, o, DType::F32, Device::cpu());
  ly::ExpertLoRAAdapter half(c, ly::LoRAAdapter::Kind::Column, 2, 2, kE, kH, segs, o, DType::F32, Device::cpu());
  require_equal(half.lora_a(0).data, all.lora_a(0).data.narrow(0, 2, 2).contiguous(), "A of experts 2, 3");
  CHECK(half.lora_a(0).expert);
  CHECK(half.lora_a(0).expert_offset == 2);
  CHECK(half.lora_b(0).partition_dim == 1);
  CHECK(half.lora_b(0).data.to_double_vector() == std::vector<double>(size_t(2 * kF * kR), 0.0));
  CHECK_THROWS_AS(ly::ExpertLoRAAdapter(c, ly::LoRAAdapter::Kind::Column, kE, 0, kE, kH, segs,
                                        ly::LoRAOptions{.rank = kH + 1}, DType::F32, Device::cpu()),
                  ValueError);
  // Dropout: training draws differ from eval; eval equals the adapter-free path plus the exact low-rank term.
  SoloMoEGroups solo;
  ly::MoELayer m(solo.groups(), kH, options(true, DType::F32, Device::cpu()));
  m.attach_lora({"gate_proj"}, false, true, ly::LoRAOptions{.rank = kR, .alpha = 6, .dropout = 0.5, .seed = 5});
  CHECK_THROWS_AS(m.attach_lora({"up_proj"}, false, false, ly::LoRAOptions{}), ValueError);
  m.set_frozen(true);
  m.fc2_lora()->lora_b(0).data.copy_(randn({kE, kH, kR}, 9));
  ly::ForwardContext train, eval;
  eval.training = false;
  const Tensor x = randn({4, 2, kH}, 3);
  const Tensor y_eval = m.forward(eval, x), y_train = m.forward(train, x);
  CHECK(y_eval.to_double_vector() != y_train.to_double_vector());
  const Tensor dx = m.backward(train, randn({4, 2, kH}, 4));
  for (double v : m.fc2_lora()->lora_b(0).main_grad.to_double_vector()) REQUIRE(std::isfinite(v));
  for (double v : dx.to_double_vector()) REQUIRE(std::isfinite(v));
}

TEST_CASE("LoRA on MoE experts on CUDA: same outputs and gradients as on the CPU", "[lora][moe][layers][gpu]") {
  MC_REQUIRE_GPU();
  for (bool swiglu : {true, false}) {
    const Run cpu = run_adapters(swiglu, DType::F32, Device::cpu());
    for (auto [dt, tol] : {std::pair{DType::F32, 3e-3}, std::pair{DType::BF16, 3e-2}}) {
      INFO((swiglu ? "SwiGLU " : "GELU ") << dtype_name(dt));
      const Run gpu = run_adapters(swiglu, dt, Device::cuda(0));
      require_close(gpu.y, cpu.y, tol, "output");
      require_close(gpu.dx, cpu.dx, tol, "input gradient");
      for (size_t i = 0; i < cpu.grads.size(); ++i) require_close(gpu.grads[i], cpu.grads[i], tol, "adapter gradient");
    }
  }
}
