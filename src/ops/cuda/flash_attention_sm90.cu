// megacore's Hopper flash-attention kernels: wgmma (warpgroup MMA, sm_90a). The forward (online softmax)
// is described here; the atomic-dQ backward has its own comment further down (flash_bwd_sm90_kernel).
// flash_attention.cu keeps the mma.sync kernels, the deterministic backward and the passes around the
// backward (rowsum(dO * O), zeroing and casting the f32 dQ accumulator).
//
// Forward structure (a first FlashAttention-3-style version):
//   - A CTA owns kM = 128 query rows of one (batch, head): two warpgroups of 128 threads, 64 rows each.
//   - K and V are streamed in tiles of kN keys (128 by default, 64 as a tuning variant), double-buffered
//     by cp.async (all 256 threads issue the copies of tile n + 1 while tile n is multiplied). cp.async
//     rather than TMA keeps arbitrary row strides (fused-QKV views), packed varlen sequences and
//     zero-filled partial tiles exactly as in the mma.sync kernel; TMA + mbarriers + a producer
//     warpgroup with setmaxnreg is the next step (see docs/kernels.md).
//   - S = Q K^T: wgmma m64n{kN}k16 with both operands in shared memory (K-major), D/16 k-steps.
//   - The softmax runs on the S accumulators in registers (exp2, running max/sum per row); P is
//     converted to bf16/f16 in registers and is the register A operand of O += P V (wgmma m64n{D}k16,
//     V from shared memory read N-major through the descriptor: the "transpose" is free).
//
// Shared-memory layout (the one thing wgmma's descriptors must agree with):
//   A tile of R rows x D columns (Q: R = kM, K and V: R = kN) is stored as D/64 column blocks, each
//   [R][64] elements = R rows of 128 bytes; 16-byte chunk c of row r sits at chunk c ^ (r % 8). That
//   is the 128-byte swizzle (descriptor mode 1: byte-address bits [4,7) XOR bits [7,10)) provided each
//   block starts 1024-byte aligned, which the kernel guarantees (base aligned by hand, all tile sizes
//   multiples of 1024 bytes). It is also exactly what a TMA box of 64 columns with SWIZZLE_128B writes.
//   An 8-row x 128-byte group is one swizzle atom (1024 bytes); atoms follow each other by rows.
//
// Descriptors (64 bits: start address >> 4 in [0,14), LBO >> 4 in [16,30), SBO >> 4 in [32,46),
// base offset 0 in [49,52), swizzle mode 1 = 128B in [62,64)):
//   - K-major operands (Q as A, K as B of S = Q K^T; the contiguous dimension is D = the MMA's K):
//     the canonical SW128 K-major layout is ((8,m),(8 elem,2)) : ((128 B, SBO), (1, 16 B)): rows 128 B
//     apart inside an atom, SBO = 1024 B from one 8-row atom to the next, LBO unused (encoded 1). A
//     k-step of 16 elements is 32 bytes: k-step ks starts at block ks / 4 plus (ks % 4) * 32 bytes; the
//     hardware applies the XOR to the final address, so an offset inside the 128-byte row is legal
//     (start stays within the atom's first row; base offset field 0 because atoms are 1024-aligned).
//     Warpgroup wg's 64 rows of Q start 64 * 128 bytes further in the block.
//   - N-major operand (V as B of O = P V: K = keys, N = D, V stored [key][d] so N is contiguous,
//     imm-trans-b = 1): the canonical SW128 MN-major layout is ((8 elem,8,m),(8,k)) :
//     ((1, 16 B, LBO), (128 B, SBO)): 64 N-elements per 128-byte row, LBO = distance between 64-wide
//     column blocks (kN * 128 bytes here), SBO = distance between 8-key atoms (1024 bytes). The
//     k-step kk (16 keys) starts 16 rows = 2048 bytes further.
//
// Register fragments (PTX ISA, wgmma .m64nNk16; warp w = warp index % 4 of the warpgroup, g = lane / 4,
// t = lane % 4):
//   - accumulator D (S or O), N/2 f32 per thread: d[4 i + e] holds row 16 w + g + 8 (e / 2), column
//     8 i + 2 t + (e % 2). Per 8-column slice this is the m16n8 C fragment of mma.sync.
//   - register A (P), four 32-bit registers of two 16-bit values per k-step of 16 keys: a0 = (row g,
//     cols 2t, 2t+1), a1 = (row g + 8, same cols), a2 = (row g, cols 8 + 2t, +1), a3 = (row g + 8, cols
//     8 + 2t, +1), rows again offset by 16 w. So P's k-step kk packs S accumulators
//     {d[8kk], d[8kk+1]}, {d[8kk+2], d[8kk+3]}, {d[8kk+4], d[8kk+5]}, {d[8kk+6], d[8kk+7]}.
//
// Ordering: cp.async writes go through the generic proxy and wgmma reads through the async proxy, so
// each thread waits for its copies, issues fence.proxy.async.shared::cta, then the CTA barrier; a
// wgmma.fence precedes every batch of wgmmas whose accumulator or A registers were touched by other
// instructions (the O rescale, the P pack); wgmma.wait_group 0 retires a batch before its registers
// are read, and an empty asm with "+f" on each accumulator keeps the compiler from moving those reads
// above the wait.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include <fmt/format.h>

#include "core/cuda/cuda_check.hpp"
#include "ops/cuda/attention_cuda.hpp"
#include "ops/cuda/flash_common.cuh"
#include "ops/cuda/sm90_common.cuh"

// Device code exists only for sm_90a (wgmma and its fences are arch-specific features). The library
// defines MEGACORE_FLASH_SM90 when CMAKE_CUDA_ARCHITECTURES names 90a; without it the host side says
// so (flash_sm90_unsupported_reason) and the sm80 kernel runs.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MC_FLASH_SM90_DEVICE 1
#else
#define MC_FLASH_SM90_DEVICE 0
#endif

