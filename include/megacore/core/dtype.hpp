// Element types, and the 16-bit float formats as plain host/device structs.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#if defined(__CUDACC__)
#define MC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MC_HOST_DEVICE inline
#endif

namespace megacore {

/// Element type of a tensor.
enum class DType : uint8_t { F32 = 0, BF16 = 1, F16 = 2, I32 = 3, I64 = 4, U8 = 5 };

inline constexpr int kNumDTypes = 6;

/// Bytes per element.
constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::BF16: case DType::F16: return 2;
    case DType::I64: return 8;
    case DType::U8: return 1;
  }
  return 0;
}
constexpr bool is_floating(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

/// Short lower-case name ("f32", "bf16", ...), as used in messages and file formats.
std::string_view dtype_name(DType t);
/// Parses a name (f32/float32, bf16/bfloat16, f16/float16/half, i32/int32, i64/int64, u8/uint8);
/// throws ValueError listing the accepted names.
DType dtype_from_name(std::string_view name);

// ---- 16-bit floats: conversions round to nearest even, identical on host and device ------------

MC_HOST_DEVICE uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
MC_HOST_DEVICE float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/// bfloat16 storage (upper half of an IEEE f32).
struct bfloat16 {
  uint16_t bits = 0;
  bfloat16() = default;
  MC_HOST_DEVICE explicit bfloat16(float f) : bits(from_float(f)) {}
  MC_HOST_DEVICE operator float() const { return bits_f32(uint32_t(bits) << 16); }
  MC_HOST_DEVICE static uint16_t from_float(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN (quiet)
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
};

/// IEEE binary16 storage.
struct float16 {
  uint16_t bits = 0;
  float16() = default;
  MC_HOST_DEVICE explicit float16(float f) : bits(from_float(f)) {}
  MC_HOST_DEVICE operator float() const { return to_float(bits); }
  MC_HOST_DEVICE static uint16_t from_float(float f) {
    uint32_t x = f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
    if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (ax < 0x38800000u) {                                    // below the smallest normal half
      if (ax < 0x33000000u) return uint16_t(sign);             // rounds to zero (<= 2^-25)
      uint32_t e = ax >> 23;
      uint32_t m = (ax & 0x7fffffu) | 0x800000u;
      uint32_t shift = 126u - e;  // places m so that the lsb is 2^-24
      uint32_t r = m >> shift;
      uint32_t rem = m & ((1u << shift) - 1u);
      uint32_t half = 1u << (shift - 1u);
      if (rem > half || (rem == half && (r & 1u))) ++r;
      return uint16_t(sign | r);
    }
    uint32_t r = ax - 0x38000000u;  // rebias exponent 127 -> 15 (in f32 bit positions)
    r += 0xfffu + ((r >> 13) & 1u);
    return uint16_t(sign | (r >> 13));
  }
  MC_HOST_DEVICE static float to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
      if (m == 0) return bits_f32(sign);
      float v = float(m) * (1.0f / 16777216.0f);  // m * 2^-24, exact
      return sign ? -v : v;
    }
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
  }
};

/// Maps a C++ element type to its DType.
template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::F32; };
template <> struct dtype_of<bfloat16> { static constexpr DType value = DType::BF16; };
template <> struct dtype_of<float16> { static constexpr DType value = DType::F16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::I32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::I64; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = DType::U8; };
template <class T> inline constexpr DType dtype_of_v = dtype_of<T>::value;

/// Calls f(T{}) with T the C++ type of dt.
template <class F>
decltype(auto) dispatch_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: return f(float{});
    case DType::BF16: return f(bfloat16{});
    case DType::F16: return f(float16{});
    case DType::I32: return f(int32_t{});
    case DType::I64: return f(int64_t{});
    case DType::U8: return f(uint8_t{});
  }
  return f(float{});
}

}  // namespace megacore
