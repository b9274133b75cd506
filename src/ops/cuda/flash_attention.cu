// megacore's own flash-attention kernels (FlashAttention-2 style) on mma.sync tensor-core tiles.
// (On sm_90 the forward and the atomic-dQ backward's main kernel go to the wgmma kernels in
// flash_attention_sm90.cu unless the sm80 kernels are asked for; the deterministic backward and the
// passes around the atomic one are this file's on every architecture.)
//
// Forward: a block owns 64 query rows of one (batch, head); each of its 4 warps owns 16 rows and
// streams 64-key tiles of K and V (double-buffered cp.async into XOR-swizzled shared memory),
// keeping S, the running max/sum and O in registers; P is fed back to the tensor cores straight
// from the S accumulators (their layout equals the A-operand layout of m16n8k16).
//
// Backward is split into two kernels so that no gradient is accumulated with atomics and results
// are bit-identical from run to run:
//   dK/dV: a block owns 64 keys of one kv head; it walks the query tiles of every query head of
//          its GQA group and computes S^T = K Q^T directly, so P^T and dS^T are A operands in
//          registers for dV += P^T dO and dK += dS^T Q.
//   dQ:    a block owns 64 query rows and walks the key tiles: dQ += dS K.
// That recomputes S and dP once more than FlashAttention-2's single kernel (7 instead of 5 matrix
// products per tile pair) in exchange for determinism without a reduction buffer. It runs when
// AttnProblem::deterministic is set; otherwise flash_bwd_fused_kernel (FlashAttention-2's single
// kernel: dK/dV as above plus dQ += dS K added into an f32 buffer with atomics) runs, see there.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <string>

#include <fmt/format.h>

#include "core/cuda/cuda_check.hpp"
#include "ops/cuda/attention_cuda.hpp"
#include "ops/cuda/flash_common.cuh"

namespace megacore::ops::cuda {
namespace {

using namespace flash;

constexpr int kThreads = 128;

// ---- primitives (the shared ones are in flash_common.cuh) ------------------------------------------

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}


template <class T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t u) {
    __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&u);
    return __bfloat1622float2(v);
  }
};
template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t u) {
    __half2 v = *reinterpret_cast<__half2*>(&u);
    return __half22float2(v);
  }
};

// Rows of D 16-bit elements; 16-byte chunk c of row r is stored at chunk c ^ (r % 8), so the 8 rows
// one ldmatrix phase reads (same chunk, consecutive rows) fall into 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
  return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// ROWS x D tile from global rows (row_stride elements apart) into swizzled shared memory by a block of
// NT threads; rows at or beyond valid_rows are zero-filled.
template <class T, int ROWS, int D, int NT = kThreads>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t row_stride, int valid_rows, int tid) {
  constexpr int kChunks = D / 8;
  static_assert((ROWS * kChunks) % NT == 0, "tile must split evenly over the block");
#pragma unroll
  for (int i = 0; i < ROWS * kChunks / NT; ++i) {
    const int c = i * NT + tid;
    const int r = c / kChunks, ch = c % kChunks;
    const bool ok = r < valid_rows;
    const T* src = ok ? g + int64_t(r) * row_stride + ch * 8 : g;
    cp_async16(smem_u32(s + swz<D>(r, ch * 8)), src, ok);
  }
}

// A operand (16 rows x 16 cols at row0, col0) of a swizzled row-major tile.
template <int D, class T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* s, int row0, int col0, int lane) {
  ldsm_x4(a, smem_u32(s + swz<D>(row0 + (lane & 15), col0 + ((lane >> 4) << 3))));
}
// B operands of two n-tiles (rows n0..n0+15 of the tile are the n index, cols k0..k0+15 the k index):
// b[0], b[1] for n-tile n0 and b[2], b[3] for n0 + 8. For S = Q K^T with K stored [key][d].
template <int D, class T>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* s, int n0, int k0, int lane) {
  ldsm_x4(b, smem_u32(s + swz<D>(n0 + (lane & 7) + ((lane >> 4) << 3), k0 + (((lane >> 3) & 1) << 3))));
}
// B operands when the tile is stored [k][n] (e.g. V [key][d] in O += P V): transposed ldmatrix.
template <int D, class T>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* s, int k0, int n0, int lane) {
  ldsm_x4_t(b, smem_u32(s + swz<D>(k0 + (lane & 7) + (((lane >> 3) & 1) << 3), n0 + ((lane >> 4) << 3))));
}