namespace megacore::ops::cuda {
namespace {

constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kM = 64 * kWarpgroups;  // query rows per CTA

using namespace flash;  // smem_u32, cp.async, fast_exp2, SeqInfo, head_ptr, lse_offset (flash_common.cuh)
using namespace sm90;   // fences, mbarriers, named barriers, smem_desc (sm90_common.cuh)

#if MC_FLASH_SM90_DEVICE
// ---- primitives (the ones shared with the mma.sync kernels are in flash_common.cuh) ----------------

template <class T>
struct Cvt;
template <>
struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <>
struct Cvt<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};


// wgmma.mma_async m64nNk16, f32 accumulators d[N / 2]. ss: A and B from shared memory, both K-major;
// rs: A from registers, B from shared memory N-major. acc = 0 overwrites d (scale-d false), 1 adds.
template <class T, int N>
struct Wgmma {
  static __device__ __forceinline__ void ss(float (&d)[N / 2], uint64_t da, uint64_t db, int acc);
  static __device__ __forceinline__ void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int acc);
  // ss with both operands MN-major (imm-trans-a = imm-trans-b = 1): the backward's dQ = dS K reads dS^T
  // stored [key][query] and K stored [key][d].
  static __device__ __forceinline__ void ss_tt(float (&d)[N / 2], uint64_t da, uint64_t db, int acc);
};

// One specialisation per (dtype, N): the PTX names the dtype and the shape in the instruction text
// and every accumulator register as an operand, so the four bodies differ only in those strings.
// Operand numbers: d is %0 .. %(N/2 - 1); then ss takes da, db, acc and rs takes a[0..3], db, acc.
#define MC_WG_D32_LIST                                                                                \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"                            \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MC_WG_D64_LIST                                                                                \
  MC_WG_D32_LIST ","                                                                                  \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"                  \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MC_WG_F8(i)                                                                                   \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),        \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define MC_WG_D32_OPS MC_WG_F8(0), MC_WG_F8(8), MC_WG_F8(16), MC_WG_F8(24)
#define MC_WG_D64_OPS MC_WG_D32_OPS, MC_WG_F8(32), MC_WG_F8(40), MC_WG_F8(48), MC_WG_F8(56)
// T: C++ type; TY: PTX type; N: 64 or 128; LIST/OPS: the accumulators; then the operand numbers of
// ss's (da, db, acc) and of rs's (a0, a1, a2, a3, db, acc) as strings.
#define MC_WGMMA(T, TY, N, LIST, OPS, SA, SB, SACC, R0, R1, R2, R3, RB, RACC)                          \
  template <>                                                                                         \
  __device__ __forceinline__ void Wgmma<T, N>::ss(float (&d)[N / 2], uint64_t da, uint64_t db, int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SACC ", 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" LIST "}, %" SA ", %" SB \
                 ", p, 1, 1, 0, 0;\n}\n"                                                              \
                 : OPS                                                                                \
                 : "l"(da), "l"(db), "r"(acc));                                                       \
  }                                                                                                   \
  template <>                                                                                         \
  __device__ __forceinline__ void Wgmma<T, N>::rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, \
                                                  int acc) {                                          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" RACC ", 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" LIST "}, {%" R0 ", %" R1 \
                 ", %" R2 ", %" R3 "}, %" RB ", p, 1, 1, 1;\n}\n"                                     \
                 : OPS                                                                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));                    \
  }                                                                                                   \
  template <>                                                                                         \
  __device__ __forceinline__ void Wgmma<T, N>::ss_tt(float (&d)[N / 2], uint64_t da, uint64_t db, int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SACC ", 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" LIST "}, %" SA ", %" SB \
                 ", p, 1, 1, 1, 1;\n}\n"                                                              \
                 : OPS                                                                                \
                 : "l"(da), "l"(db), "r"(acc));                                                       \
  }
MC_WGMMA(__nv_bfloat16, "bf16", 64, MC_WG_D32_LIST, MC_WG_D32_OPS, "32", "33", "34", "32", "33", "34", "35", "36", "37")
MC_WGMMA(__half, "f16", 64, MC_WG_D32_LIST, MC_WG_D32_OPS, "32", "33", "34", "32", "33", "34", "35", "36", "37")
MC_WGMMA(__nv_bfloat16, "bf16", 128, MC_WG_D64_LIST, MC_WG_D64_OPS, "64", "65", "66", "64", "65", "66", "67", "68", "69")
MC_WGMMA(__half, "f16", 128, MC_WG_D64_LIST, MC_WG_D64_OPS, "64", "65", "66", "64", "65", "66", "67", "68", "69")
#undef MC_WGMMA
#undef MC_WG_D64_OPS
#undef MC_WG_D32_OPS
#undef MC_WG_F8
#undef MC_WG_D64_LIST
#undef MC_WG_D32_LIST

// Element offset of (row r, column c) in an R-row tile stored as D/64 swizzled column blocks.
template <int R>
__device__ __forceinline__ int tile_off(int r, int c) {
  return (c >> 6) * (R * 64) + r * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3) + (c & 7);
}

// R x D tile from global rows (row_stride elements apart) into the swizzled layout; rows at or beyond
// valid_rows are zero-filled. Consecutive threads take consecutive 16-byte chunks of a row.
template <class T, int R, int D>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t row_stride, int valid_rows, int tid) {
  constexpr int kChunks = D / 8;
  static_assert((R * kChunks) % kThreads == 0, "tile must split evenly over the block");
#pragma unroll
  for (int i = 0; i < R * kChunks / kThreads; ++i) {
    const int c = i * kThreads + tid;
    const int r = c / kChunks, ch = c % kChunks;
    const bool ok = r < valid_rows;
    const T* src = ok ? g + int64_t(r) * row_stride + ch * 8 : g;
    cp_async16(smem_u32(s + tile_off<R>(r, ch * 8)), src, ok);
  }
}


// d (= at the first k-step, then +=) A B^T over the D / 16 k-steps, both operands K-major tiles of D
// columns stored as D / 64 swizzled 64-column blocks (see the header comment): A's 64 rows start at
// shared address a in a tile of a_rows rows (its column blocks a_rows * 128 bytes apart), B's N rows at b
// in a tile of b_rows rows. One k-step of 16 elements is 32 bytes inside a block's 128-byte rows.
template <class T, int N, int D>
__device__ __forceinline__ void wgmma_kmajor(float (&d)[N / 2], uint32_t a, uint32_t a_rows, uint32_t b,
                                             uint32_t b_rows) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint64_t da = smem_desc(a + uint32_t(ks >> 2) * (a_rows * 128u) + uint32_t(ks & 3) * 32u, 16u, 1024u);
    const uint64_t db = smem_desc(b + uint32_t(ks >> 2) * (b_rows * 128u) + uint32_t(ks & 3) * 32u, 16u, 1024u);
    Wgmma<T, N>::ss(d, da, db, ks > 0 ? 1 : 0);
  }
}
#endif  // MC_FLASH_SM90_DEVICE

