#include "megacore/core/device.hpp"
#include "megacore/core/device_memory.hpp"

#include <charconv>

#include "core/cuda_backend.hpp"
#include "megacore/build_config.hpp"
#include "megacore/core/error.hpp"

namespace megacore {

std::string Device::str() const { return is_cpu() ? "cpu" : fmt::format("cuda:{}", index); }

Device Device::parse(std::string_view s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.substr(0, 5) == "cuda:") {
    int i = -1;
    auto rest = s.substr(5);
    auto [p, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), i);
    if (ec == std::errc() && p == rest.data() + rest.size() && i >= 0) return cuda(i);
  }
  raise("cannot parse device '{}'; use 'cpu', 'cuda' or 'cuda:N'", s);
}

int cuda_device_count() {
  static const int n = cuda_impl::device_count();  // the set of visible devices is fixed per process
  return n;
}
bool cuda_available() { return cuda_device_count() > 0; }

std::string cuda_device_name(int index) {
  check_device(Device::cuda(index));
  return cuda_impl::device_name(index);
}

int64_t cuda_device_total_memory(int index) {
  check_device(Device::cuda(index));
  return int64_t(cuda_impl::device_total_memory(index));
}

void check_device(Device d) {
  if (d.is_cpu()) return;
  int n = cuda_device_count();
  if (n == 0) {
#if MEGACORE_WITH_CUDA
    raise("device {} requested but no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES), "
          "or use the CPU",
          d.str());
#else
    raise("device {} requested but megacore was built without CUDA; rebuild with -DMEGACORE_CUDA=ON or use the CPU",
          d.str());
#endif
  }
  MC_CHECK(d.index >= 0 && d.index < n, "device {} does not exist: {} CUDA device(s) visible (cuda:0..cuda:{})", d.str(),
           n, n - 1);
}

}  // namespace megacore