// ---- forward -------------------------------------------------------------------------------------
template <class T, int D>
__global__ void __launch_bounds__(kThreads) flash_fwd_kernel(const AttnProblem p) {
  using Op = Mma<T>;
  constexpr int kM = 64, kN = 64;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kM * D;      // two buffers
  T* sV = sK + 2 * kN * D;  // two buffers
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int b = blockIdx.z, h = blockIdx.y;
  const int m0 = query_block_row0(p, kM);
  const SeqInfo si = seq_info(p, b);
  if (m0 >= si.nq) return;
  const int hk = h / (p.heads / p.kv_heads);
  const T* q = head_ptr<const T>(p.q, b, si.q0, h);
  const T* k = head_ptr<const T>(p.k, b, si.k0, hk);
  const T* v = head_ptr<const T>(p.v, b, si.k0, hk);
  const int n_blocks = key_blocks_for(p, si, m0, kM, kN);

  load_tile<T, kM, D>(sQ, q + int64_t(m0) * p.q.row_stride, p.q.row_stride, si.nq - m0, tid);
  if (n_blocks > 0) {
    load_tile<T, kN, D>(sK, k, p.k.row_stride, si.nk, tid);
    load_tile<T, kN, D>(sV, v, p.v.row_stride, si.nk, tid);
  }
  cp_async_commit();

  uint32_t qf[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const float sl2 = p.scale * kLog2e;
  const int row_base = m0 + warp * 16 + g;

  for (int nb = 0; nb < n_blocks; ++nb) {
    cp_async_wait_all();
    __syncthreads();
    if (nb == 0) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) load_a<D>(qf[ks], sQ, warp * 16, ks * 16, lane);
    }
    if (nb + 1 < n_blocks) {
      const int n1 = (nb + 1) * kN, buf = (nb + 1) & 1;
      load_tile<T, kN, D>(sK + buf * kN * D, k + int64_t(n1) * p.k.row_stride, p.k.row_stride, si.nk - n1, tid);
      load_tile<T, kN, D>(sV + buf * kN * D, v + int64_t(n1) * p.v.row_stride, p.v.row_stride, si.nk - n1, tid);
    }
    cp_async_commit();
    const T* cK = sK + (nb & 1) * kN * D;
    const T* cV = sV + (nb & 1) * kN * D;

    float s[kN / 8][4];
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < kN / 16; ++np) {
        uint32_t bb[4];
        load_b_nk<D>(bb, cK, np * 16, ks * 16, lane);
        Op::run(s[2 * np], qf[ks], bb[0], bb[1]);
        Op::run(s[2 * np + 1], qf[ks], bb[2], bb[3]);
      }
    }
    const int n0 = nb * kN;
    const bool need_mask = n0 + kN > si.nk || (p.causal && n0 + kN - 1 > m0 + warp * 16);
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[j][e] * sl2;
        if (need_mask) {
          const int key = n0 + j * 8 + 2 * t + (e & 1), row = row_base + (e >> 1) * 8;
          if (key >= si.nk || (p.causal && key > row)) x = -INFINITY;
        }
        s[j][e] = x;
      }
    }
    float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
    }
    float base[2], corr[2], rs[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 2));
      base[i] = mx[i] == -INFINITY ? 0.f : mx[i];  // a row with nothing seen yet: avoid inf - inf
      corr[i] = fast_exp2(m_run[i] - base[i]);
      m_run[i] = mx[i];
    }
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      s[j][0] = fast_exp2(s[j][0] - base[0]);
      s[j][1] = fast_exp2(s[j][1] - base[0]);
      s[j][2] = fast_exp2(s[j][2] - base[1]);
      s[j][3] = fast_exp2(s[j][3] - base[1]);
      rs[0] += s[j][0] + s[j][1];
      rs[1] += s[j][2] + s[j][3];
    }
    l_run[0] = l_run[0] * corr[0] + rs[0];
    l_run[1] = l_run[1] * corr[1] + rs[1];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= corr[0];
      o[i][1] *= corr[0];
      o[i][2] *= corr[1];
      o[i][3] *= corr[1];
    }
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      const uint32_t a[4] = {Op::pack(s[2 * kk][0], s[2 * kk][1]), Op::pack(s[2 * kk][2], s[2 * kk][3]),
                             Op::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             Op::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bb[4];
        load_b_kn<D>(bb, cV, kk * 16, dp * 16, lane);
        Op::run(o[2 * dp], a, bb[0], bb[1]);
        Op::run(o[2 * dp + 1], a, bb[2], bb[3]);
      }
    }
  }

  cp_async_wait_all();  // nothing may be in flight at exit (only happens when there were no keys)
  store_out_rows<T, D, Op>(p, si, b, h, row_base, t, l_run, m_run, [&](int dn, int e) { return o[dn][e]; });
}