#if MC_FLASH_SM90_DEVICE
// Online-softmax step of both sm90 forward kernels for S of tile nb (scaled, masked, exponentiated in
// place), rescales O and the running max / sum, and packs P as the register A operand (pa).
template <class T, int D, int kN>
__device__ __forceinline__ void softmax_step(float (&s)[kN / 2], float (&o)[D / 2], uint32_t (&pa)[kN / 16][4],
                                             float (&m_run)[2], float (&l_run)[2], const AttnProblem& p, const SeqInfo& si,
                                             int nb, float sl2, int wrow0, int row_base, int t) {
  using Op = Cvt<T>;
  const int n0 = nb * kN;
  const bool need_mask = n0 + kN > si.nk || (p.causal && n0 + kN - 1 > wrow0);
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[4 * j + e] * sl2;
      if (need_mask) {
        const int key = n0 + j * 8 + 2 * t + (e & 1), row = row_base + (e >> 1) * 8;
        if (key >= si.nk || (p.causal && key > row)) x = -INFINITY;
      }
      s[4 * j + e] = x;
    }
  }
  float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    mx[0] = fmaxf(mx[0], fmaxf(s[4 * j], s[4 * j + 1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
  float base[2], corr[2], rs[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 2));
    base[i] = mx[i] == -INFINITY ? 0.f : mx[i];
    corr[i] = fast_exp2(m_run[i] - base[i]);
    m_run[i] = mx[i];
  }
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    s[4 * j] = fast_exp2(s[4 * j] - base[0]);
    s[4 * j + 1] = fast_exp2(s[4 * j + 1] - base[0]);
    s[4 * j + 2] = fast_exp2(s[4 * j + 2] - base[1]);
    s[4 * j + 3] = fast_exp2(s[4 * j + 3] - base[1]);
    rs[0] += s[4 * j] + s[4 * j + 1];
    rs[1] += s[4 * j + 2] + s[4 * j + 3];
  }
  l_run[0] = l_run[0] * corr[0] + rs[0];
  l_run[1] = l_run[1] * corr[1] + rs[1];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    o[4 * i] *= corr[0];
    o[4 * i + 1] *= corr[0];
    o[4 * i + 2] *= corr[1];
    o[4 * i + 3] *= corr[1];
  }
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    pa[kk][0] = Op::pack(s[8 * kk], s[8 * kk + 1]);
    pa[kk][1] = Op::pack(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = Op::pack(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = Op::pack(s[8 * kk + 6], s[8 * kk + 7]);
  }
}
#endif

template <class T, int D, int kN>
struct Sm90Cfg {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(kN == 64 || kN == 128, "64 or 128 keys per tile");
  // Q, then two stages of K, then two stages of V; + 1024 bytes to align the base by hand.
  static constexpr int smem_bytes = (kM * D + 4 * kN * D) * int(sizeof(T)) + 1024;
};

// ---- forward -------------------------------------------------------------------------------------
template <class T, int D, int kN>
__global__ void __launch_bounds__(kThreads, 1) flash_fwd_sm90_kernel(const AttnProblem p) {
#if MC_FLASH_SM90_DEVICE
  using Op = Cvt<T>;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem_raw + (((raw + 1023u) & ~1023u) - raw));
  T* sK = sQ + kM * D;      // two stages
  T* sV = sK + 2 * kN * D;  // two stages
  const uint32_t aQ = smem_u32(sQ), aK = smem_u32(sK), aV = smem_u32(sV);
  constexpr uint32_t kTileBytes = uint32_t(kN * D * sizeof(T));  // one K or V stage

  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int b = blockIdx.z, h = blockIdx.y;
  const int m0 = query_block_row0(p, kM);
  const SeqInfo si = seq_info(p, b);
  if (m0 >= si.nq) return;  // uniform over the CTA
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

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const float sl2 = p.scale * kLog2e;
  const int wrow0 = m0 + wg * 64 + warp * 16;  // first row of this warp
  const int row_base = wrow0 + g;
  // Warpgroup wg's 64 rows of Q: 8 swizzle atoms from row 64 wg of each column block.
  const uint32_t aQw = aQ + uint32_t(wg) * 64u * 128u;

  for (int nb = 0; nb < n_blocks; ++nb) {
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();  // tile nb is in shared memory; every warp is done with tile nb - 1's stage
    if (nb + 1 < n_blocks) {
      const int n1 = (nb + 1) * kN, st = (nb + 1) & 1;
      load_tile<T, kN, D>(sK + st * kN * D, k + int64_t(n1) * p.k.row_stride, p.k.row_stride, si.nk - n1, tid);
      load_tile<T, kN, D>(sV + st * kN * D, v + int64_t(n1) * p.v.row_stride, p.v.row_stride, si.nk - n1, tid);
    }
    cp_async_commit();
    const uint32_t cK = aK + uint32_t(nb & 1) * kTileBytes, cV = aV + uint32_t(nb & 1) * kTileBytes;

    // S = Q K^T (64 x kN per warpgroup).
    float s[kN / 2];
    wgmma_fence();
    wgmma_kmajor<T, kN, D>(s, aQw, kM, cK, kN);
    wgmma_commit();
    wgmma_wait_all();
    reg_fence(s);

    // Scale, mask and exponentiate S, rescale O and the running statistics, and pack P as the register A
    // operand, one k-step per 16 keys (layout in the header comment).
    uint32_t pa[kN / 16][4];
    softmax_step<T, D, kN>(s, o, pa, m_run, l_run, p, si, nb, sl2, wrow0, row_base, t);
    // O += P V: V's k-step kk (keys 16 kk ..) starts 16 rows = 2048 bytes in; N = D spans the D / 64
    // column blocks kN * 128 bytes apart (LBO); 8-key atoms 1024 bytes apart (SBO).
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      const uint64_t db = smem_desc(cV + uint32_t(kk) * 2048u, uint32_t(kN) * 128u, 1024u);
      Wgmma<T, D>::rs(o, pa[kk], db, 1);
    }
    wgmma_commit();
    wgmma_wait_all();  // the next iteration's loads overwrite this stage after the barrier
    reg_fence(o);
  }

  cp_async_wait_all();  // nothing may be in flight at exit (only happens when there were no keys)
  store_out_rows<T, D, Op>(p, si, b, h, row_base, t, l_run, m_run, [&](int dn, int e) { return o[4 * dn + e]; });
