// The DLPack ABI (dmlc/dlpack, v1.x), declared from its specification: the structs exchanged in
// `__dlpack__` capsules. Only what megacore needs.
#pragma once

#include <cstdint>

namespace megacore::dlpack {

enum DeviceType : int32_t { kCPU = 1, kCUDA = 2, kCUDAHost = 3, kCUDAManaged = 13 };
enum TypeCode : uint8_t { kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4, kBool = 6, kFloat8_e4m3fn = 10, kFloat8_e5m2 = 12 };

struct Device {
  int32_t device_type;
  int32_t device_id;
};
struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; may be null for compact row-major
  uint64_t byte_offset;
};
struct ManagedTensor {  // "dltensor" capsules (DLPack < 1.0)
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
};
struct PackVersion {
  uint32_t major;
  uint32_t minor;
};
struct ManagedTensorVersioned {  // "dltensor_versioned" capsules (DLPack >= 1.0)
  PackVersion version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned*);
  uint64_t flags;
  DLTensor dl_tensor;
};
inline constexpr uint64_t kFlagReadOnly = 1ull << 0;
inline constexpr uint32_t kMajor = 1, kMinor = 0;

}  // namespace megacore::dlpack