// ---- backward: D = rowsum(dO * O) ------------------------------------------------------------------
template <class T, int D>
__global__ void __launch_bounds__(kThreads) flash_bwd_dot_kernel(const AttnProblem p, float* dsum) {
  using Op = Mma<T>;
  constexpr int kM = 64;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, b = blockIdx.z, h = blockIdx.y;
  const SeqInfo si = seq_info(p, b);
  const int m0 = blockIdx.x * kM;
  if (m0 >= si.nq) return;
  const T* o = head_ptr<const T>(p.o, b, si.q0, h);
  const T* dout = head_ptr<const T>(p.dout, b, si.q0, h);
  float* ds = dsum + lse_offset(p, b, h, si.q0);
  for (int r = warp; r < kM; r += kThreads / 32) {
    const int row = m0 + r;
    if (row >= si.nq) break;
    float acc = 0.f;
#pragma unroll
    for (int c = lane * 2; c < D; c += 64) {
      const float2 x = Op::unpack(*reinterpret_cast<const uint32_t*>(o + int64_t(row) * p.o.row_stride + c));
      const float2 y = Op::unpack(*reinterpret_cast<const uint32_t*>(dout + int64_t(row) * p.dout.row_stride + c));
      acc += x.x * y.x + x.y * y.y;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(kFull, acc, off);
    if (lane == 0) ds[row] = acc;
  }
}

// ---- backward pieces shared by the dK/dV kernel and the atomic-dQ kernel ----------------------------
// Both walk kM-row query tiles (of every query head of the kv head's GQA group) against one block of
// keys; each warp owns 16 keys.

// Loads query tile `it` into buffer `buf`: Q and dO rows by cp.async, lse (times log2 e) and
// rowsum(dO * O) by the first kM threads.
template <class T, int D, int kM, int NT>
__device__ __forceinline__ void bwd_issue_q_tile(const AttnProblem& p, const float* dsum, const SeqInfo& si, int b,
                                                 const QueryWalk& w, int it, int buf, T* sQ, T* sdO, float* sL,
                                                 float* sD, int tid) {
  const int hq = w.head(it);
  const int m0 = w.row0(it);
  const T* q = head_ptr<const T>(p.q, b, si.q0, hq);
  const T* dO = head_ptr<const T>(p.dout, b, si.q0, hq);
  load_tile<T, kM, D, NT>(sQ + buf * kM * D, q + int64_t(m0) * p.q.row_stride, p.q.row_stride, si.nq - m0, tid);
  load_tile<T, kM, D, NT>(sdO + buf * kM * D, dO + int64_t(m0) * p.dout.row_stride, p.dout.row_stride, si.nq - m0,
                          tid);
  stage_row_stats<kM>(p, dsum, si, b, hq, m0, tid, sL + buf * kM, sD + buf * kM);
}

// S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys against the kM queries of the tile. (The dQ
// kernel calls it with the roles exchanged: S = Q K^T and dP = dO V^T for 16 query rows.)
template <class T, int D, int kM>
__device__ __forceinline__ void bwd_st_dpt(float (&st)[kM / 8][4], float (&dpt)[kM / 8][4], const T* sK,
                                           const T* sV, const T* cQ, const T* cdO, int warp, int lane) {
  using Op = Mma<T>;
#pragma unroll
  for (int j = 0; j < kM / 8; ++j) {
    st[j][0] = st[j][1] = st[j][2] = st[j][3] = 0.f;
    dpt[j][0] = dpt[j][1] = dpt[j][2] = dpt[j][3] = 0.f;
  }
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t ak[4], av[4];
    load_a<D>(ak, sK, warp * 16, ks * 16, lane);
    load_a<D>(av, sV, warp * 16, ks * 16, lane);
#pragma unroll
    for (int np = 0; np < kM / 16; ++np) {
      uint32_t bq[4], bo[4];
      load_b_nk<D>(bq, cQ, np * 16, ks * 16, lane);
      load_b_nk<D>(bo, cdO, np * 16, ks * 16, lane);
      Op::run(st[2 * np], ak, bq[0], bq[1]);
      Op::run(st[2 * np + 1], ak, bq[2], bq[3]);
      Op::run(dpt[2 * np], av, bo[0], bo[1]);
      Op::run(dpt[2 * np + 1], av, bo[2], bo[3]);
    }
  }
}