#elif defined(__CUDA_ARCH__)
  __trap();  // built for another architecture: the host never launches this (flash_sm90_unsupported_reason)
#endif
}

// ---- warp-specialized forward (AttnProblem::sm90_variant 1..4) ---------------------------------
// Same math, fragments and descriptors as flash_fwd_sm90_kernel; what changes is who loads and how the
// warps synchronise. A third warpgroup (the producer) issues every cp.async of Q and of the K/V tiles into
// kStages stages; the two consumer warpgroups never meet at a CTA barrier after the prologue, so they
// drift apart and one's softmax overlaps the other's wgmmas. (The producer is a whole warpgroup because
// setmaxnreg works per warpgroup; all 128 of its threads issue copies.)
//   full_k[st], full_v[st]: init count 128. Each producer thread issues its copies of the stage's K (then
//     of V) and then cp.async.mbarrier.arrive.noinc: the arrival fires when all of that lane's earlier
//     cp.async have landed, so the phase completes when the whole tile is in shared memory. Q rides on
//     tile 0's full_k (its copies precede K's). Consumers wait with parity (nb / kStages) & 1, then
//     fence.proxy.async (the data was written by the generic proxy, wgmma reads through the async one).
//   empty[st]: init count 256: every consumer thread arrives after its wgmma.wait_group 0 of the PV
//     product of the tile in that stage. The producer waits on it (parity ((n / kStages) - 1) & 1)
//     before refilling the stage for tile n >= kStages.
// Every tile the producer fills is consumed by both warpgroups (same n_blocks for the whole CTA), so
// every wait has its arrivals; the producer waits for its own copies before exiting.
#if MC_FLASH_SM90_DEVICE
__device__ __forceinline__ void mbar_cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// R x D tile by the producer warpgroup (pt = 0..127), same layout and zero-fill as load_tile.
template <class T, int R, int D>
__device__ __forceinline__ void load_tile_producer(T* s, const T* g, int64_t row_stride, int valid_rows, int pt) {
  constexpr int kChunks = D / 8;
  static_assert((R * kChunks) % 128 == 0, "tile must split evenly over the warpgroup");
#pragma unroll 4
  for (int i = 0; i < R * kChunks / 128; ++i) {
    const int c = i * 128 + pt;
    const int r = c / kChunks, ch = c % kChunks;
    const bool ok = r < valid_rows;
    const T* src = ok ? g + int64_t(r) * row_stride + ch * 8 : g;
    cp_async16(smem_u32(s + tile_off<R>(r, ch * 8)), src, ok);
  }
}
#endif


template <class T, int D, int kN, int kStages>
struct Sm90WsCfg {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(kN == 64 || kN == 128, "64 or 128 keys per tile");
  static_assert(kStages == 2 || kStages == 3, "2 or 3 stages");
  static constexpr int kBarBytes = 3 * kStages * 8;
  // Q, then kStages of K, then kStages of V, then the mbarriers; + 1024 to align the base by hand.
  static constexpr int smem_bytes = (kM * D + 2 * kStages * kN * D) * int(sizeof(T)) + kBarBytes + 1024;
};

// Two consumer warpgroups + one producer warpgroup. ptxas budgets a 384-thread kernel at 168 registers;
// setmaxnreg moves them: the producer drops to kProducerRegs, the consumers rise to kConsumerRegs
// (128 * 56 + 256 * 224 = 64512 = 384 * 168, the registers the launch reserved).
constexpr int kWsThreads = kThreads + 128;
#if MC_FLASH_SM90_DEVICE
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
#endif

