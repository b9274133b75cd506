// Element types, and the 16-bit and 8-bit float formats as plain host/device structs.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#if defined(__CUDACC__)
#define MC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MC_HOST_DEVICE inline
#endif

namespace megacore {

/// Element type of a tensor.
/// F8E4M3 and F8E5M2 are the FP8 formats of FP8 training (see float8_e4m3 / float8_e5m2 below).
enum class DType : uint8_t { F32 = 0, BF16 = 1, F16 = 2, I32 = 3, I64 = 4, U8 = 5, F8E4M3 = 6, F8E5M2 = 7 };

inline constexpr int kNumDTypes = 8;

/// Bytes per element.
constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::BF16: case DType::F16: return 2;
    case DType::I64: return 8;
    case DType::U8: case DType::F8E4M3: case DType::F8E5M2: return 1;
  }
  return 0;
}
/// The float types arithmetic runs on (f32, bf16, f16); the FP8 formats are storage for scaled GEMM
/// operands only (is_fp8) and are not "floating" in this sense.
constexpr bool is_floating(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }
constexpr bool is_fp8(DType t) { return t == DType::F8E4M3 || t == DType::F8E5M2; }

/// Short lower-case name ("f32", "bf16", "f8e4m3", ...), as used in messages and file formats.
std::string_view dtype_name(DType t);
/// Parses a name (f32/float32, bf16/bfloat16, f16/float16/half, i32/int32, i64/int64, u8/uint8,
/// f8e4m3/float8_e4m3fn, f8e5m2/float8_e5m2); throws ValueError listing the accepted names.
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

// ---- 8-bit floats (FP8) ------------------------------------------------------------------------------
//
// E4M3 is the "fn" variant of the OCP FP8 spec (Transformer Engine's and CUDA's __nv_fp8_e4m3): bias 7,
// no infinities, 0x7f/0xff are NaN, largest finite value 448, smallest subnormal 2^-9. E5M2 is IEEE-like:
// bias 15, infinities 0x7c/0xfc, NaNs above them, largest finite 57344, smallest subnormal 2^-16.
//
// float → FP8 rounds to nearest even and SATURATES: every value whose magnitude is at least the largest
// finite value, infinities included, becomes ±max (CUDA's __NV_SATFINITE conversion, which Transformer
// Engine's casts use); NaN stays NaN (sign kept). Values below half the smallest subnormal become ±0.
// The same integer code runs on host and device, so a CPU cast and a GPU cast give the same bits.

namespace fp8_detail {
/// Rounds |f| (finite, below the format's max) to the code of an FP8 format with `man` mantissa bits and
/// exponent bias `bias`, sign not included. Normal and subnormal values share one formula: with
/// e = max(exponent of f, 1 - bias) the quantum is 2^(e - man) and the code is ((e + bias - 1) << man) + n,
/// n = |f| / quantum rounded to nearest even (n = 2^(man+1) carries into the next exponent by itself).
MC_HOST_DEVICE uint32_t round_magnitude(uint32_t ax, int man, int bias) {
  const int e32 = int(ax >> 23);
  if (e32 == 0) return 0;  // zero and f32 subnormals (< 2^-126) round to zero in both formats
  const int e = e32 - 127 < 1 - bias ? 1 - bias : e32 - 127;
  const uint32_t m24 = (ax & 0x7fffffu) | 0x800000u;
  const int shift = 23 - man + (e - (e32 - 127));
  if (shift >= 25) return 0;  // below half the smallest subnormal
  uint32_t r = m24 >> shift;
  const uint32_t rem = m24 & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return (uint32_t(e + bias - 1) << man) + r;
}
/// Decodes a finite code's magnitude (sign not included) exactly.
MC_HOST_DEVICE float decode_magnitude(uint32_t code, int man, int bias) {
  const uint32_t exp = code >> man, m = code & ((1u << man) - 1u);
  if (exp == 0) return float(m) * bits_f32(uint32_t(127 + 1 - bias - man) << 23);  // m * 2^(1-bias-man), exact
  return bits_f32(((exp - uint32_t(bias) + 127u) << 23) | (m << (23 - man)));
}
/// The value of a normal code's magnitude, (2^man + mantissa) · 2^(exponent - bias - man), at compile time.
constexpr float normal_value(uint32_t code, int man, int bias) {
  float v = float((1u << man) + (code & ((1u << man) - 1u)));
  for (int e = int(code >> man) - bias - man; e > 0; --e) v *= 2.f;
  for (int e = int(code >> man) - bias - man; e < 0; ++e) v *= 0.5f;
  return v;
}
}  // namespace fp8_detail