// dV += P^T dO and dK += dS^T Q with P^T (st) and dS^T (dpt) packed as A operands. `with_ds(kk, as)`
// sees the packed dS^T operand of each 16-query step before it is used (the atomic-dQ kernel may store
// it to shared memory there).
template <class T, int D, int kM, class WithDs>
__device__ __forceinline__ void bwd_accumulate_dkdv(float (&dk)[D / 8][4], float (&dv)[D / 8][4],
                                                    const float (&st)[kM / 8][4], const float (&dpt)[kM / 8][4],
                                                    const T* cQ, const T* cdO, int lane, WithDs&& with_ds) {
  using Op = Mma<T>;
#pragma unroll
  for (int kk = 0; kk < kM / 16; ++kk) {
    const uint32_t ap[4] = {Op::pack(st[2 * kk][0], st[2 * kk][1]), Op::pack(st[2 * kk][2], st[2 * kk][3]),
                            Op::pack(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                            Op::pack(st[2 * kk + 1][2], st[2 * kk + 1][3])};
    const uint32_t as[4] = {Op::pack(dpt[2 * kk][0], dpt[2 * kk][1]), Op::pack(dpt[2 * kk][2], dpt[2 * kk][3]),
                            Op::pack(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                            Op::pack(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
    with_ds(kk, as);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t bo[4], bq[4];
      load_b_kn<D>(bo, cdO, kk * 16, dp * 16, lane);
      load_b_kn<D>(bq, cQ, kk * 16, dp * 16, lane);
      Op::run(dv[2 * dp], ap, bo[0], bo[1]);
      Op::run(dv[2 * dp + 1], ap, bo[2], bo[3]);
      Op::run(dk[2 * dp], as, bq[0], bq[1]);
      Op::run(dk[2 * dp + 1], as, bq[2], bq[3]);
    }
  }
}

// Where a block of keys stands: its sequence, batch row, kv head and first key, and its walk over the query
// tiles that see those keys.
struct KeyBlock {
  SeqInfo si;
  int b, hk, n0;
  QueryWalk walk;
};

// The prologue of both kernels: the block's kN keys (blockIdx.x) of kv head blockIdx.y in batch row
// blockIdx.z, their K and V tiles loaded into shared memory, and the first query tile issued into buffer 0
// (one cp.async group committed). False, with nothing loaded, for a block past the sequence's keys.
template <class T, int D, int kN, int kM, int NT>
__device__ __forceinline__ bool bwd_begin_key_block(const AttnProblem& p, const float* dsum, T* sK, T* sV, T* sQ,
                                                    T* sdO, float* sL, float* sD, int tid, KeyBlock& kb) {
  kb.b = blockIdx.z;
  kb.hk = blockIdx.y;
  kb.si = seq_info(p, kb.b);
  kb.n0 = blockIdx.x * kN;
  if (kb.n0 >= kb.si.nk) return false;
  const T* k = head_ptr<const T>(p.k, kb.b, kb.si.k0, kb.hk);
  const T* v = head_ptr<const T>(p.v, kb.b, kb.si.k0, kb.hk);
  load_tile<T, kN, D, NT>(sK, k + int64_t(kb.n0) * p.k.row_stride, p.k.row_stride, kb.si.nk - kb.n0, tid);
  load_tile<T, kN, D, NT>(sV, v + int64_t(kb.n0) * p.v.row_stride, p.v.row_stride, kb.si.nk - kb.n0, tid);
  kb.walk = query_walk(p, kb.si, kb.hk, kb.n0, kM);
  if (kb.walk.total > 0) bwd_issue_q_tile<T, D, kM, NT>(p, dsum, kb.si, kb.b, kb.walk, 0, 0, sQ, sdO, sL, sD, tid);
  cp_async_commit();
  return true;
}

template <int D>
__device__ __forceinline__ void bwd_zero_dkdv(float (&dk)[D / 8][4], float (&dv)[D / 8][4]) {
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
    dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
  }
}

// Writes this thread's rows of dK (times the softmax scale) and dV.
template <class T, int D>
__device__ __forceinline__ void bwd_store_dkdv(const AttnProblem& p, const SeqInfo& si, int b, int hk, int key_base,
                                               int t, const float (&dk)[D / 8][4], const float (&dv)[D / 8][4]) {
  store_dkdv_rows<T, D, Mma<T>>(p, si, b, hk, key_base, t, [&](int dn, int e) { return dk[dn][e]; },
                                [&](int dn, int e) { return dv[dn][e]; });
}

// ---- backward: dK, dV ----------------------------------------------------------------------------
template <int D>
struct KvCfg {
  static constexpr int kN = 64;                  // keys per block (16 per warp)
  static constexpr int kM = D == 128 ? 32 : 64;  // queries per step (bounds the S^T/dP^T registers)
  static constexpr int smem_bytes(int elem) { return (2 * kN * D + 4 * kM * D) * elem + 4 * kM * 4; }
};

template <class T, int D>
__global__ void __launch_bounds__(kThreads) flash_bwd_dkdv_kernel(const AttnProblem p, const float* dsum) {
  using Op = Mma<T>;
  constexpr int kN = KvCfg<D>::kN, kM = KvCfg<D>::kM;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + kN * D;
  T* sQ = sV + kN * D;       // two buffers
  T* sdO = sQ + 2 * kM * D;  // two buffers
  float* sL = reinterpret_cast<float*>(sdO + 2 * kM * D);  // two buffers: lse * log2(e)
  float* sD = sL + 2 * kM;                                  // two buffers: rowsum(dO * O)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  KeyBlock kb;
  if (!bwd_begin_key_block<T, D, kN, kM, kThreads>(p, dsum, sK, sV, sQ, sdO, sL, sD, tid, kb)) return;
  const SeqInfo& si = kb.si;
  const int b = kb.b, hk = kb.hk, n0 = kb.n0, total = kb.walk.total;
  const QueryWalk& walk = kb.walk;

  float dk[D / 8][4], dv[D / 8][4];
  bwd_zero_dkdv<D>(dk, dv);
  const float sl2 = p.scale * kLog2e;
  const int key_base = n0 + warp * 16 + g;

  for (int it = 0; it < total; ++it) {
    cp_async_wait_all();
    __syncthreads();
    if (it + 1 < total)
      bwd_issue_q_tile<T, D, kM, kThreads>(p, dsum, si, b, walk, it + 1, (it + 1) & 1, sQ, sdO, sL, sD, tid);
    cp_async_commit();
    const int buf = it & 1;
    const int m0 = walk.row0(it);
    const T* cQ = sQ + buf * kM * D;
    const T* cdO = sdO + buf * kM * D;
    const float* cL = sL + buf * kM;
    const float* cD = sD + buf * kM;

    float st[kM / 8][4], dpt[kM / 8][4];
    bwd_st_dpt<T, D, kM>(st, dpt, sK, sV, cQ, cdO, warp, lane);
    const bool need_mask = p.causal && m0 < n0 + warp * 16 + 15;
#pragma unroll
    for (int j = 0; j < kM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = j * 8 + 2 * t + (e & 1);
        float pv = fast_exp2(st[j][e] * sl2 - cL[qc]);
        if (need_mask && m0 + qc < key_base + (e >> 1) * 8) pv = 0.f;
        st[j][e] = pv;
        dpt[j][e] = pv * (dpt[j][e] - cD[qc]);  // dS^T
      }
    }
    bwd_accumulate_dkdv<T, D, kM>(dk, dv, st, dpt, cQ, cdO, lane, [](int, const uint32_t(&)[4]) {});
  }

  cp_async_wait_all();
  bwd_store_dkdv<T, D>(p, si, b, hk, key_base, t, dk, dv);
}

// ---- backward: dQ --------------------------------------------------------------------------------
template <class T, int D>
__global__ void __launch_bounds__(kThreads) flash_bwd_dq_kernel(const AttnProblem p, const float* dsum) {
  using Op = Mma<T>;
  constexpr int kM = 64, kN = 64;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sdO = sQ + kM * D;
  T* sK = sdO + kM * D;     // two buffers
  T* sV = sK + 2 * kN * D;  // two buffers
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int b = blockIdx.z, h = blockIdx.y;
  const int m0 = query_block_row0(p, kM);
  const SeqInfo si = seq_info(p, b);
  if (m0 >= si.nq) return;
  const int hk = h / (p.heads / p.kv_heads);
  const T* q = head_ptr<const T>(p.q, b, si.q0, h);
  const T* dO = head_ptr<const T>(p.dout, b, si.q0, h);
  const T* k = head_ptr<const T>(p.k, b, si.k0, hk);
  const T* v = head_ptr<const T>(p.v, b, si.k0, hk);
  const int n_blocks = key_blocks_for(p, si, m0, kM, kN);

  load_tile<T, kM, D>(sQ, q + int64_t(m0) * p.q.row_stride, p.q.row_stride, si.nq - m0, tid);
  load_tile<T, kM, D>(sdO, dO + int64_t(m0) * p.dout.row_stride, p.dout.row_stride, si.nq - m0, tid);
  if (n_blocks > 0) {
    load_tile<T, kN, D>(sK, k, p.k.row_stride, si.nk, tid);
    load_tile<T, kN, D>(sV, v, p.v.row_stride, si.nk, tid);
  }
  cp_async_commit();

  const int row_base = m0 + warp * 16 + g;
  float lrow[2], drow[2];
  const int64_t off = lse_offset(p, b, h, si.q0);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row_base + i * 8;
    const float l = row < si.nq ? p.lse[off + row] : INFINITY;
    lrow[i] = l == -INFINITY ? INFINITY : l * kLog2e;
    drow[i] = row < si.nq ? dsum[off + row] : 0.f;
  }
  float dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
  const float sl2 = p.scale * kLog2e;

  for (int nb = 0; nb < n_blocks; ++nb) {
    cp_async_wait_all();
    __syncthreads();
    if (nb + 1 < n_blocks) {
      const int n1 = (nb + 1) * kN, buf = (nb + 1) & 1;
      load_tile<T, kN, D>(sK + buf * kN * D, k + int64_t(n1) * p.k.row_stride, p.k.row_stride, si.nk - n1, tid);
      load_tile<T, kN, D>(sV + buf * kN * D, v + int64_t(n1) * p.v.row_stride, p.v.row_stride, si.nk - n1, tid);
    }
    cp_async_commit();
    const T* cK = sK + (nb & 1) * kN * D;
    const T* cV = sV + (nb & 1) * kN * D;

    // S = Q K^T and dP = dO V^T for this warp's 16 query rows: the dK/dV kernels' two products with the
    // roles of (K, V) and (Q, dO) exchanged.
    float s[kN / 8][4], dp[kN / 8][4];
    bwd_st_dpt<T, D, kN>(s, dp, sQ, sdO, cK, cV, warp, lane);
    const int n0 = nb * kN;
    const bool need_mask = n0 + kN > si.nk || (p.causal && n0 + kN - 1 > m0 + warp * 16);
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float pv = fast_exp2(s[j][e] * sl2 - lrow[e >> 1]);
        if (need_mask) {
          const int key = n0 + j * 8 + 2 * t + (e & 1), row = row_base + (e >> 1) * 8;
          if (key >= si.nk || (p.causal && key > row)) pv = 0.f;
        }
        dp[j][e] = pv * (dp[j][e] - drow[e >> 1]);  // dS
      }
    }
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      const uint32_t as[4] = {Op::pack(dp[2 * kk][0], dp[2 * kk][1]), Op::pack(dp[2 * kk][2], dp[2 * kk][3]),
                              Op::pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                              Op::pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bk[4];
        load_b_kn<D>(bk, cK, kk * 16, dn * 16, lane);
        Op::run(dq[2 * dn], as, bk[0], bk[1]);
        Op::run(dq[2 * dn + 1], as, bk[2], bk[3]);
      }
    }
  }

  cp_async_wait_all();
  T* dqp = head_ptr<T>(p.dq, b, si.q0, h);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row_base + i * 8;
    if (row >= si.nq) continue;
    T* qrow = dqp + int64_t(row) * p.dq.row_stride;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
      *reinterpret_cast<uint32_t*>(qrow + dn * 8 + 2 * t) =
          Op::pack(dq[dn][2 * i] * p.scale, dq[dn][2 * i + 1] * p.scale);
  }
}