template <class T, int D, int kN, int kStages, bool kPingPong>
__global__ void __launch_bounds__(kWsThreads, 1) flash_fwd_sm90_ws_kernel(const AttnProblem p) {
#if MC_FLASH_SM90_DEVICE
  using Op = Cvt<T>;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem_raw + (((raw + 1023u) & ~1023u) - raw));
  T* sK = sQ + kM * D;            // kStages stages
  T* sV = sK + kStages * kN * D;  // kStages stages
  const uint32_t aQ = smem_u32(sQ), aK = smem_u32(sK), aV = smem_u32(sV);
  const uint32_t aBar = smem_u32(sV + kStages * kN * D);  // 8-byte aligned (tiles are 1024-byte multiples)
  auto full_k = [&](int st) { return aBar + uint32_t(st) * 8u; };
  auto full_v = [&](int st) { return aBar + uint32_t(kStages + st) * 8u; };
  auto empty = [&](int st) { return aBar + uint32_t(2 * kStages + st) * 8u; };
  constexpr uint32_t kTileBytes = uint32_t(kN * D * sizeof(T));  // one K or V stage

  const int tid = threadIdx.x;
  const int b = blockIdx.z, h = blockIdx.y;
  const int m0 = query_block_row0(p, kM);
  const SeqInfo si = seq_info(p, b);
  if (m0 >= si.nq) return;  // uniform over the CTA
  const int hk = h / (p.heads / p.kv_heads);
  const int n_blocks = key_blocks_for(p, si, m0, kM, kN);

  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      mbar_init(full_k(st), 128u);
      mbar_init(full_v(st), 128u);
      mbar_init(empty(st), uint32_t(kThreads));
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the last CTA-wide barrier

  if (tid >= kThreads) {
    // ---- producer warpgroup ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    const int pt = tid - kThreads;
    const T* q = head_ptr<const T>(p.q, b, si.q0, h);
    const T* k = head_ptr<const T>(p.k, b, si.k0, hk);
    const T* v = head_ptr<const T>(p.v, b, si.k0, hk);
    if (n_blocks > 0)
      load_tile_producer<T, kM, D>(sQ, q + int64_t(m0) * p.q.row_stride, p.q.row_stride, si.nq - m0, pt);
    for (int n = 0; n < n_blocks; ++n) {
      const int st = n % kStages;
      if (n >= kStages) mbar_wait(empty(st), uint32_t((n / kStages) - 1) & 1u);
      const int n1 = n * kN;
      load_tile_producer<T, kN, D>(sK + st * kN * D, k + int64_t(n1) * p.k.row_stride, p.k.row_stride, si.nk - n1, pt);
      mbar_cp_async_arrive(full_k(st));
      load_tile_producer<T, kN, D>(sV + st * kN * D, v + int64_t(n1) * p.v.row_stride, p.v.row_stride, si.nk - n1, pt);
      mbar_cp_async_arrive(full_v(st));
    }
    cp_async_commit();  // the copies above belong to no group yet; wait for them before exiting
    cp_async_wait_all();
    return;
  }

  // ---- consumer warpgroups ----
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const float sl2 = p.scale * kLog2e;
  const int wrow0 = m0 + wg * 64 + warp * 16;
  const int row_base = wrow0 + g;
  const uint32_t aQw = aQ + uint32_t(wg) * 64u * 128u;

  if constexpr (kPingPong) {
    // Tile it's S = Q K^T is issued together with tile it - 1's O += P V, as one batch; the two
    // consumer warpgroups take turns issuing their batches (named barrier 1 + wg: "wg may issue"), so
    // one warpgroup's softmax runs while the other's wgmmas occupy the tensor cores. Barrier balance:
    // each warpgroup syncs its barrier n_blocks + 1 times; warpgroup 0 arrives on warpgroup 1's barrier
    // after each of its n_blocks + 1 batches, warpgroup 1 arrives once up front and after each batch but
    // its last, so no barrier is left with pending arrivals at exit (n_blocks == 0: no barrier at all).
    // The first batch (S only) and the last (P V only) are peeled so that no wgmma sits under a branch.
    float s[kN / 2];
    uint32_t pa[kN / 16][4];
    auto step = [&](auto with_pv, auto with_s, int it) {
      constexpr bool kPv = decltype(with_pv)::value, kS = decltype(with_s)::value;
      const int st = it % kStages, pst = (it + kStages - 1) % kStages;
      if constexpr (kS) mbar_wait(full_k(st), uint32_t(it / kStages) & 1u);
      if constexpr (kPv) mbar_wait(full_v(pst), uint32_t((it - 1) / kStages) & 1u);
      __syncwarp();
      fence_proxy_async();
      named_bar_sync(1 + wg, kThreads);
      wgmma_fence();
      if constexpr (kPv) {
        const uint32_t cV = aV + uint32_t(pst) * kTileBytes;
#pragma unroll
        for (int kk = 0; kk < kN / 16; ++kk) {
          const uint64_t db = smem_desc(cV + uint32_t(kk) * 2048u, uint32_t(kN) * 128u, 1024u);
          Wgmma<T, D>::rs(o, pa[kk], db, 1);
        }
      }
      if constexpr (kS) {
        const uint32_t cK = aK + uint32_t(st) * kTileBytes;
        wgmma_kmajor<T, kN, D>(s, aQw, kM, cK, kN);
      }
      wgmma_commit();
      if (wg == 0 || kS) named_bar_arrive(2 - wg, kThreads);  // the other warpgroup's turn (see above)
      wgmma_wait_all();
      if constexpr (kS) reg_fence(s);
      if constexpr (kPv) {
        reg_fence(o);
        mbar_arrive(empty(pst));  // this warpgroup is done with tile it - 1's K and V
      }
      if constexpr (kS) softmax_step<T, D, kN>(s, o, pa, m_run, l_run, p, si, it, sl2, wrow0, row_base, t);
    };
    using Yes = std::integral_constant<bool, true>;
    using No = std::integral_constant<bool, false>;
    if (n_blocks > 0) {
      if (wg == 1) named_bar_arrive(1, kThreads);  // warpgroup 0 goes first
      step(No{}, Yes{}, 0);
      for (int it = 1; it < n_blocks; ++it) step(Yes{}, Yes{}, it);
      step(Yes{}, No{}, n_blocks);
    }
  } else {
    for (int nb = 0; nb < n_blocks; ++nb) {
      const int st = nb % kStages;
      const uint32_t ph = uint32_t(nb / kStages) & 1u;
      const uint32_t cK = aK + uint32_t(st) * kTileBytes, cV = aV + uint32_t(st) * kTileBytes;
      mbar_wait(full_k(st), ph);
      __syncwarp();  // the wait loop may exit lane by lane; wgmma's .aligned needs the warp converged
      fence_proxy_async();

      float s[kN / 2];
      wgmma_fence();
      wgmma_kmajor<T, kN, D>(s, aQw, kM, cK, kN);
      wgmma_commit();
      wgmma_wait_all();
      reg_fence(s);

      uint32_t pa[kN / 16][4];
      softmax_step<T, D, kN>(s, o, pa, m_run, l_run, p, si, nb, sl2, wrow0, row_base, t);
      mbar_wait(full_v(st), ph);
      __syncwarp();
      fence_proxy_async();
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) {
        const uint64_t db = smem_desc(cV + uint32_t(kk) * 2048u, uint32_t(kN) * 128u, 1024u);
        Wgmma<T, D>::rs(o, pa[kk], db, 1);
      }
      wgmma_commit();
      wgmma_wait_all();  // this warpgroup's reads of stage st are done
      reg_fence(o);
      mbar_arrive(empty(st));
    }
  }

  store_out_rows<T, D, Op>(p, si, b, h, row_base, t, l_run, m_run, [&](int dn, int e) { return o[4 * dn + e]; });
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// ---- backward (atomic dQ) --------------------------------------------------------------------------
// FlashAttention-2's single backward kernel (5 matrix products per tile pair, dQ summed over key blocks
// with f32 atomics) on wgmma. flash_attention.cu runs everything around it: zeroing the dQ scratch,
// rowsum(dO * O), and the final scale-and-cast of dQ.
//   - A CTA owns kBwdN = 128 keys of one kv head: two warpgroups, 64 keys each (K and V loaded once).
//     It walks 64-row query tiles of every query head of the GQA group (causal: from the first tile
//     that sees one of its keys), Q, dO, lse and rowsum(dO * O) double-buffered by cp.async.
//   - Per tile, each warpgroup for its 64 keys: S^T = K Q^T and dP^T = V dO^T (wgmma m64n64k16, both
//     operands K-major in shared memory, two commit groups so P^T is computed while dP^T runs);
//     P^T = exp2(S^T scale log2 e - lse log2 e), dS^T = P^T (dP^T - rowsum); both packed as register A
//     operands of dV += P^T dO and dK += dS^T Q (m64n{D}k16, dO and Q read N-major: the fwd's P V).
//   - dS^T also goes to shared memory ([key][query], one 64-column swizzled block), and after a CTA
//     barrier dQ = dS K (M = 64 queries) runs with both operands MN-major (imm-trans): at D = 128 each
//     warpgroup takes one 64-column block of D over all 128 keys; at D = 64 each takes its own 64 keys
//     over all of D (so two warpgroups add into the same dQ rows). The accumulators are added into
//     the f32 scratch with red.global.add.v2.
//   Descriptors and fragments as described at the top of this file.
constexpr int kBwdN = 128;  // keys per CTA
constexpr int kBwdM = 64;   // queries per step

