// Links the installed megacore, makes tensors on the host (and a GPU if there is one) and checks them.
#include <megacore/megacore.hpp>

#include <cstdio>

int main() {
  using namespace megacore;
  Generator g(1234);
  Tensor a = Tensor::empty({3, 5});
  a.normal_(g);
  Tensor b = a.transpose(0, 1).contiguous();
  if (b.size(0) != 5 || a.to_double_vector()[1 * 1 + 0] != b.to_double_vector()[1 * 3 + 0]) {
    std::puts("transpose mismatch");
    return 1;
  }
  if (cuda_available()) {
    Tensor d = a.to(Device::cuda(0)).to(DType::BF16).to(DType::F32).to(Device::cpu());
    std::printf("round trip through %s done\n", cuda_device_name(0).c_str());
    (void)d;
  }
  try {
    a.view({4, 4});
    return 1;
  } catch (const ValueError& e) {
    std::printf("expected error: %s\n", e.what());
  }
  std::printf("megacore %s ok\n", MEGACORE_VERSION);
  return 0;
}
