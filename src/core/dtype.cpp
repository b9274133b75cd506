#include "megacore/core/dtype.hpp"

#include "megacore/core/error.hpp"

namespace megacore {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
    case DType::F8E4M3: return "f8e4m3";
    case DType::F8E5M2: return "f8e5m2";
  }
  return "?";
}

DType dtype_from_name(std::string_view n) {
  if (n == "f32" || n == "float32" || n == "float") return DType::F32;
  if (n == "bf16" || n == "bfloat16") return DType::BF16;
  if (n == "f16" || n == "float16" || n == "half") return DType::F16;
  if (n == "i32" || n == "int32") return DType::I32;
  if (n == "i64" || n == "int64") return DType::I64;
  if (n == "u8" || n == "uint8") return DType::U8;
  if (n == "f8e4m3" || n == "float8_e4m3fn" || n == "e4m3") return DType::F8E4M3;
  if (n == "f8e5m2" || n == "float8_e5m2" || n == "e5m2") return DType::F8E5M2;
  raise("unknown dtype '{}'; use one of f32, bf16, f16, i32, i64, u8, f8e4m3, f8e5m2", n);
}

}  // namespace megacore
