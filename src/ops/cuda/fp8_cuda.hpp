// Private interface between src/ops/fp8.cpp and its CUDA kernels (fp8.cu).
#pragma once

#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

/// ops::fp8_cast on device pointers (amax, counts may be null).
void fp8_cast(DType in_dt, const void* x, int64_t n, const float* scale, DType out_dt, void* out, float* amax,
              int64_t* counts, int device, void* stream);
/// ops::fp8_cast_transpose: x [rows, cols] row-major; out may be null, out_t [cols, rows].
void fp8_cast_transpose(DType in_dt, const void* x, int64_t rows, int64_t cols, const float* scale, DType out_dt,
                        void* out, void* out_t, float* amax, int64_t* counts, int device, void* stream);
/// ops::fp8_amax.
void fp8_amax(DType in_dt, const void* x, int64_t n, float* amax, int device, void* stream);
/// ops::fp8_dequant.
void fp8_dequant(DType q_dt, const void* q, int64_t n, const float* scale_inv, DType out_dt, void* out, int device,
                 void* stream);
/// ops::fp8_seed_scales.
void fp8_seed_scales(const float* amax, int64_t n, float* seeded, float* scale, float* scale_inv, const float* fp8_max,
                     int margin, int device, void* stream);
/// ops::fp8_update_scales: history [L, n] row-major.
void fp8_update_scales(float* history, int64_t len, int64_t n, float* scale, float* scale_inv, const float* fp8_max,
                       bool amax_max, int margin, bool roll, int device, void* stream);

}  // namespace megacore::ops::cuda