// kBulkDq (the default at D = 128; AttnProblem::sm90_bwd_variant 1 turns it off): dQ goes through shared
// memory ([64][D] f32, the dq_acc rows' own layout) and one bulk reduce-add per tile (cp.reduce.async.bulk
// .add.f32) instead of red.global.add from every thread. H100, causal d128 fwd+bwd: 276 / 320 / 350 / 358
// TFLOP/s at seq 2k / 4k / 8k / 16k against 270 / 310 / 343 / 353 with the per-thread adds (same run,
// benchmarks/results/kernels_NVIDIA_H100.json).
template <class T, int D, bool kBulkDq = false>
struct Sm90BwdCfg {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(!kBulkDq || D == 128, "the bulk dQ reduce is built for D = 128");
  // K, V, two buffers of Q and of dO, dS^T; then lse and rowsum (two buffers each), then (kBulkDq) the f32
  // dQ tile; + 1024 to align.
  static constexpr int kTileBytes = (2 * kBwdN * D + 4 * kBwdM * D + kBwdN * kBwdM) * int(sizeof(T));
  static constexpr int smem_bytes = kTileBytes + 4 * kBwdM * 4 + (kBulkDq ? kBwdM * D * 4 : 0) + 1024;
};

#if MC_FLASH_SM90_DEVICE
template <int N>
__device__ __forceinline__ void reg_fence_u(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3])::"memory");
}

// Bulk reduce-add of `bytes` (a multiple of 16) of f32 from shared memory into global memory, and its
// completion waits (issuing thread only).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
#endif

