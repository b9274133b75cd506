// Private interface between src/ops/moe.cpp and its CUDA kernels (moe.cu, moe_grouped_gemm.cpp).
// Arguments are checked by the callers; pointers are device pointers, streams cudaStream_t.
#pragma once

#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

/// Largest E and k the warp-per-token router kernels take (each lane holds E / 32 scores).
inline constexpr int kMoeMaxExperts = 256;
inline constexpr int kMoeMaxTopk = 8;

struct RouterArgs {
  const float* logits = nullptr;  // [t, e]
  const float* bias = nullptr;    // [e] or null
  int64_t t = 0;
  int e = 0, k = 0;
  bool sigmoid = false, pre_softmax = false;
  float scaling = 1.f;
};
void router_topk(const RouterArgs& a, float* probs, int32_t* indices, int device, void* stream);
void router_topk_backward(const RouterArgs& a, const int32_t* indices, const float* dprobs, float* dlogits, int device,
                          void* stream);
void router_apply_capacity(float* probs, int32_t* indices, int64_t slots, int k, int e, int64_t capacity, int device,
                           void* stream);
/// Aux loss: per-token terms into `work` (f32 [t]), then loss[0] = scale * their sum (fixed order).
void router_aux_loss(const float* logits, bool sigmoid, const float* tpe, int64_t t, int e, float scale, float* work,
                     float* loss, int device, void* stream);
void router_aux_loss_backward(const float* logits, bool sigmoid, const float* tpe, int64_t t, int e, float scale,
                              float* dlogits, int device, void* stream);
/// ops::router_random_logits: logits[i] = philox_normal(seed, offset, first_token * e + i), i < t * e.
void router_random_logits(float* logits, int64_t t, int e, uint64_t seed, uint64_t offset, int64_t first_token,
                          int device, void* stream);
void router_z_loss(const float* logits, int64_t t, int e, float scale, float* work, float* loss, int device,
                   void* stream);
void router_z_loss_backward(const float* logits, int64_t t, int e, float scale, float* dlogits, int device,
                            void* stream);

void moe_permute_map(const int32_t* indices, int64_t slots, int e, int32_t* row_map, int64_t* counts, int device,
                     void* stream);
/// ops::moe_sort_map: layout [chunks · e] (e = experts per block), map [chunks · pad_rows] (-1 = padding).
void moe_sort_map(const int64_t* layout, int64_t chunks, int64_t e, int64_t local_experts, int64_t pad_rows,
                  int32_t* map, int device, void* stream);
/// permuted[row_map[t, j]] = x[t], rows of `row_bytes` bytes.
void moe_permute(const void* x, const int32_t* row_map, void* permuted, int64_t t, int k, int64_t row_bytes,
                 int device, void* stream);
/// probs may be null (weight 1).
void moe_unpermute(DType dt, const void* permuted, const int32_t* row_map, const float* probs, void* y, int64_t t,
                   int k, int64_t h, int device, void* stream);
void moe_unpermute_backward(DType dt, const void* dy, const void* permuted, const int32_t* row_map, const float* probs,
                            void* dpermuted, int64_t n_rows, float* dprobs, int64_t t, int k, int64_t h, int device,
                            void* stream);
/// dev[i] = host[i] for `count` pointers, passed by value as kernel arguments (no pageable host copy,
/// so nothing waits for the stream).
void upload_pointers(const void* const* host, int64_t count, void** dev, int device, void* stream);
/// x[i] *= alpha for n elements of dtype dt.
void moe_scale(DType dt, void* x, int64_t n, float alpha, int device, void* stream);

/// One grouped-GEMM launch: C_g = alpha · op(A_g) op(B_g) + beta · C_g, row-major, per group g of
/// `groups` (m_g rows of C each; n, k shared). Returns false when cuBLAS has no grouped kernel for the
/// case (the caller then loops over ops::gemm).
struct GroupedGemm {
  DType ab = DType::BF16, c = DType::BF16;
  bool trans_a = false, trans_b = false;
  int groups = 0;
  const int64_t* m = nullptr;  // host [groups]: rows of C_g (the per-group row counts)
  const int64_t* n = nullptr;  // host [groups]
  const int64_t* k = nullptr;  // host [groups]
  const void* const* a = nullptr;  // host [groups] device pointers
  const void* const* b = nullptr;
  void* const* cptr = nullptr;
  const int64_t* lda = nullptr;  // host [groups], row-major leading dimensions
  const int64_t* ldb = nullptr;
  const int64_t* ldc = nullptr;
  float beta = 0.f;
};
bool grouped_gemm(const GroupedGemm& g, int device, void* stream);

}  // namespace megacore::ops::cuda
