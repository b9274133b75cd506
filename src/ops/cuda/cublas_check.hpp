// Status check for cuBLAS and cuBLASLt calls (compiled only in CUDA builds).
#pragma once

#include <cublas_api.h>

#include "megacore/core/error.hpp"

#define MC_CUBLAS_CHECK(expr)                                                                                  \
  do {                                                                                                         \
    cublasStatus_t mc_st_ = (expr);                                                                            \
    if (mc_st_ != CUBLAS_STATUS_SUCCESS)                                                                       \
      ::megacore::raise<::megacore::CudaError>("{} failed: {} at {}:{}", #expr, cublasGetStatusString(mc_st_), \
                                               __FILE__, __LINE__);                                            \
  } while (0)