template <class T, int D, bool kBulkDq>
__global__ void __launch_bounds__(kThreads, 1)
    flash_bwd_sm90_kernel(const AttnProblem p, const float* dsum, float* dq_acc) {
#if MC_FLASH_SM90_DEVICE
  using Op = Cvt<T>;
  constexpr int kN = kBwdN, kMq = kBwdM;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  T* sK = reinterpret_cast<T*>(smem_raw + (((raw + 1023u) & ~1023u) - raw));
  T* sV = sK + kN * D;
  T* sQ = sV + kN * D;          // two buffers
  T* sdO = sQ + 2 * kMq * D;    // two buffers
  T* sdS = sdO + 2 * kMq * D;   // dS^T [key][query]
  float* sL = reinterpret_cast<float*>(sdS + kN * kMq);  // two buffers: lse * log2 e
  float* sR = sL + 2 * kMq;                              // two buffers: rowsum(dO * O)
  float* sDq = sR + 2 * kMq;                             // kBulkDq: [kMq][D] f32 (16-byte aligned)
  const uint32_t aK = smem_u32(sK), aV = smem_u32(sV), aQ = smem_u32(sQ), adO = smem_u32(sdO), aS = smem_u32(sdS);
  constexpr uint32_t kQBytes = uint32_t(kMq * D * sizeof(T));

  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int b = blockIdx.z, hk = blockIdx.y;
  const SeqInfo si = seq_info(p, b);
  const int n0 = int(blockIdx.x) * kN;
  if (n0 >= si.nk) return;  // uniform over the CTA
  load_tile<T, kN, D>(sK, head_ptr<const T>(p.k, b, si.k0 + n0, hk), p.k.row_stride, si.nk - n0, tid);
  load_tile<T, kN, D>(sV, head_ptr<const T>(p.v, b, si.k0 + n0, hk), p.v.row_stride, si.nk - n0, tid);

  const QueryWalk walk = query_walk(p, si, hk, n0, kMq);
  const int total = walk.total;
  auto issue = [&](int it, int buf) {
    const int hq = walk.head(it);
    const int m0 = walk.row0(it);
    load_tile<T, kMq, D>(sQ + buf * kMq * D, head_ptr<const T>(p.q, b, si.q0 + m0, hq), p.q.row_stride, si.nq - m0,
                         tid);
    load_tile<T, kMq, D>(sdO + buf * kMq * D, head_ptr<const T>(p.dout, b, si.q0 + m0, hq), p.dout.row_stride,
                         si.nq - m0, tid);
    stage_row_stats<kMq>(p, dsum, si, b, hq, m0, tid, sL + buf * kMq, sR + buf * kMq);
  };
  if (total > 0) issue(0, 0);
  cp_async_commit();

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  const float sl2 = p.scale * kLog2e;
  const int key_w = n0 + wg * 64 + warp * 16;  // first key of this warp
  const int key_base = key_w + g;
  // This warpgroup's 64 keys: 8 swizzle atoms from row 64 wg of each column block.
  const uint32_t aKw = aK + uint32_t(wg) * 64u * 128u, aVw = aV + uint32_t(wg) * 64u * 128u;
  const bool tail_keys = key_w + 16 > si.nk;

  // kBulkDq: where the dQ tile in shared memory goes, and its bytes (rows inside the sequence only).
  float* dq_dst = nullptr;
  uint32_t dq_bytes = 0;
  for (int it = 0; it < total; ++it) {
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();  // tile it is in shared memory; every warp is done with tile it - 1 (and with dS^T)
    if constexpr (kBulkDq) {
      // The previous tile's dQ is in shared memory (written and fenced before the barrier above).
      if (tid == 0 && dq_bytes > 0) bulk_reduce_add_f32(dq_dst, smem_u32(sDq), dq_bytes);
    }
    if (it + 1 < total) issue(it + 1, (it + 1) & 1);
    cp_async_commit();
    const int buf = it & 1;
    const int hq = walk.head(it);
    const int m0 = walk.row0(it);
    const uint32_t cQ = aQ + uint32_t(buf) * kQBytes, cdO = adO + uint32_t(buf) * kQBytes;
    const float* cL = sL + buf * kMq;
    const float* cR = sR + buf * kMq;

    // S^T = K Q^T and dP^T = V dO^T (64 keys x 64 queries per warpgroup), two commit groups.
    float s[kMq / 2], dp[kMq / 2];
    wgmma_fence();
    wgmma_kmajor<T, kMq, D>(s, aKw, kN, cQ, kMq);
    wgmma_commit();
    wgmma_kmajor<T, kMq, D>(dp, aVw, kN, cdO, kMq);
    wgmma_commit();
    wgmma_wait<1>();
    reg_fence(s);

    // P^T: accumulator d[4 j + e] is key row key_base + 8 (e / 2), query column 8 j + 2 t + (e % 2).
    const bool need_mask = tail_keys || (p.causal && m0 < key_w + 15);
#pragma unroll
    for (int j = 0; j < kMq / 8; ++j) {
      const float2 l = *reinterpret_cast<const float2*>(cL + 8 * j + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float pv = fast_exp2(s[4 * j + e] * sl2 - ((e & 1) ? l.y : l.x));
        if (need_mask) {
          const int key = key_base + (e >> 1) * 8, qr = m0 + 8 * j + 2 * t + (e & 1);
          if (key >= si.nk || (p.causal && qr < key)) pv = 0.f;
        }
        s[4 * j + e] = pv;
      }
    }
    wgmma_wait<0>();
    reg_fence(dp);
    uint32_t pa[kMq / 16][4], da[kMq / 16][4];
#pragma unroll
    for (int j = 0; j < kMq / 8; ++j) {
      const float2 r = *reinterpret_cast<const float2*>(cR + 8 * j + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - ((e & 1) ? r.y : r.x));
    }
#pragma unroll
    for (int kk = 0; kk < kMq / 16; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        pa[kk][r] = Op::pack(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
        da[kk][r] = Op::pack(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
      }
    }
    // dV += P^T dO and dK += dS^T Q: dO and Q read N-major (16 queries = 2048 bytes per k-step, the D / 64
    // column blocks kMq * 128 bytes apart).
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kMq / 16; ++kk)
      Wgmma<T, D>::rs(dv, pa[kk], smem_desc(cdO + uint32_t(kk) * 2048u, uint32_t(kMq) * 128u, 1024u), 1);
#pragma unroll
    for (int kk = 0; kk < kMq / 16; ++kk)
      Wgmma<T, D>::rs(dk, da[kk], smem_desc(cQ + uint32_t(kk) * 2048u, uint32_t(kMq) * 128u, 1024u), 1);
    wgmma_commit();
    // dS^T to shared memory while those run: da[kk][0] / [2] are key row r, query columns 16 kk + 2 t
    // and + 8; [1] / [3] the same for key row r + 8.
    {
      const int r = wg * 64 + warp * 16 + g;
#pragma unroll
      for (int kk = 0; kk < kMq / 16; ++kk) {
        const int c = 16 * kk + 2 * t;
        *reinterpret_cast<uint32_t*>(sdS + tile_off<kN>(r, c)) = da[kk][0];
        *reinterpret_cast<uint32_t*>(sdS + tile_off<kN>(r + 8, c)) = da[kk][1];
        *reinterpret_cast<uint32_t*>(sdS + tile_off<kN>(r, c + 8)) = da[kk][2];
        *reinterpret_cast<uint32_t*>(sdS + tile_off<kN>(r + 8, c + 8)) = da[kk][3];
      }
    }
    fence_proxy_async();
    if constexpr (kBulkDq) {
      if (tid == 0) bulk_wait_read();  // the previous tile's reduce has read the dQ tile
    }
    __syncthreads();  // dS^T of both warpgroups is in shared memory (and the dQ tile is free)

    // dQ = dS K, M = the 64 queries: A = dS^T read M-major (16 keys = 2048 bytes per k-step), B = K read
    // N-major. D = 128: this warpgroup's 64-column block of D, all 128 keys; D = 64: all of D, its 64 keys.
    constexpr int kDqSteps = D == 128 ? kN / 16 : 4;
    const uint32_t key_off = D == 128 ? 0u : uint32_t(wg) * 64u * 128u;
    const uint32_t col_off = D == 128 ? uint32_t(wg) * (kN * 128u) : 0u;
    float dq[32];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kDqSteps; ++kk) {
      const uint64_t a = smem_desc(aS + key_off + uint32_t(kk) * 2048u, kN * 128u, 1024u);
      const uint64_t bk = smem_desc(aK + col_off + key_off + uint32_t(kk) * 2048u, kN * 128u, 1024u);
      Wgmma<T, 64>::ss_tt(dq, a, bk, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(dq);
    reg_fence(dk);
    reg_fence(dv);
    reg_fence_u(pa);  // A operands of the dV / dK wgmmas: live until those retired
    reg_fence_u(da);
    if constexpr (kBulkDq) {
      // This warpgroup's 64 columns of the [kMq][D] tile; the next tile's first barrier publishes it.
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float* row = sDq + (warp * 16 + g + 8 * i) * D + wg * 64 + 2 * t;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          *reinterpret_cast<float2*>(row + nt * 8) = make_float2(dq[4 * nt + 2 * i], dq[4 * nt + 2 * i + 1]);
      }
      fence_proxy_async();
      dq_dst = dq_acc + (lse_offset(p, b, hq, si.q0) + m0) * D;
      dq_bytes = uint32_t(min(kMq, si.nq - m0)) * uint32_t(D * 4);
    } else {
      float* dqh = dq_acc + (lse_offset(p, b, hq, si.q0) + m0) * D + (D == 128 ? wg * 64 : 0);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = warp * 16 + g + 8 * i;
        if (m0 + r >= si.nq) continue;
        float* dst = dqh + int64_t(r) * D + 2 * t;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) red_add2(dst + nt * 8, dq[4 * nt + 2 * i], dq[4 * nt + 2 * i + 1]);
      }
    }
  }
  if constexpr (kBulkDq) {
    __syncthreads();  // the last tile's dQ is in shared memory
    if (tid == 0 && dq_bytes > 0) {
      bulk_reduce_add_f32(dq_dst, smem_u32(sDq), dq_bytes);
      bulk_wait_all();
    }
  }

  cp_async_wait_all();
  // The m64n{D} accumulator's element 4 dn + e is the m16n8 fragment's element e of column block dn.
  store_dkdv_rows<T, D, Op>(p, si, b, hk, key_base, t, [&](int dn, int e) { return dk[4 * dn + e]; },
                            [&](int dn, int e) { return dv[4 * dn + e]; });
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// ---- launchers -----------------------------------------------------------------------------------
template <class T, int D, int kN>
void forward_sm90_impl(const AttnProblem& p, cudaStream_t s) {
  constexpr int smem = Sm90Cfg<T, D, kN>::smem_bytes;
  auto kernel = flash_fwd_sm90_kernel<T, D, kN>;
  MC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(unsigned((p.seqlen_q + kM - 1) / kM), unsigned(p.heads), unsigned(p.batch));
  kernel<<<grid, kThreads, smem, s>>>(p);
  MC_CUDA_CHECK_LAUNCH();
}

