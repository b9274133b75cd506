// Fast device math shared by the op kernels (flash attention, cross-entropy). Included only by .cu files.
#pragma once

namespace megacore::ops::cuda {

// 2^x in one MUFU instruction. Results below 2^-126 flush to zero (exp2f's denormal fix-up costs three
// more instructions a call); every caller uses it where such a term is negligible next to the
// row's largest, which is 1.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace megacore::ops::cuda
