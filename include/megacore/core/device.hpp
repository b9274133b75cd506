// Where a tensor lives: the host or one CUDA device.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace megacore {

enum class DeviceType : uint8_t { CPU = 0, CUDA = 1 };

/// A device: CPU, or CUDA with an ordinal.
struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static constexpr Device cpu() { return {DeviceType::CPU, 0}; }
  static constexpr Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  constexpr bool is_cpu() const { return type == DeviceType::CPU; }
  constexpr bool is_cuda() const { return type == DeviceType::CUDA; }
  constexpr bool operator==(const Device&) const = default;
  /// "cpu" or "cuda:N".
  std::string str() const;
  /// Parses "cpu", "cuda", "cuda:N"; throws ValueError otherwise.
  static Device parse(std::string_view s);
};

/// True when this build has CUDA and a device is visible.
bool cuda_available();
/// Number of visible CUDA devices (0 without CUDA, driver or devices).
int cuda_device_count();
/// Name of a CUDA device ("NVIDIA H100 80GB HBM3"); throws ValueError if out of range.
std::string cuda_device_name(int index);
/// Checks that d can be used (the CUDA ordinal exists); throws ValueError naming the fix otherwise.
void check_device(Device d);

}  // namespace megacore