// ---- backward, atomic dQ: one kernel for dK, dV and dQ (FlashAttention-2's 5 products) ------------
// A block of W warps owns 16 W keys of one kv head (each warp 16 keys, as in the dK/dV kernel) and
// walks kM-row query tiles of every query head of its GQA group (double-buffered by cp.async; causal:
// from the first tile that sees one of its keys). Per tile: S^T = K Q^T and dP^T = V dO^T in
// registers, P^T and dS^T = P^T (dP^T - D) as A operands for dV += P^T dO and dK += dS^T Q; dS^T also
// goes to shared memory, and after a barrier the warps split the kM x D tile dQ += dS K between
// them (A = dS by transposed ldmatrix) and add it into an f32 [rows, D] scratch (lse's layout times
// D) with red.global.add. The order of those additions varies, so dQ is not bit-reproducible;
// flash_bwd_dq_convert_kernel then scales and casts it into dq.
template <int D, int W>
struct FusedCfg {
  static constexpr int kThreadsF = 32 * W;
  static constexpr int kN = 16 * W;              // keys per block
  static constexpr int kM = D == 128 ? 32 : 64;  // queries per step (bounds the S^T/dP^T registers)
  static constexpr int kRowGroups = kM / 16;     // the dQ tile: 16-row groups x column groups
  static constexpr int kColGroups = W / kRowGroups;
  static constexpr int kDqCols = D / kColGroups;  // dQ columns per warp
  static constexpr bool kEarlyDsStore = W == 8;   // see the kernel
  static_assert(W % kRowGroups == 0 && kDqCols % 16 == 0, "dQ tile must split evenly over the warps");
  static constexpr int smem_bytes(int elem) { return (2 * kN * D + 4 * kM * D + kN * kM) * elem + 4 * kM * 4; }
};

// Swizzle of a [rows][WIDTH] 16-bit tile: WIDTH >= 64 as swz; WIDTH 32 (two rows per 128 bytes) XORs
// the chunk with (row / 2) % 4, so an ldmatrix phase (8 consecutive rows, one chunk) and a warp's
// fragment store (8 rows x 4 words) both touch 8 distinct 16-byte bank groups.
template <int WIDTH>
__device__ __forceinline__ int swz_w(int row, int col) {
  if constexpr (WIDTH >= 64) {
    return swz<WIDTH>(row, col);
  } else {
    static_assert(WIDTH == 32, "dS^T tile width is 32 or 64");
    return row * 32 + ((((col >> 3) ^ ((row >> 1) & 3))) << 3) + (col & 7);
  }
}