/// FP8 storage of a format with `ExpBits` exponent and `ManBits` mantissa bits (1 + ExpBits + ManBits = 8),
/// exponent bias `Bias` and largest finite magnitude code `MaxCode`. With `HasInf` the code after MaxCode
/// (exponent all ones, mantissa 0) is infinity and the codes above it NaN (IEEE-like); without, every
/// magnitude code above MaxCode is NaN. Encoding and decoding are the ones described above.
template <int ExpBits, int ManBits, int Bias, uint8_t MaxCode, bool HasInf>
struct float8 {
  static_assert(1 + ExpBits + ManBits == 8, "an FP8 format has 8 bits");
  static_assert(MaxCode < 0x80u, "MaxCode is a magnitude code (sign bit clear)");
  static_assert(!HasInf || MaxCode + 1 == ((1u << ExpBits) - 1u) << ManBits,
                "with infinities, MaxCode is the code just below infinity");
  static constexpr int kExponentBits = ExpBits, kMantissaBits = ManBits, kBias = Bias;
  static constexpr bool kHasInf = HasInf;
  static constexpr uint8_t kMaxCode = MaxCode;
  /// The f32 bits of the largest finite value: |f| at or above it saturates.
  static constexpr uint32_t kMaxF32Bits = uint32_t((MaxCode >> ManBits) - Bias + 127) << 23 |
                                          uint32_t(MaxCode & ((1u << ManBits) - 1u)) << (23 - ManBits);
  /// The largest finite value (448 for E4M3, 57344 for E5M2).
  static constexpr float kMax = fp8_detail::normal_value(MaxCode, ManBits, Bias);

  uint8_t bits = 0;
  float8() = default;
  MC_HOST_DEVICE explicit float8(float f) : bits(from_float(f)) {}
  MC_HOST_DEVICE operator float() const { return to_float(bits); }
  MC_HOST_DEVICE static uint8_t from_float(float f) {
    const uint32_t u = f32_bits(f), sign = (u >> 24) & 0x80u, ax = u & 0x7fffffffu;
    if (ax > 0x7f800000u) return uint8_t(sign | 0x7fu);     // NaN (sign kept)
    if (ax >= kMaxF32Bits) return uint8_t(sign | kMaxCode);  // |f| >= max (and inf): saturate
    return uint8_t(sign | fp8_detail::round_magnitude(ax, ManBits, Bias));
  }
  MC_HOST_DEVICE static float to_float(uint8_t b) {
    const uint32_t sign = uint32_t(b & 0x80u) << 24, mag = b & 0x7fu;
    if (mag > kMaxCode) return bits_f32(sign | (HasInf && mag == kMaxCode + 1u ? 0x7f800000u : 0x7fc00000u));
    return bits_f32(sign | f32_bits(fp8_detail::decode_magnitude(mag, ManBits, Bias)));
  }
};

/// FP8 E4M3 (fn): max 448, no infinity, NaN 0x7f / 0xff.
using float8_e4m3 = float8<4, 3, 7, 0x7e, false>;
/// FP8 E5M2: max 57344, ±inf 0x7c / 0xfc, NaN above.
using float8_e5m2 = float8<5, 2, 15, 0x7b, true>;
static_assert(float8_e4m3::kMax == 448.f && float8_e4m3::kMaxF32Bits == 0x43e00000u);
static_assert(float8_e5m2::kMax == 57344.f && float8_e5m2::kMaxF32Bits == 0x47600000u);

/// The largest finite value of an FP8 dtype (448 or 57344); 0 for other dtypes.
constexpr float fp8_max(DType t) {
  return t == DType::F8E4M3 ? float8_e4m3::kMax : t == DType::F8E5M2 ? float8_e5m2::kMax : 0.f;
}

/// The reduced-precision float storage types (bf16, f16, the FP8 formats): converted through f32.
template <class T>
inline constexpr bool is_narrow_float_v = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16> ||
                                          std::is_same_v<T, float8_e4m3> || std::is_same_v<T, float8_e5m2>;

/// Maps a C++ element type to its DType.
template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::F32; };
template <> struct dtype_of<bfloat16> { static constexpr DType value = DType::BF16; };
template <> struct dtype_of<float16> { static constexpr DType value = DType::F16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::I32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::I64; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = DType::U8; };
template <> struct dtype_of<float8_e4m3> { static constexpr DType value = DType::F8E4M3; };
template <> struct dtype_of<float8_e5m2> { static constexpr DType value = DType::F8E5M2; };
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
    case DType::F8E4M3: return f(float8_e4m3{});
    case DType::F8E5M2: return f(float8_e5m2{});
  }
  return f(float{});
}

}  // namespace megacore
