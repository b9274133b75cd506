// Device pieces both flash-attention kernels use (flash_attention.cu, mma.sync; flash_attention_sm90.cu,
// wgmma): shared-memory addresses, cp.async, exp2, and where a (batch, head, row) lives in the
// AttnProblem views. Included inside each file's own anonymous namespace.
#pragma once

#include <cmath>
#include <cstdint>

#include "ops/cuda/attention_cuda.hpp"
#include "ops/cuda/fast_math.cuh"

namespace megacore::ops::cuda::flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The "memory" clobbers keep the compiler from moving ordinary shared-memory accesses across the copy
// and its waits (the sm90 kernel hands tiles over through mbarriers, not only __syncthreads).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;  // 0 source bytes: the 16 destination bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// dst[0..1] += (a, b) in global memory, no return value (8-byte aligned).
__device__ __forceinline__ void red_add2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

struct SeqInfo {
  int q0, nq, k0, nk;  // first row and length of this sequence in q and in k
};
__device__ __forceinline__ SeqInfo seq_info(const AttnProblem& p, int b) {
  if (p.cu_q) {
    const int q0 = p.cu_q[b], k0 = p.cu_kv[b];
    return {q0, p.cu_q[b + 1] - q0, k0, p.cu_kv[b + 1] - k0};
  }
  return {0, p.seqlen_q, 0, p.seqlen_kv};
}
template <class T>
__device__ __forceinline__ T* head_ptr(const AttnTensor& t, int b, int row0, int h) {
  return static_cast<T*>(t.ptr) + int64_t(b) * t.batch_stride + int64_t(row0) * t.row_stride +
         int64_t(h) * t.head_stride;
}
__device__ __forceinline__ int64_t lse_offset(const AttnProblem& p, int b, int h, int row0) {
  return int64_t(b) * p.lse_batch_stride + int64_t(h) * p.lse_head_stride + row0;
}

// First query row of the kM-row block this CTA owns (blockIdx.x along the queries). Causal rows further
// down see more keys, so causal grids launch those blocks first and the tail is short.
__device__ __forceinline__ int query_block_row0(const AttnProblem& p, int kM) {
  const int m_block = p.causal ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  return m_block * kM;
}
// kN-key tiles the query rows m0 .. m0 + kM - 1 see (causal: keys up to the block's last row).
__device__ __forceinline__ int key_blocks_for(const AttnProblem& p, const SeqInfo& si, int m0, int kM, int kN) {
  const int n_end = p.causal ? min(si.nk, m0 + kM) : si.nk;
  return (n_end + kN - 1) / kN;
}

// The query tiles a backward block with keys n0.. of kv head hk walks: every query head of its GQA group
// (p.heads / p.kv_heads of them), each from tile m_begin (causal: earlier tiles see none of these keys)
// to the last, kM rows a tile; step `it` is query head head(it), rows row0(it) ...
struct QueryWalk {
  int hk, group, kM, m_begin, per_head, total;
  __device__ __forceinline__ int head(int it) const { return hk * group + it / per_head; }
  __device__ __forceinline__ int row0(int it) const { return (m_begin + it % per_head) * kM; }
};
__device__ __forceinline__ QueryWalk query_walk(const AttnProblem& p, const SeqInfo& si, int hk, int n0, int kM) {
  QueryWalk w;
  w.hk = hk;
  w.group = p.heads / p.kv_heads;
  w.kM = kM;
  w.m_begin = p.causal ? n0 / kM : 0;
  const int m_blocks = (si.nq + kM - 1) / kM;
  w.per_head = m_blocks - w.m_begin > 0 ? m_blocks - w.m_begin : 0;
  w.total = w.group * w.per_head;
  return w;
}

// The backward's per-row statistics of query tile m0 (rows m0 .. m0 + kM - 1 of head hq) into buffer slots
// sL[tid] (lse * log2 e) and sD[tid] (rowsum(dO * O)), by the first kM threads. Rows past the sequence, and
// rows that saw no key (lse -inf), get lse +inf: P = 0 for them.
template <int kM>
__device__ __forceinline__ void stage_row_stats(const AttnProblem& p, const float* dsum, const SeqInfo& si, int b,
                                                int hq, int m0, int tid, float* sL, float* sD) {
  if (tid < kM) {
    const int row = m0 + tid;
    const int64_t off = lse_offset(p, b, hq, si.q0);
    const float l = row < si.nq ? p.lse[off + row] : INFINITY;
    sL[tid] = l == -INFINITY ? INFINITY : l * kLog2e;
    sD[tid] = row < si.nq ? dsum[off + row] : 0.f;
  }
}

// The forward's epilogue: this thread's two query rows (row_base and row_base + 8) of O = acc / l and, by the
// quad's first thread, their LSE (natural log; -inf for a row that saw no key). l_run is summed over the
// quad first; m_run is the running max in log2 units. o(dn, e) is element e of column block dn of the
// accumulator in the m16n8 C-fragment layout (column 8 dn + 2 t + e % 2, row row_base + 8 (e / 2)).
template <class T, int D, class Pack, class O>
__device__ __forceinline__ void store_out_rows(const AttnProblem& p, const SeqInfo& si, int b, int h, int row_base,
                                               int t, float (&l_run)[2], const float (&m_run)[2], O&& o) {
  T* out = head_ptr<T>(p.o, b, si.q0, h);
  float* lse = p.lse + lse_offset(p, b, h, si.q0);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(kFull, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(kFull, l_run[i], 2);
    const int row = row_base + i * 8;
    if (row < si.nq) {
      const float inv = l_run[i] > 0.f ? 1.f / l_run[i] : 0.f;
      T* orow = out + int64_t(row) * p.o.row_stride;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn)
        *reinterpret_cast<uint32_t*>(orow + dn * 8 + 2 * t) = Pack::pack(o(dn, 2 * i) * inv, o(dn, 2 * i + 1) * inv);
      if (t == 0) lse[row] = l_run[i] > 0.f ? m_run[i] / kLog2e + logf(l_run[i]) : -INFINITY;
    }
  }
}

// Writes this thread's two key rows (key_base and key_base + 8) of dK (times the softmax scale) and dV
// from accumulators in the m16n8 C-fragment layout both kernels' dK/dV use: dk(dn, e) / dv(dn, e) is
// element e of column block dn (column 8 dn + 2 t + e % 2, row key_base + 8 (e / 2)). Pack is a type
// with static uint32_t pack(float lo, float hi) giving two T values.
template <class T, int D, class Pack, class DK, class DV>
__device__ __forceinline__ void store_dkdv_rows(const AttnProblem& p, const SeqInfo& si, int b, int hk, int key_base,
                                                int t, DK&& dk, DV&& dv) {
  T* dkp = head_ptr<T>(p.dk, b, si.k0, hk);
  T* dvp = head_ptr<T>(p.dv, b, si.k0, hk);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = key_base + i * 8;
    if (row >= si.nk) continue;
    T* krow = dkp + int64_t(row) * p.dk.row_stride;
    T* vrow = dvp + int64_t(row) * p.dv.row_stride;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      *reinterpret_cast<uint32_t*>(krow + dn * 8 + 2 * t) = Pack::pack(dk(dn, 2 * i) * p.scale, dk(dn, 2 * i + 1) * p.scale);
      *reinterpret_cast<uint32_t*>(vrow + dn * 8 + 2 * t) = Pack::pack(dv(dn, 2 * i), dv(dn, 2 * i + 1));
    }
  }
}

}  // namespace megacore::ops::cuda::flash