template <class T, int D, int W>
__global__ void __launch_bounds__(32 * W) flash_bwd_fused_kernel(const AttnProblem p, const float* dsum,
                                                                 float* dq_acc) {
  using Op = Mma<T>;
  using Cfg = FusedCfg<D, W>;
  constexpr int kN = Cfg::kN, kM = Cfg::kM, NT = Cfg::kThreadsF, kDqCols = Cfg::kDqCols;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + kN * D;
  T* sQ = sV + kN * D;        // two buffers
  T* sdO = sQ + 2 * kM * D;   // two buffers
  T* sdS = sdO + 2 * kM * D;  // dS^T [key][query]
  float* sL = reinterpret_cast<float*>(sdS + kN * kM);  // two buffers: lse * log2(e)
  float* sD = sL + 2 * kM;                               // two buffers: rowsum(dO * O)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  KeyBlock kb;
  if (!bwd_begin_key_block<T, D, kN, kM, NT>(p, dsum, sK, sV, sQ, sdO, sL, sD, tid, kb)) return;
  const SeqInfo& si = kb.si;
  const int b = kb.b, hk = kb.hk, n0 = kb.n0, total = kb.walk.total;
  const QueryWalk& walk = kb.walk;

  float dk[D / 8][4], dv[D / 8][4];
  bwd_zero_dkdv<D>(dk, dv);
  const float sl2 = p.scale * kLog2e;
  const int key_base = n0 + warp * 16 + g;
  // Warps whose keys reach past the sequence mask them (P = 0): their K rows are zero-filled, but P
  // itself would not be, and dQ sums over every key of the block.
  const bool tail_keys = n0 + kN > si.nk;
  // This warp's part of each dQ tile: 16 query rows (row group) x kDqCols columns.
  const int dq_row = (warp % Cfg::kRowGroups) * 16, dq_col = (warp / Cfg::kRowGroups) * kDqCols;

  for (int it = 0; it < total; ++it) {
    cp_async_wait_all();
    __syncthreads();  // this tile's loads are visible; every warp is done with the previous tile
    if (it + 1 < total)
      bwd_issue_q_tile<T, D, kM, NT>(p, dsum, si, b, walk, it + 1, (it + 1) & 1, sQ, sdO, sL, sD, tid);
    cp_async_commit();
    const int buf = it & 1;
    const int hq = walk.head(it);
    const int m0 = walk.row0(it);
    const T* cQ = sQ + buf * kM * D;
    const T* cdO = sdO + buf * kM * D;
    const float* cL = sL + buf * kM;
    const float* cD = sD + buf * kM;

    float st[kM / 8][4], dpt[kM / 8][4];
    bwd_st_dpt<T, D, kM>(st, dpt, sK, sV, cQ, cdO, warp, lane);
    const bool need_mask = tail_keys || (p.causal && m0 < n0 + warp * 16 + 15);
    // P and dS^T are written out here and in the dK/dV kernel alike: behind a shared device function with a
    // mask functor, ptxas (CUDA 13.0, sm_90a) spilled this kernel at D = 128, W = 8 and grew the dK/dV kernel.
#pragma unroll
    for (int j = 0; j < kM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = j * 8 + 2 * t + (e & 1);
        float pv = fast_exp2(st[j][e] * sl2 - cL[qc]);
        if (need_mask) {
          const int key = key_base + (e >> 1) * 8;
          if (key >= si.nk || (p.causal && m0 + qc < key)) pv = 0.f;
        }
        st[j][e] = pv;
        dpt[j][e] = pv * (dpt[j][e] - cD[qc]);  // dS^T
      }
    }
    // dS^T to shared memory for dQ (key rows g and g + 8 of the warp, query columns 8 j + 2 t), here
    // or from the packed A operands in the loop below (Cfg::kEarlyDsStore: which of the two ptxas
    // fits in 255 registers without spilling differs between the launch shapes).
    if constexpr (Cfg::kEarlyDsStore) {
#pragma unroll
      for (int j = 0; j < kM / 8; ++j) {
        const int r0 = warp * 16 + g, c0 = j * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(sdS + swz_w<kM>(r0, c0)) = Op::pack(dpt[j][0], dpt[j][1]);
        *reinterpret_cast<uint32_t*>(sdS + swz_w<kM>(r0 + 8, c0)) = Op::pack(dpt[j][2], dpt[j][3]);
      }
    }
    bwd_accumulate_dkdv<T, D, kM>(dk, dv, st, dpt, cQ, cdO, lane, [&](int kk, const uint32_t(&as)[4]) {
      if constexpr (!Cfg::kEarlyDsStore) {
        // as[0]/as[2]: key row g, query columns 16 kk + 2 t and + 8; as[1]/as[3]: key row g + 8.
        const int r0 = warp * 16 + g, c0 = kk * 16 + 2 * t;
        *reinterpret_cast<uint32_t*>(sdS + swz_w<kM>(r0, c0)) = as[0];
        *reinterpret_cast<uint32_t*>(sdS + swz_w<kM>(r0 + 8, c0)) = as[1];
        *reinterpret_cast<uint32_t*>(sdS + swz_w<kM>(r0, c0 + 8)) = as[2];
        *reinterpret_cast<uint32_t*>(sdS + swz_w<kM>(r0 + 8, c0 + 8)) = as[3];
      }
    });
    __syncthreads();  // dS^T of every warp is in shared memory

    // dQ[q][d] += sum over the block's keys of dS^T[key][q] K[key][d]: A = dS (transposed ldmatrix of
    // dS^T, stored [k][m]), B = K (stored [k][n]).
    float acc[kDqCols / 8][4];
#pragma unroll
    for (int i = 0; i < kDqCols / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll 1
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t a[4];
      ldsm_x4_t(a, smem_u32(sdS + swz_w<kM>(kk * 16 + (lane & 7) + ((lane >> 4) << 3),
                                             dq_row + (((lane >> 3) & 1) << 3))));
#pragma unroll
      for (int dn = 0; dn < kDqCols / 16; ++dn) {
        uint32_t bk[4];
        load_b_kn<D>(bk, sK, kk * 16, dq_col + dn * 16, lane);
        Op::run(acc[2 * dn], a, bk[0], bk[1]);
        Op::run(acc[2 * dn + 1], a, bk[2], bk[3]);
      }
    }
    float* dqh = dq_acc + (lse_offset(p, b, hq, si.q0) + m0) * D;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = dq_row + g + i * 8;
      if (m0 + r >= si.nq) continue;
      float* dst = dqh + int64_t(r) * D + dq_col + 2 * t;
#pragma unroll
      for (int nt = 0; nt < kDqCols / 8; ++nt) red_add2(dst + nt * 8, acc[nt][2 * i], acc[nt][2 * i + 1]);
    }
  }

  cp_async_wait_all();
  bwd_store_dkdv<T, D>(p, si, b, hk, key_base, t, dk, dv);
}