template <class T, int D, int kN, int kStages, bool kPingPong>
void forward_sm90_ws_impl(const AttnProblem& p, cudaStream_t s) {
  constexpr int smem = Sm90WsCfg<T, D, kN, kStages>::smem_bytes;
  auto kernel = flash_fwd_sm90_ws_kernel<T, D, kN, kStages, kPingPong>;
  MC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(unsigned((p.seqlen_q + kM - 1) / kM), unsigned(p.heads), unsigned(p.batch));
  kernel<<<grid, kWsThreads, smem, s>>>(p);
  MC_CUDA_CHECK_LAUNCH();
}

template <class T, int D, int kN>
void forward_sm90_variant(const AttnProblem& p, cudaStream_t s) {
  if (p.sm90_variant == 1) forward_sm90_ws_impl<T, D, kN, 2, false>(p, s);
  else if (p.sm90_variant == 2) forward_sm90_ws_impl<T, D, kN, 3, false>(p, s);
  else if (p.sm90_variant == 3) forward_sm90_ws_impl<T, D, kN, 2, true>(p, s);
  else if (p.sm90_variant == 4) forward_sm90_ws_impl<T, D, kN, 3, true>(p, s);
  else forward_sm90_impl<T, D, kN>(p, s);
}

template <class T, int D>
void forward_sm90_tiles(const AttnProblem& p, cudaStream_t s) {
  if (p.sm90_block_n == 64) forward_sm90_variant<T, D, 64>(p, s);
  else forward_sm90_variant<T, D, 128>(p, s);
}

template <class T, int D, bool kBulkDq>
void backward_sm90_impl(const AttnProblem& p, const float* dsum, float* dq_acc, cudaStream_t s) {
  constexpr int smem = Sm90BwdCfg<T, D, kBulkDq>::smem_bytes;
  auto kernel = flash_bwd_sm90_kernel<T, D, kBulkDq>;
  MC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(unsigned((p.seqlen_kv + kBwdN - 1) / kBwdN), unsigned(p.kv_heads), unsigned(p.batch));
  kernel<<<grid, kThreads, smem, s>>>(p, dsum, dq_acc);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool flash_sm90_built() {
#ifdef MEGACORE_FLASH_SM90
  return true;
#else
  return false;
#endif
}

std::string flash_sm90_unsupported_reason(const AttnProblem& p, int device) {
  if (!flash_sm90_built())
    return "this build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES must name 90a for the wgmma kernel)";
  std::string why = flash_unsupported_reason(p);
  if (!why.empty()) return why;
  if (p.sm90_block_n != 0 && p.sm90_block_n != 64 && p.sm90_block_n != 128)
    return fmt::format("sm90_block_n {} (supported: 0 for the default, 64, 128)", p.sm90_block_n);
  if (p.sm90_variant < 0 || p.sm90_variant > 4)
    return fmt::format("sm90_variant {} (supported: 0 CTA-synchronous, 1 / 2 warp-specialized with 2 / 3 "
                       "stages, 3 / 4 the same with ping-pong warpgroup scheduling)", p.sm90_variant);
  if (p.sm90_bwd_variant < 0 || p.sm90_bwd_variant > 1)
    return fmt::format("sm90_bwd_variant {} (supported: 0 dQ through shared memory and one bulk reduce-add per "
                       "tile, 1 dQ added by every thread)", p.sm90_bwd_variant);
  int major = 0, minor = 0;
  MC_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MC_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0)
    return fmt::format("device {} is sm_{}{}; the wgmma kernel runs on sm_90 (H100/H200) only", device, major, minor);
  return "";
}

void flash_forward_sm90(const AttnProblem& p, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  if (p.batch == 0 || p.seqlen_q == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::BF16) {
    if (p.head_dim == 64) forward_sm90_tiles<__nv_bfloat16, 64>(p, s);
    else forward_sm90_tiles<__nv_bfloat16, 128>(p, s);
  } else {
    if (p.head_dim == 64) forward_sm90_tiles<__half, 64>(p, s);
    else forward_sm90_tiles<__half, 128>(p, s);
  }
}

void flash_backward_sm90_main(const AttnProblem& p, const float* dsum, float* dq_acc, void* stream) {
  if (p.batch == 0 || p.seqlen_kv == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::BF16) {
    if (p.head_dim == 64) backward_sm90_impl<__nv_bfloat16, 64, false>(p, dsum, dq_acc, s);
    else if (p.sm90_bwd_variant == 1) backward_sm90_impl<__nv_bfloat16, 128, false>(p, dsum, dq_acc, s);
    else backward_sm90_impl<__nv_bfloat16, 128, true>(p, dsum, dq_acc, s);
  } else {
    if (p.head_dim == 64) backward_sm90_impl<__half, 64, false>(p, dsum, dq_acc, s);
    else if (p.sm90_bwd_variant == 1) backward_sm90_impl<__half, 128, false>(p, dsum, dq_acc, s);
    else backward_sm90_impl<__half, 128, true>(p, dsum, dq_acc, s);
  }
}

}  // namespace megacore::ops::cuda