// dq = scale * dq_acc, cast to T: a warp per row, D / 32 elements per lane.
template <class T, int D>
__global__ void __launch_bounds__(kThreads) flash_bwd_dq_convert_kernel(const AttnProblem p, const float* dq_acc) {
  using Op = Mma<T>;
  constexpr int kM = 64, kVec = D / 32;
  static_assert(kVec == 2 || kVec == 4, "D is 64 or 128");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, b = blockIdx.z, h = blockIdx.y;
  const SeqInfo si = seq_info(p, b);
  const int m0 = blockIdx.x * kM;
  if (m0 >= si.nq) return;
  const float* src = dq_acc + lse_offset(p, b, h, si.q0) * D;
  T* dst = head_ptr<T>(p.dq, b, si.q0, h);
  for (int r = warp; r < kM; r += kThreads / 32) {
    const int row = m0 + r;
    if (row >= si.nq) break;
    const float* s = src + int64_t(row) * D + lane * kVec;
    T* o = dst + int64_t(row) * p.dq.row_stride + lane * kVec;
    if constexpr (kVec == 4) {
      const float4 x = *reinterpret_cast<const float4*>(s);
      *reinterpret_cast<uint2*>(o) = make_uint2(Op::pack(x.x * p.scale, x.y * p.scale), Op::pack(x.z * p.scale, x.w * p.scale));
    } else {
      const float2 x = *reinterpret_cast<const float2*>(s);
      *reinterpret_cast<uint32_t*>(o) = Op::pack(x.x * p.scale, x.y * p.scale);
    }
  }
}

// ---- launchers -----------------------------------------------------------------------------------
template <class K>
void set_smem(K kernel, int bytes) {
  MC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <class T, int D>
void forward_impl(const AttnProblem& p, cudaStream_t s) {
  constexpr int smem = (64 * D + 4 * 64 * D) * int(sizeof(T));
  auto kernel = flash_fwd_kernel<T, D>;
  set_smem(kernel, smem);
  const dim3 grid(unsigned((p.seqlen_q + 63) / 64), unsigned(p.heads), unsigned(p.batch));
  kernel<<<grid, kThreads, smem, s>>>(p);
  MC_CUDA_CHECK_LAUNCH();
}

template <class T, int D>
void backward_impl(const AttnProblem& p, float* dsum, cudaStream_t s) {
  const dim3 grid_q(unsigned((p.seqlen_q + 63) / 64), unsigned(p.heads), unsigned(p.batch));
  flash_bwd_dot_kernel<T, D><<<grid_q, kThreads, 0, s>>>(p, dsum);
  MC_CUDA_CHECK_LAUNCH();

  constexpr int kv_smem = KvCfg<D>::smem_bytes(int(sizeof(T)));
  auto kv_kernel = flash_bwd_dkdv_kernel<T, D>;
  set_smem(kv_kernel, kv_smem);
  const dim3 grid_kv(unsigned((p.seqlen_kv + KvCfg<D>::kN - 1) / KvCfg<D>::kN), unsigned(p.kv_heads),
                     unsigned(p.batch));
  kv_kernel<<<grid_kv, kThreads, kv_smem, s>>>(p, dsum);
  MC_CUDA_CHECK_LAUNCH();

  constexpr int dq_smem = (2 * 64 * D + 4 * 64 * D) * int(sizeof(T));
  auto dq_kernel = flash_bwd_dq_kernel<T, D>;
  set_smem(dq_kernel, dq_smem);
  dq_kernel<<<grid_q, kThreads, dq_smem, s>>>(p, dsum);
  MC_CUDA_CHECK_LAUNCH();
}

// sm90: the wgmma main kernel (flash_attention_sm90.cu) instead of flash_bwd_fused_kernel.
template <class T, int D, int W>
void backward_atomic_impl(const AttnProblem& p, float* dsum, float* dq_acc, bool sm90, cudaStream_t s) {
  const dim3 grid_q(unsigned((p.seqlen_q + 63) / 64), unsigned(p.heads), unsigned(p.batch));
  // dq_acc has lse's rows, D floats each.
  const int64_t rows = p.cu_q ? int64_t(p.heads) * p.total_q : int64_t(p.batch) * p.heads * p.seqlen_q;
  MC_CUDA_CHECK(cudaMemsetAsync(dq_acc, 0, size_t(rows) * D * sizeof(float), s));
  if (grid_q.x > 0) {
    flash_bwd_dot_kernel<T, D><<<grid_q, kThreads, 0, s>>>(p, dsum);
    MC_CUDA_CHECK_LAUNCH();
  }
  using Cfg = FusedCfg<D, W>;
  constexpr int smem = Cfg::smem_bytes(int(sizeof(T)));
  auto kernel = flash_bwd_fused_kernel<T, D, W>;
  const dim3 grid_kv(unsigned((p.seqlen_kv + Cfg::kN - 1) / Cfg::kN), unsigned(p.kv_heads), unsigned(p.batch));
  if (sm90) {
    flash_backward_sm90_main(p, dsum, dq_acc, s);
  } else if (grid_kv.x > 0) {
    set_smem(kernel, smem);
    kernel<<<grid_kv, Cfg::kThreadsF, smem, s>>>(p, dsum, dq_acc);
    MC_CUDA_CHECK_LAUNCH();
  }
  if (grid_q.x > 0) {
    flash_bwd_dq_convert_kernel<T, D><<<grid_q, kThreads, 0, s>>>(p, dq_acc);
    MC_CUDA_CHECK_LAUNCH();
  }
}

template <class T, int D>
void backward_atomic_dispatch(const AttnProblem& p, float* dsum, float* dq_acc, const FlashBwdTuning& tu, bool sm90,
                              cudaStream_t s) {
  if (tu.warps == 8) backward_atomic_impl<T, D, 8>(p, dsum, dq_acc, sm90, s);
  else backward_atomic_impl<T, D, 4>(p, dsum, dq_acc, sm90, s);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

std::string check_view(const AttnTensor& t, const char* name) {
  if (!t.ptr) return "";
  if (!aligned16(t.ptr) || t.row_stride % 8 || t.head_stride % 8 || t.batch_stride % 8)
    return fmt::format("{} must start on a 16-byte boundary with strides that are multiples of 8 elements "
                       "(strides {}, {}, {}); call .contiguous()",
                       name, t.batch_stride, t.row_stride, t.head_stride);
  return "";
}

}  // namespace

std::string flash_unsupported_reason(const AttnProblem& p) {
  if (p.dtype != DType::BF16 && p.dtype != DType::F16)
    return fmt::format("dtype {} (the kernel takes bf16 or f16)", dtype_name(p.dtype));
  if (p.head_dim != 64 && p.head_dim != 128) return fmt::format("head_dim {} (supported: 64, 128)", p.head_dim);
  for (auto [t, name] : {std::pair{&p.q, "q"}, {&p.k, "k"}, {&p.v, "v"}, {&p.o, "out"}, {&p.dout, "dout"},
                         {&p.dq, "dq"}, {&p.dk, "dk"}, {&p.dv, "dv"}}) {
    std::string why = check_view(*t, name);
    if (!why.empty()) return why;
  }
  return "";
}

void flash_forward(const AttnProblem& p, int device, void* stream) {
  // The Hopper wgmma kernel (flash_attention_sm90.cu) where asked for, or by default where it can run.
  if (p.fwd_impl == 2 || (p.fwd_impl == 0 && flash_sm90_unsupported_reason(p, device).empty())) {
    flash_forward_sm90(p, device, stream);
    return;
  }
  cuda_impl::DeviceGuard guard(device);
  if (p.batch == 0 || p.seqlen_q == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::BF16) {
    if (p.head_dim == 64) forward_impl<__nv_bfloat16, 64>(p, s);
    else forward_impl<__nv_bfloat16, 128>(p, s);
  } else {
    if (p.head_dim == 64) forward_impl<__half, 64>(p, s);
    else forward_impl<__half, 128>(p, s);
  }
}

void flash_backward(const AttnProblem& p, float* dsum, float* dq_acc, int device, void* stream,
                    const FlashBwdTuning& tuning) {
  MC_CHECK(tuning.warps == 4 || tuning.warps == 8, "flash backward: FlashBwdTuning::warps is 4 or 8, got {}",
           tuning.warps);
  MC_CHECK(p.deterministic || dq_acc, "flash backward: the atomic-dQ path needs the f32 dQ scratch buffer");
  cuda_impl::DeviceGuard guard(device);
  if (p.batch == 0) return;
  if (p.seqlen_q == 0 && p.seqlen_kv == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (!p.deterministic) {
    const bool sm90 = p.bwd_impl == 2 || (p.bwd_impl == 0 && flash_sm90_unsupported_reason(p, device).empty());
    if (p.dtype == DType::BF16) {
      if (p.head_dim == 64) backward_atomic_dispatch<__nv_bfloat16, 64>(p, dsum, dq_acc, tuning, sm90, s);
      else backward_atomic_dispatch<__nv_bfloat16, 128>(p, dsum, dq_acc, tuning, sm90, s);
    } else {
      if (p.head_dim == 64) backward_atomic_dispatch<__half, 64>(p, dsum, dq_acc, tuning, sm90, s);
      else backward_atomic_dispatch<__half, 128>(p, dsum, dq_acc, tuning, sm90, s);
    }
    return;
  }
  if (p.dtype == DType::BF16) {
    if (p.head_dim == 64) backward_impl<__nv_bfloat16, 64>(p, dsum, s);
    else backward_impl<__nv_bfloat16, 128>(p, dsum, s);
  } else {
    if (p.head_dim == 64) backward_impl<__half, 64>(p, dsum, s);
    else backward_impl<__half, 128>(p, dsum, s);
  }
}

}  // namespace megacore::ops::cuda
