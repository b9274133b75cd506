// megacore's Hopper grouped GEMM: all groups (experts) of a MoE layer's forward, dgrad or wgrad in one
// persistent, warp-specialised launch (wgmma + TMA, sm_90a). Interface and operand shapes:
// grouped_gemm_sm90.hpp.
//
// Why a kernel of our own: cuBLAS has no grouped kernel that writes bf16 products into an f32 main grad
// (wgrad with beta), and one cuBLASLt GEMM per expert leaves the f32 read-modify-write of each output
// tile exposed after its main loop (at 1024 rows per expert that epilogue moves about as many bytes per
// tile as the loop multiplies). Here two consumer warpgroups take turns on tiles (ping-pong): while one
// runs its tile's main loop the other writes the previous tile, so the epilogue hides behind the tensor
// cores. Fine-grained experts (tens of rows each) gain most from the single launch: every expert's tiles
// are in one stream of work over all SMs.
//
// Tiles: 128 x 128 outputs, 64-deep k-blocks, kStages shared-memory stages of A and B (32 KiB each; 40 KiB
// where wide tail tiles, below, run).
// CTA = 3 warpgroups: warpgroup 0 produces (one thread issues every TMA load), warpgroups 1 and 2
// consume alternate tiles of the CTA's list (tile t, t + grid, t + 2 grid, ...). The producer and both
// consumers walk the same list, so all agree on which stage and phase each k-block uses.
//   full[s]:  count 1 (the producer's arrive.expect_tx of the k-block's bytes); TMA completes them.
//   empty[s]: count 4 (lane 0 of each warp of the consuming warpgroup, after wgmma.wait_group has
//             retired the wgmmas that read the stage).
//   named barriers 3 and 4 (256 threads): consumer 1 - cw arrives at 3 + cw when it has issued its tile's
//             main loop; consumer cw syncs there before its next tile's main loop (the tiles' main loops
//             run in the CTA's tile order, one warpgroup at a time, the other meanwhile in its epilogue).
//
// Operands (D[m][n] = sum_k A[m][k] B[n][k]) and their shared-memory layouts, all 128-byte swizzled
// (what a TMA box with SWIZZLE_128B writes; the same layouts as flash_attention_sm90.cu, see there):
//   forward  M = the group's rows, N = mo, K = k:  A = x  (K-major), B = w_g  (K-major)
//   dgrad    M = the group's rows, N = k,  K = mo: A = dy (K-major), B = w_g  (MN-major: w_g[kk][n])
//   wgrad    M = mo, N = k, K = the group's rows:  A = dy (MN-major: dy[r][m]), B = x (MN-major)
// K-major tile [128][64]: one box {64, 128}; rows of 128 bytes, SBO 1024 (8-row atoms), a k-step of 16
// elements = +32 bytes. MN-major tile [64 k][128]: two boxes {64, 64} (8 KiB each, one per 64-wide half
// of M or N), LBO = 8 KiB between the halves, SBO = 1024 between 8-k-row atoms, a k-step = +2048 bytes.
// The forward's and dgrad's weight maps are 3-D {k, mo, groups}, so a box never reads into the next
// expert's weight (rows past mo are zero-filled); x and dy are 2-D over all rows. A forward/dgrad tile's
// rows past its group's end belong to the next group: they are multiplied but never stored. With 256 or more
// rows per group on average, a group's last 1-64 rows go in 64 x 256 tiles instead (A 64 rows, B two 128-column
// boxes; the second accumulator holds columns 128-255 instead of rows 64-127), which multiplies at most 63 of the
// next group's rows there instead of 64-127; the stages are then 40 KiB and five (decode, grouped_sm90()). In the wgrad
// the rows are the reduction, so the k-block at a group's end has its foreign rows zeroed in shared memory
// by the consuming warpgroup before its wgmmas (then fence.proxy.async and a warpgroup barrier).
//
// Epilogues: forward/dgrad (and bf16 dw, or beta outside {0, 1}) store from registers. An f32 dw with
// beta 1 goes through shared memory: with many rows per group the accumulators are staged in 16 KiB boxes
// and reduce-added into dw by TMA (L2 does the read-modify-write); with few rows (tiles that are all
// epilogue) the kernel runs with 3 stages, each freed as soon as its wgmmas are done; the producer loads each
// tile's dw box (64 KiB, four 16 KiB chunks) by TMA (from 256 rows per group on a warp of its own, each chunk as
// soon as the consumer's previous epilogue has read that chunk), and the consumer adds its accumulators to the
// box's values chunk by chunk and stores the sums to dw from registers (a TMA store of the box measured 2-8 %
// slower). When no group has more than 256 rows (kInit: at most four k-blocks per tile), warp 1 of the producer
// loads each box part as soon as the consumer's store of its tile two before has read it; the consumer reads its
// box into the accumulators before its main loop (the wgmmas then add to the main grad; one k-block of wgmmas stays
// in flight), writes the sums back into the box and stores it by TMA. Beta 0 stores the staged boxes by TMA. See
// grouped_sm90() for the rows-per-group bounds.
#include <cuda.h>  // CUtensorMap and its enums; the encoder comes through cudaGetDriverEntryPointByVersion
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "ops/cuda/grouped_gemm_sm90.hpp"
#include "ops/cuda/sm90_common.cuh"

// Device code exists only for sm_90a (wgmma, setmaxnreg). The library defines MEGACORE_GROUPED_SM90 when
// CMAKE_CUDA_ARCHITECTURES names 90a; without it grouped_sm90_unsupported says so.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MC_GG_DEVICE 1
#else
#define MC_GG_DEVICE 0
#endif

namespace megacore::ops::cuda {
namespace {

using namespace sm90;  // fences, mbarriers, named barriers, smem_desc (sm90_common.cuh)

constexpr int kBM = 128, kBN = 128, kBK = 64;
constexpr int kThreadsGG = 384;
constexpr int kTmaEpilogueMinRows = 512;      // beta 0: mean rows per group from which dw is stored by TMA
constexpr int kReduceEpilogueMinRows = 1024;  // beta 1: from here the TMA reduce-add, below it the staged box
constexpr int kStagedPartsMinRows = 256;      // the staged box: from here in four parts, below it in one
constexpr int kInitMaxRows = 256;            // the staged box: with every group at most this many rows, it is
                                              // where the accumulators start (kInit)
constexpr int kWideMinRows = 256;             // forward / dgrad: mean rows per group from which tails go wide
constexpr uint32_t kStageBytes = uint32_t((kBM + kBN) * kBK * 2);  // 32 KiB
constexpr uint32_t kHalfBytes = 8192;                               // one MN-major 64 x 64 box
// Stages, the mbarriers (padded to 1 KiB), two 16 KiB staging boxes for the TMA epilogue, 1 KiB to align.
// kStaged (wgrad, f32, beta 1, few rows per group): 3 stages and, per consumer, a 64 KiB box of the tile's main
// grad that the producer loads by TMA (ahead of the epilogue, or with kInit ahead of the main loop); else 6
// stages and two 16 KiB staging boxes.
// kWide (forward / dgrad with wide tail tiles, see decode): 5 stages of 40 KiB (a wide tile's k-block is 8 KiB of A
// and 32 KiB of B), no staging boxes.
constexpr uint32_t kWideStageBytes = 40960;
template <bool kStaged, bool kWide = false>
__host__ __device__ constexpr int stages_of() { return kWide ? 5 : kStaged ? 3 : 6; }
template <bool kStaged, bool kWide = false>
constexpr int smem_bytes_of() {
  return kWide ? int(stages_of<false, true>() * kWideStageBytes) + 1024 + 1024
               : int(stages_of<kStaged>() * kStageBytes) + 1024 + (kStaged ? 2 * 65536 : 2 * 16384) + 1024;
}
static_assert(smem_bytes_of<true>() <= 232448 && smem_bytes_of<false>() <= 232448 &&
                  smem_bytes_of<false, true>() <= 232448,
              "more shared memory than an H100/H200 block may have");

enum KindId : int { kFwd = 0, kDgrad = 1, kWgrad = 2 };

struct Params {
  CUtensorMap ta, tb;
  CUtensorMap ta64;  // forward / dgrad with wide tiles: A with a box of 64 rows
  CUtensorMap tc;  // f32 wgrad with beta 0 or 1: dw as {k, mo, groups}, box {32, 128, 1}, 128-byte swizzle
  int tma_out;     // 0: stores from registers; 1: TMA store; 2: TMA reduce-add (beta 1); 3: staged (kStaged)
  void* out;
  int64_t ld_out;        // elements between output rows
  int64_t group_stride;  // wgrad: elements between dw_g and dw_g+1
  int m_fixed, n_fixed;  // wgrad: M = mo; all: N
  int k_fixed;           // forward / dgrad: the reduction length
  int n_tiles, m_tiles_fixed;
  int tiles;
  float beta;
  int32_t off[kGroupedSm90MaxGroups + 1];
  int32_t tile_start[kGroupedSm90MaxGroups + 1];
};

struct Tile {
  int g, m0, n0, kblocks;
  int wide;     // forward/dgrad: a 64 x 256 tile (a group's last rows when at most 64 remain), else 128 x 128
  int row_end;  // forward/dgrad: rows >= row_end are not stored; wgrad: the group's last row + 1
  int k0;       // wgrad: the group's first row (the k-blocks start there)
};

// Tile (mt, nt) of the local-th tile of an m_tiles x n_tiles grid, in bands of kBand m-tiles: down a band's
// m-tiles first, then across its n-tiles, then the next band. The CTAs running at one time then cover about
// kBand x (SMs / kBand) tiles, whose A rows and B columns stay in L2 (in plain m- or n-fastest order a large
// group's whole A or B streams through L2 for every few tiles: 4096 rows per expert ran at 0.7x of dense).
constexpr int kBand = 8;
__device__ __forceinline__ void band_order(int local, int m_tiles, int n_tiles, int& mt, int& nt) {
  const int per_band = kBand * n_tiles;
  const int b = local / per_band, idx = local % per_band;
  const int rows = min(kBand, m_tiles - b * kBand);
  mt = b * kBand + idx % rows;
  nt = idx / rows;
}

// Forward / dgrad with kWide: a group whose rows leave a remainder of 1-64 past its last full 128-row tile takes
// that remainder in 64 x 256 tiles (one per two n-tiles, after its 128 x 128 tiles): the same multiply-adds per
// k-block as a 128 x 128 tile, padding at most 63 rows where a 128-row tile would pad 64-127 (with an odd number of
// n-tiles the last wide tile's second half lies past N).
__host__ __device__ constexpr bool wide_tail(int rows) { return rows % kBM != 0 && rows % kBM <= kBM / 2; }
// A forward/dgrad group's 128-row m-tiles (wide: a run with wide tails). Rows past them are its wide tail, in
// (n_tiles + 1) / 2 tiles after them; the host's tile count and decode both follow this.
__host__ __device__ constexpr int m_tiles_of(int rows, bool wide) {
  return wide && wide_tail(rows) ? rows / kBM : (rows + kBM - 1) / kBM;
}

template <int Kind, bool kWide = false>
__device__ __forceinline__ Tile decode(const Params& p, int t, int& g) {
  while (t >= p.tile_start[g + 1]) ++g;
  const int local = t - p.tile_start[g];
  Tile x;
  x.g = g;
  x.wide = 0;
  x.row_end = p.off[g + 1];
  if constexpr (Kind == kWgrad) {
    int mt, nt;
    band_order(local, p.m_tiles_fixed, p.n_tiles, mt, nt);
    x.m0 = mt * kBM, x.n0 = nt * kBN;
    x.k0 = p.off[g];
    x.kblocks = (p.off[g + 1] - p.off[g] + kBK - 1) / kBK;
  } else {
    const int mt_g = m_tiles_of(p.off[g + 1] - p.off[g], kWide);
    if (local < mt_g * p.n_tiles) {
      int mt, nt;
      band_order(local, mt_g, p.n_tiles, mt, nt);
      x.m0 = p.off[g] + mt * kBM, x.n0 = nt * kBN;
    } else {
      x.wide = 1;
      x.m0 = p.off[g] + mt_g * kBM, x.n0 = (local - mt_g * p.n_tiles) * 2 * kBN;
    }
    x.k0 = 0;
    x.kblocks = (p.k_fixed + kBK - 1) / kBK;
  }
  return x;
}

#if MC_GG_DEVICE
__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
// Arrives only where pred holds, without a branch (a divergent branch between wgmmas makes ptxas serialise them).
__device__ __forceinline__ void mbar_arrive_if(uint32_t bar, bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
               "r"(int(pred))
               : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// Bulk tensor store / reduce-add of a shared-memory box into global memory (issuing thread only), and the
// waits for its shared-memory reads and for its completion.
template <bool kAdd>
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
  if constexpr (kAdd) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
            reinterpret_cast<uint64_t>(map)),
        "r"(src), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
  } else {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
  }
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int N = 0>  // at most N bulk groups still reading shared memory
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// wgmma.mma_async m64n128k16 f32 += bf16 · bf16, both operands from shared memory; TA / TB = 1 read A / B
// MN-major (imm-trans). acc = 0 overwrites d.
template <int TA, int TB>
__device__ __forceinline__ void mma_128(float (&d)[64], uint64_t da, uint64_t db, int acc) {
#define MC_GG_F8(i)                                                                                  \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),       \
      "+f"(d[i + 6]), "+f"(d[i + 7])
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, %67, %68;\n}\n"
      : MC_GG_F8(0), MC_GG_F8(8), MC_GG_F8(16), MC_GG_F8(24), MC_GG_F8(32), MC_GG_F8(40), MC_GG_F8(48),
        MC_GG_F8(56)
      : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
#undef MC_GG_F8
}
#endif  // MC_GG_DEVICE


#if MC_GG_DEVICE
// Epilogue of one 64-row half: the thread holds rows row0 and row0 + 8, columns col0 + 8 j (+ 1) for
// j < 16 (d[4 j + 2 h + e] is row row0 + 8 h, column col0 + 8 j + e). Rows >= m_lim and columns >= N are
// not written. f32 output with beta: out = d + beta * out (all of a row's loads before its stores).
template <int Kind, class TO>
__device__ __forceinline__ void store_half(const Params& p, const float (&d)[64], TO* out, int row0, int col0,
                                           int m_lim) {
  const bool acc = Kind == kWgrad && p.beta != 0.f;
  const float b = acc ? p.beta : 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    if (row >= m_lim) continue;
    TO* orow = out + int64_t(row) * p.ld_out;
    float2 c[16];  // the row's loads first, then its stores
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int col = col0 + 8 * j;
      const bool in = acc && col < p.n_fixed;
      if constexpr (std::is_same_v<TO, float>) {
        c[j] = in ? *reinterpret_cast<const float2*>(orow + col) : make_float2(0.f, 0.f);
      } else {
        c[j] = in ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(orow + col)) : make_float2(0.f, 0.f);
      }
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int col = col0 + 8 * j;
      if (col >= p.n_fixed) continue;
      const float v0 = d[4 * j + 2 * h] + b * c[j].x, v1 = d[4 * j + 2 * h + 1] + b * c[j].y;
      if constexpr (std::is_same_v<TO, float>) {
        *reinterpret_cast<float2*>(orow + col) = make_float2(v0, v1);
      } else {
        *reinterpret_cast<__nv_bfloat162*>(orow + col) = __floats2bfloat162_rn(v0, v1);
      }
    }
  }
}
#endif

#if MC_GG_DEVICE
// f(shared address, value, value) for each accumulator pair of 32-column chunk ch of the 128 x 128 tile (the
// two accumulators by reference), at its place in a box of 128 rows x 32 f32 (rows of 128 bytes, 16-byte chunk c
// of row r at c ^ (r % 8): the 128-byte swizzle of the f32 TMA map). Thread (warp, gq, tq) holds rows
// 16 warp + gq (+ 8) of each 64-row half and columns 8 j + 2 tq (+ 1): d[4 j + 2 h + e] is (row + 8 h, column + e).
template <class F>
__device__ __forceinline__ void chunk_pairs(uint32_t box, int ch, int warp, int gq, int tq, float (&d0)[64],
                                            float (&d1)[64], F&& f) {
#pragma unroll
  for (int mh = 0; mh < 2; ++mh) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mh * 64 + warp * 16 + gq + 8 * h;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * ch + jj, chunk = 2 * jj + tq / 2;
        const uint32_t addr = box + uint32_t(r) * 128u + uint32_t((chunk ^ (r & 7)) * 16 + (tq & 1) * 8);
        f(addr, mh == 0 ? d0[4 * j + 2 * h] : d1[4 * j + 2 * h], mh == 0 ? d0[4 * j + 2 * h + 1] : d1[4 * j + 2 * h + 1]);
      }
    }
  }
}
#endif

template <int Kind, class TO, bool kStaged, int kParts = 1, bool kInit = false, bool kWide = false>
__global__ void __launch_bounds__(kThreadsGG, 1) grouped_sm90_kernel(const __grid_constant__ Params p) {
#if MC_GG_DEVICE
  static_assert(!kWide || (Kind != kWgrad && !kStaged), "wide tiles are for the forward and dgrad");
  constexpr int kStages = stages_of<kStaged, kWide>();
  constexpr uint32_t kSB = kWide ? kWideStageBytes : kStageBytes;  // stage stride
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  // Stage s at base + s * kSB: a 128 x 128 tile's A (16 KiB) then its B (16 KiB); a wide tile's A (64 rows, 8 KiB)
  // then its B (256 columns, 32 KiB).
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t bars = base + kStages * kSB;  // then 1 KiB of barriers, then the staging boxes
  auto full = [&](int s) { return bars + uint32_t(s) * 8u; };
  auto empty = [&](int s) { return bars + uint32_t(kStages + s) * 8u; };
  // kStaged: consumer c's main-grad box at cbox(c), four 16 KiB chunks of 32 columns, loaded and freed in kParts
  // parts (1: the whole box, 4: chunk by chunk); cfull(c, part) completes when the part's TMA loads landed,
  // cempty(c, part) when every thread of the consumer has read it.
  static_assert(kParts == 1 || kParts == 4, "the staged box goes in one part or four");
  static_assert(!kInit || (kStaged && kParts == 4), "kInit is a way of running the staged box, in four parts");
  auto part = [](int ch) { return kParts == 4 ? ch : 0; };
  auto cbox = [&](int c) { return bars + 1024u + uint32_t(c) * 65536u; };
  auto cfull = [&](int c, int ch) { return bars + uint32_t(2 * kStages + 4 * c + ch) * 8u; };
  auto cempty = [&](int c, int ch) { return bars + uint32_t(2 * kStages + 8 + 4 * c + ch) * 8u; };
  // The staged box without kInit frees each stage as soon as its own wgmmas are done (see the consumer's loop).
  constexpr bool kFreeEach = kStaged && !kInit;
  constexpr int kTA = Kind == kWgrad ? 1 : 0;
  constexpr int kTB = Kind == kFwd ? 0 : 1;

  // Broadcast from lane 0, so ptxas knows them warp-uniform: branches on them are not divergent (after a
  // divergent branch it serialises the wgmmas).
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
  const int warp = __shfl_sync(0xffffffffu, (int(threadIdx.x) / 32) % 4, 0), lane = int(threadIdx.x) % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(full(s), 1), mbar_init(empty(s), 4);
    if (kStaged)
      for (int c = 0; c < 2; ++c)
        for (int ch = 0; ch < kParts; ++ch) mbar_init(cfull(c, ch), 1), mbar_init(cempty(c, ch), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    // kStaged: the tile's main grad into its consumer's box (use j = i / 2 of that box), each part as soon as
    // the consumer is done with it for the tile before. In one part warp 0 loads it before the tile's k-blocks (the
    // box is then the longer wait: few k-blocks per tile); in four, warp 1 does (below).
    auto load_box = [&](const Tile& x, int i) {
      const int c = i & 1, j = i >> 1;
      for (int ch = 0; ch < 4; ++ch) {
        if (kParts == 4 || ch == 0) {
          mbar_wait(cempty(c, part(ch)), uint32_t(j & 1) ^ 1u);
          mbar_expect_tx(cfull(c, part(ch)), 65536u / kParts);
        }
        tma_3d(cbox(c) + uint32_t(ch) * 16384u, &p.tc, x.n0 + 32 * ch, x.m0, x.g, cfull(c, part(ch)));
      }
    };
    if (warp == 0 && lane == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.ta)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.tb)) : "memory");
      if (p.tma_out) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.tc)) : "memory");
      if (kWide) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.ta64)) : "memory");
      int it = 0, g = 0, i = 0;
      for (int t = int(blockIdx.x); t < p.tiles; t += int(gridDim.x), ++i) {
        const Tile x = decode<Kind, kWide>(p, t, g);
        if constexpr (kStaged && !kInit && kParts == 1) load_box(x, i);
        for (int kb = 0; kb < x.kblocks; ++kb, ++it) {
          const int s = it % kStages;
          mbar_wait(empty(s), uint32_t((it / kStages) & 1) ^ 1u);
          const uint32_t a = base + uint32_t(s) * kSB, b = a + kBM * kBK * 2;
          if (kWide && x.wide) {
            // 64 rows of A, then B for 256 columns (two 128-column boxes; columns past N are zero-filled)
            const uint32_t wb = a + 64 * kBK * 2;
            mbar_expect_tx(full(s), kWideStageBytes);
            tma_2d(a, &p.ta64, kb * kBK, x.m0, full(s));
            for (int h = 0; h < 2; ++h) {
              if constexpr (Kind == kFwd) {
                tma_3d(wb + uint32_t(h) * 16384u, &p.tb, kb * kBK, x.n0 + h * kBN, x.g, full(s));
              } else {
                tma_3d(wb + uint32_t(h) * 16384u, &p.tb, x.n0 + h * kBN, kb * kBK, x.g, full(s));
                tma_3d(wb + uint32_t(h) * 16384u + kHalfBytes, &p.tb, x.n0 + h * kBN + 64, kb * kBK, x.g, full(s));
              }
            }
            continue;
          }
          mbar_expect_tx(full(s), kStageBytes);
          if constexpr (Kind == kFwd) {
            tma_2d(a, &p.ta, kb * kBK, x.m0, full(s));
            tma_3d(b, &p.tb, kb * kBK, x.n0, x.g, full(s));
          } else if constexpr (Kind == kDgrad) {
            tma_2d(a, &p.ta, kb * kBK, x.m0, full(s));
            tma_3d(b, &p.tb, x.n0, kb * kBK, x.g, full(s));
            tma_3d(b + kHalfBytes, &p.tb, x.n0 + 64, kb * kBK, x.g, full(s));
          } else {
            const int r = x.k0 + kb * kBK;
            tma_2d(a, &p.ta, x.m0, r, full(s));
            tma_2d(a + kHalfBytes, &p.ta, x.m0 + 64, r, full(s));
            tma_2d(b, &p.tb, x.n0, r, full(s));
            tma_2d(b + kHalfBytes, &p.tb, x.n0 + 64, r, full(s));
          }
        }
      }
    } else if (kStaged && kParts == 4 && warp == 1 && lane == 0) {
      // Boxes in four parts on a warp of their own, each part as soon as its consumer is done with it for tile i - 2
      // (with kInit: its store has read it; else its epilogue has), so warp 0 never waits on an epilogue before
      // issuing k-blocks (on one H200, with the stage release in the consumers' loop, 128 experts at 256-512 rows
      // per expert: 3-11 % faster than the parts loaded by warp 0 after each tile's k-blocks). kInit needs its box
      // before the main loop, the others before the epilogue.
      int g = 0, i = 0;
      for (int t = int(blockIdx.x); t < p.tiles; t += int(gridDim.x), ++i) load_box(decode<Kind, kWide>(p, t, g), i);
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int cw = wg - 1;  // this consumer's turn: local tiles i with i % 2 == cw
  const int tid = int(threadIdx.x) % 128;
  const int gq = lane / 4, tq = lane % 4;
  float d0[64], d1[64];
  // The other consumer's tiles are skipped by adding their k-blocks to `it` (decoded with their own group
  // cursor gs); the loop has no data-dependent branch around the wgmmas (ptxas would serialise them).
  int it = 0, g = 0, gs = 0, own = 0;
  const int step = int(gridDim.x);
  int t = int(blockIdx.x);
  if (cw == 1) {  // consumer 1 starts one tile later (blockIdx.x < p.tiles: the grid is at most the tiles)
    it += decode<Kind, kWide>(p, t, gs).kblocks;
    t += step;
  }
  for (; t < p.tiles; t += 2 * step) {
    const Tile x = decode<Kind, kWide>(p, t, g);
    // Where the second accumulator's operands sit in a stage: a 128 x 128 tile's d1 is A's rows 64-127 times the
    // same B; a wide tile's d1 is the same 64 rows of A times B's columns 128-255. Plain offsets, so the wgmmas
    // are the same instructions for both (no branch between them).
    const bool wide = kWide && x.wide;
    const uint32_t a1_off = wide ? 0u : 64u * 128u, b_off = wide ? 64u * kBK * 2u : uint32_t(kBM * kBK * 2),
                   b1_off = wide ? 16384u : 0u;
    // Main loops take turns in the CTA's tile order: this one starts after the other consumer has issued
    // the previous tile's (named barrier 3 + cw, which the other arrives at). Besides handing the tensor
    // cores to one warpgroup while the other stores, this keeps every full-barrier wait at most one phase
    // ahead of the barrier (a parity wait two phases ahead would return at once).
    if constexpr (kInit) {
      // The tile's main grad (in this consumer's box, from warp 1 of the producer) is where the accumulators
      // start: the wgmmas add the tile's product to it and the epilogue only stores. Read before this consumer's
      // turn on the tensor cores, while the other consumer's main loop runs.
      const uint32_t box = cbox(cw);
#pragma unroll
      for (int ch = 0; ch < 4; ++ch) {
        mbar_wait(cfull(cw, ch), uint32_t(own & 1));
        chunk_pairs(box + uint32_t(ch) * 16384u, ch, warp, gq, tq, d0, d1, [](uint32_t addr, float& v0, float& v1) {
          asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v0), "=f"(v1) : "r"(addr) : "memory");
        });
      }
    }
    if (t != int(blockIdx.x)) named_bar_sync(3 + cw, 256);
    wgmma_fence();  // the accumulators were read by the previous tile's epilogue
    for (int kb = 0; kb < x.kblocks; ++kb, ++it) {
      const int s = it % kStages;
      mbar_wait(full(s), uint32_t((it / kStages) & 1));
      const uint32_t a = base + uint32_t(s) * kSB, b = a + b_off;
      if constexpr (Kind == kWgrad) {
        const int valid = x.row_end - (x.k0 + kb * kBK);
        if (valid < kBK) {  // the group ends inside this k-block: zero the next group's rows
          const int bad = kBK - valid, per_box = bad * 8;  // 16-byte chunks per box
          for (int c = tid; c < 4 * per_box; c += 128) {
            const int box = c / per_box, rem = c % per_box;
            const uint32_t addr = a + uint32_t(box) * kHalfBytes + uint32_t(valid + rem / 8) * 128u +
                                  uint32_t(rem % 8) * 16u;
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
          }
          fence_proxy_async();
          named_bar_sync(1 + cw, 128);
        }
      }
#pragma unroll
      for (int ks = 0; ks < kBK / 16; ++ks) {
        uint64_t da0, da1, db0, db1;
        if constexpr (kTA == 0) {
          da0 = smem_desc(a + uint32_t(ks) * 32u, 16u, 1024u);
          da1 = smem_desc(a + a1_off + uint32_t(ks) * 32u, 16u, 1024u);
        } else {
          da0 = smem_desc(a + uint32_t(ks) * 2048u, kHalfBytes, 1024u);
          da1 = smem_desc(a + kHalfBytes + uint32_t(ks) * 2048u, kHalfBytes, 1024u);
        }
        if constexpr (kTB == 0) {
          db0 = smem_desc(b + uint32_t(ks) * 32u, 16u, 1024u);
          db1 = smem_desc(b + b1_off + uint32_t(ks) * 32u, 16u, 1024u);
        } else {
          db0 = smem_desc(b + uint32_t(ks) * 2048u, kHalfBytes, 1024u);
          db1 = smem_desc(b + b1_off + uint32_t(ks) * 2048u, kHalfBytes, 1024u);
        }
        const int acc = (kInit || kb > 0 || ks > 0) ? 1 : 0;
        mma_128<kTA, kTB>(d0, da0, db0, acc);
        mma_128<kTA, kTB>(d1, da1, db1, acc);
      }
      wgmma_commit();
      if constexpr (kFreeEach) {
        // Three stages only: each is freed as soon as its own wgmmas are done, so the producer has two to fill, not
        // one (grouped_sm90_check bench2, one H200, 2026-11-29, same call: with the box loader on warp 1, 128
        // experts at 512 rows per expert fc1 / fc2 wgrad 1.90 / 0.97 ms against 2.08 / 1.09 with neither; the kInit
        // tiles, short, ran 1-3 % slower this way and keep one k-block of wgmmas in flight).
        wgmma_wait<0>();
        mbar_arrive_if(empty(it % kStages), lane == 0);
      } else if (kb > 0) {
        wgmma_wait<1>();  // k-block kb - 1's wgmmas are done: its stage is free
        mbar_arrive_if(empty((it - 1) % kStages), lane == 0);
      }
    }
    if (t + step < p.tiles) named_bar_arrive(3 + (cw ^ 1), 256);  // the next tile's main loop may start
    wgmma_wait<0>();
    reg_fence(d0);
    reg_fence(d1);
    if constexpr (!kFreeEach) mbar_arrive_if(empty((it - 1) % kStages), lane == 0);

    // Epilogue: thread (warp, gq, tq) holds rows 16 warp + gq (+ 8) of each 64-row half, columns
    // 8 j + 2 tq (+ 1) for j < 16: d[4 j + 2 h + e] is (row + 8 h, column + e).
    if constexpr (kInit) {
      // The sums into the box (each thread where its loads came from), then the box to dw by four TMA stores
      // (TMA clips rows and columns outside dw); each part goes back to the box loader once its store has read it.
      const uint32_t box = cbox(cw);
#pragma unroll
      for (int ch = 0; ch < 4; ++ch)
        chunk_pairs(box + uint32_t(ch) * 16384u, ch, warp, gq, tq, d0, d1, [](uint32_t addr, float& v0, float& v1) {
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v0), "f"(v1) : "memory");
        });
      fence_proxy_async();
      named_bar_sync(1 + cw, 128);
      if (tid == 0) {
        for (int ch = 0; ch < 4; ++ch)
          tma_store_3d<false>(&p.tc, box + uint32_t(ch) * 16384u, x.n0 + 32 * ch, x.m0, x.g);
        bulk_wait_read<3>(), mbar_arrive(cempty(cw, 0));
        bulk_wait_read<2>(), mbar_arrive(cempty(cw, 1));
        bulk_wait_read<1>(), mbar_arrive(cempty(cw, 2));
        bulk_wait_read<0>(), mbar_arrive(cempty(cw, 3));
      }
      ++own;
    } else if constexpr (kStaged) {
      // The main grad arrives in this consumer's box (same layout as the staging box, four 32-column chunks).
      const uint32_t box = cbox(cw);
      // Add the accumulators to each chunk's values and store the sums to dw from registers (no TMA store); a
      // part is free for the producer's next load as soon as every thread has read it.
      float* out = static_cast<float*>(p.out) + int64_t(x.g) * p.group_stride;
#pragma unroll
      for (int ch = 0; ch < 4; ++ch) {
        if (kParts == 4 || ch == 0) mbar_wait(cfull(cw, part(ch)), uint32_t(own & 1));
#pragma unroll
        for (int mh = 0; mh < 2; ++mh) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = mh * 64 + warp * 16 + gq + 8 * h, row = x.m0 + r;
            float* orow = out + int64_t(row) * p.ld_out;
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
              const int j = 4 * ch + jj, chunk = 2 * jj + tq / 2, col = x.n0 + 8 * j + 2 * tq;
              const uint32_t addr = box + uint32_t(ch) * 16384u + uint32_t(r) * 128u +
                                    uint32_t((chunk ^ (r & 7)) * 16 + (tq & 1) * 8);
              float c0, c1;
              asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(c0), "=f"(c1) : "r"(addr) : "memory");
              const float v0 = mh == 0 ? d0[4 * j + 2 * h] : d1[4 * j + 2 * h];
              const float v1 = mh == 0 ? d0[4 * j + 2 * h + 1] : d1[4 * j + 2 * h + 1];
              if (row < p.m_fixed && col < p.n_fixed) *reinterpret_cast<float2*>(orow + col) = make_float2(c0 + v0, c1 + v1);
            }
          }
        }
        if (kParts == 4 || ch == 3) {
          fence_proxy_async();          // these generic reads before the producer's next TMA write into the part
          named_bar_sync(1 + cw, 128);  // every thread has read the part
          if (tid == 0) mbar_arrive(cempty(cw, part(ch)));
        }
      }
      ++own;
    } else if (std::is_same_v<TO, float> && p.tma_out) {
      // Through this consumer's 16 KiB staging box (128 rows x 32 f32, 128-byte swizzle) in four column
      // chunks, each stored or reduce-added (dw += the tile, beta 1) by one bulk tensor op; TMA clips rows
      // and columns outside dw, and the L2 does the read-modify-write, so the warpgroup does not wait on it.
      const uint32_t stage = bars + 1024u + uint32_t(cw) * 16384u;  // 1024-byte aligned, see kSmemBytes
#pragma unroll
      for (int ch = 0; ch < 4; ++ch) {
        if (tid == 0) bulk_wait_read();  // the previous chunk has left the staging box
        named_bar_sync(1 + cw, 128);
        chunk_pairs(stage, ch, warp, gq, tq, d0, d1, [](uint32_t addr, float v0, float v1) {
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v0), "f"(v1) : "memory");
        });
        fence_proxy_async();
        named_bar_sync(1 + cw, 128);
        if (tid == 0) {
          if (p.tma_out == 2) {
            tma_store_3d<true>(&p.tc, stage, x.n0 + 32 * ch, x.m0, x.g);
          } else {
            tma_store_3d<false>(&p.tc, stage, x.n0 + 32 * ch, x.m0, x.g);
          }
        }
      }
    } else {
      const int m_lim = Kind == kWgrad ? p.m_fixed : x.row_end;
      TO* out = static_cast<TO*>(p.out) + (Kind == kWgrad ? int64_t(x.g) * p.group_stride : 0);
      store_half<Kind, TO>(p, d0, out, x.m0 + warp * 16 + gq, x.n0 + 2 * tq, m_lim);
      store_half<Kind, TO>(p, d1, out, x.m0 + (wide ? 0 : 64) + warp * 16 + gq, x.n0 + (wide ? kBN : 0) + 2 * tq,
                           m_lim);
    }
    if (t + step < p.tiles) it += decode<Kind, kWide>(p, t + step, gs).kblocks;
  }
  if (std::is_same_v<TO, float> && p.tma_out && tid == 0) bulk_wait_all();  // the boxes must outlive their reads
#elif defined(__CUDA_ARCH__)
  __trap();  // built for another architecture: the host never launches this (grouped_sm90_unsupported)
#endif
}

// ---- host -------------------------------------------------------------------------------------------

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encoder() {
  static EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return EncodeTiled(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// A tensor map over `rank` dims (innermost first, element counts) of `esize`-byte elements, rows `stride1`
// elements apart and (3-D) groups `stride2` apart; box {box0, box1, 1}; zero fill outside.
bool make_map(CUtensorMap* m, const void* ptr, int rank, const uint64_t* dims, uint64_t stride1, uint64_t stride2,
              uint32_t box1, CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, uint64_t esize = 2,
              uint32_t box0 = 64, CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  const cuuint64_t gdim[3] = {dims[0], dims[1], rank == 3 ? dims[2] : 1};
  const cuuint64_t gstride[2] = {stride1 * esize, stride2 * esize};
  const cuuint32_t box[3] = {box0, box1, 1};
  const cuuint32_t estride[3] = {1, 1, 1};
  return encoder()(m, dtype, cuuint32_t(rank), const_cast<void*>(ptr), gdim, gstride, box, estride,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A device's SM count and compute capability, asked of the runtime once per device (the checks and the
// launch need them on every call; -1: the query failed).
struct DeviceInfo {
  int sms = 0, major = -1, minor = -1;
};
DeviceInfo device_info(int device) {
  static std::mutex mu;
  static DeviceInfo infos[64];
  static bool known[64] = {};
  if (device < 0 || device >= 64) return {};
  std::lock_guard<std::mutex> l(mu);
  if (!known[device]) {
    DeviceInfo i;
    if (cudaDeviceGetAttribute(&i.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&i.major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&i.minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return {};  // not remembered: a later call asks again
    }
    infos[device] = i, known[device] = true;
  }
  return infos[device];
}

template <int Kind, class TO, bool kStaged = false, int kParts = 1, bool kInit = false, bool kWide = false>
int launch(const Params& p, int grid, cudaStream_t stream) {
  constexpr int bytes = smem_bytes_of<kStaged, kWide>();
  const cudaError_t attr = cudaFuncSetAttribute(grouped_sm90_kernel<Kind, TO, kStaged, kParts, kInit, kWide>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (attr != cudaSuccess) return int(attr);
  grouped_sm90_kernel<Kind, TO, kStaged, kParts, kInit, kWide><<<grid, kThreadsGG, bytes, stream>>>(p);
  return int(cudaGetLastError());
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

}  // namespace

const char* grouped_sm90_device_unsupported(int device) {
#if !defined(MEGACORE_GROUPED_SM90)
  (void)device;
  return "the library was built without sm_90a device code (CMAKE_CUDA_ARCHITECTURES has no 90a)";
#else
  const DeviceInfo info = device_info(device);
  if (info.major < 0) return "the device's compute capability could not be read";
  if (info.major != 9 || info.minor != 0) return "the kernel is for Hopper GPUs (compute capability 9.0)";
  if (encoder() == nullptr) return "the CUDA driver has no cuTensorMapEncodeTiled";
  return nullptr;
#endif
}

const char* grouped_sm90_unsupported(const GroupedSm90& p, int device) {
  if (const char* why = grouped_sm90_device_unsupported(device)) return why;
  if (p.kind != GroupedSm90::Kind::Wgrad && p.out_f32) return "forward and dgrad outputs are the inputs' dtype";
  if (p.groups < 1 || p.groups > kGroupedSm90MaxGroups) return "more groups than one launch takes (256)";
  if (p.mo % 8 != 0 || p.k % 8 != 0) return "feature counts must be multiples of 8 (16-byte TMA rows)";
  if ((p.kind == GroupedSm90::Kind::Forward && p.k == 0) || (p.kind == GroupedSm90::Kind::Dgrad && p.mo == 0))
    return "the reduction is empty (no input features)";
  if (p.rows >= (int64_t(1) << 31) || p.mo >= (int64_t(1) << 31) || p.k >= (int64_t(1) << 31))
    return "a dimension reaches 2^31";
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.out)) return "an operand is not 16-byte aligned";
  return nullptr;
}

int grouped_sm90(const GroupedSm90& q, int device, void* stream, bool* launched) {
  if (launched) *launched = false;
  if (grouped_sm90_unsupported(q, device) != nullptr) return int(cudaErrorNotSupported);
  Params p{};
  const bool wgrad = q.kind == GroupedSm90::Kind::Wgrad;
  const int64_t n = q.kind == GroupedSm90::Kind::Forward ? q.mo : q.k;
  p.n_fixed = int(n);
  p.m_fixed = int(q.mo);
  p.k_fixed = int(q.kind == GroupedSm90::Kind::Forward ? q.k : q.mo);
  p.n_tiles = int((n + kBN - 1) / kBN);
  p.m_tiles_fixed = int((q.mo + kBM - 1) / kBM);
  p.out = q.out;
  p.ld_out = n;
  p.group_stride = wgrad ? q.mo * q.k : 0;
  p.beta = q.beta;
  int64_t tiles = 0, most = 0;  // most: the largest group's rows
  // Forward / dgrad from kWideMinRows rows per group on average: wide tail tiles where a group's rows leave 1-64
  // past its last full 128-row tile (one H200, 2026-11-29, grouped_sm90_check bench2, the kernel alone with them
  // wherever a tail allows and without, three rounds in one call: 128 experts, imbalanced, fc1 / fc2 forward and
  // dgrad 3-6 % faster at 256 rows per expert, 0-5 % at 512, Mixtral imbalanced within +-1 %; at 128 rows per
  // expert, where the weights' bytes bound the op and the padding is hidden, 1-6 % slower, hence the bound).
  bool wide = false;
  if (!wgrad && q.rows >= int64_t(kWideMinRows) * q.groups)
    for (int g = 0; g < q.groups && !wide; ++g) wide = wide_tail(int(q.offsets[g + 1] - q.offsets[g]));
  p.off[0] = 0, p.tile_start[0] = 0;
  for (int g = 0; g < q.groups; ++g) {
    const int64_t r = q.offsets[g + 1] - q.offsets[g];
    most = std::max(most, r);
    p.off[g + 1] = int32_t(q.offsets[g + 1]);
    if (wgrad) {
      tiles += r > 0 ? int64_t(p.m_tiles_fixed) * p.n_tiles : 0;
    } else {
      const int64_t mt = m_tiles_of(int(r), wide);
      tiles += mt * p.n_tiles + (mt * kBM < r ? (p.n_tiles + 1) / 2 : 0);
    }
    if (tiles >= (int64_t(1) << 31)) return int(cudaErrorInvalidValue);
    p.tile_start[g + 1] = int32_t(tiles);
  }
  p.tiles = int(tiles);
  if (tiles == 0) return 0;
  const uint64_t rows = uint64_t(std::max<int64_t>(q.rows, 1));
  bool ok = false;
  if (q.kind == GroupedSm90::Kind::Forward) {
    const uint64_t da[2] = {uint64_t(q.k), rows}, db[3] = {uint64_t(q.k), uint64_t(q.mo), uint64_t(q.groups)};
    ok = make_map(&p.ta, q.a, 2, da, q.k, 0, kBM) &&
         make_map(&p.tb, q.b, 3, db, q.k, uint64_t(q.mo * q.k), kBN) &&
         (!wide || make_map(&p.ta64, q.a, 2, da, q.k, 0, kBM / 2));
  } else if (q.kind == GroupedSm90::Kind::Dgrad) {
    const uint64_t da[2] = {uint64_t(q.mo), rows}, db[3] = {uint64_t(q.k), uint64_t(q.mo), uint64_t(q.groups)};
    ok = make_map(&p.ta, q.a, 2, da, q.mo, 0, kBM) &&
         make_map(&p.tb, q.b, 3, db, q.k, uint64_t(q.mo * q.k), kBK) &&
         (!wide || make_map(&p.ta64, q.a, 2, da, q.mo, 0, kBM / 2));
  } else {
    const uint64_t da[2] = {uint64_t(q.mo), rows}, db[2] = {uint64_t(q.k), rows};
    ok = make_map(&p.ta, q.a, 2, da, q.mo, 0, kBK) && make_map(&p.tb, q.b, 2, db, q.k, 0, kBK);
    // The f32 epilogue by rows per group (one H200, 2026-11-28, the kernel alone on even splits,
    // moe_gemm_kernel_diag_NVIDIA_H200.json): with beta 1 below kReduceEpilogueMinRows the staged box (64 rows of
    // 64 experts, fc1 shapes: 0.83 ms against 1.20 reduce-add and 1.37 from registers; 512 rows: 1.05 against
    // 1.33 and 1.64), from there the reduce-add (1024 rows, 1.1B-MoE fc1: 0.69 against 0.84 staged and 1.00 from
    // registers); with beta 0 the TMA store from kTmaEpilogueMinRows rows.
    int epi = q.epilogue;
    if (epi < 0) {
      const bool many = q.rows >= int64_t(kReduceEpilogueMinRows) * q.groups;
      epi = q.beta == 1.f ? (many ? 1 : 2) : q.rows >= int64_t(kTmaEpilogueMinRows) * q.groups ? 1 : 0;
    }
    if (!q.out_f32 || (q.beta != 0.f && q.beta != 1.f) || (epi == 2 && q.beta != 1.f)) epi = 0;
    if (ok && epi > 0) {
      const uint64_t dc[3] = {uint64_t(q.k), uint64_t(q.mo), uint64_t(q.groups)};
      ok = make_map(&p.tc, q.out, 3, dc, q.k, uint64_t(q.mo * q.k), kBM, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, 32);
      p.tma_out = epi == 2 ? 3 : q.beta == 0.f ? 1 : 2;
    }
  }
  if (!ok) return int(cudaErrorInvalidValue);
  const int grid = int(std::min<int64_t>(tiles, std::max(1, device_info(device).sms)));
  auto s = static_cast<cudaStream_t>(stream);
  if (launched) *launched = true;
  switch (q.kind) {
    case GroupedSm90::Kind::Forward:
      return wide ? launch<kFwd, __nv_bfloat16, false, 1, false, true>(p, grid, s) : launch<kFwd, __nv_bfloat16>(p, grid, s);
    case GroupedSm90::Kind::Dgrad:
      return wide ? launch<kDgrad, __nv_bfloat16, false, 1, false, true>(p, grid, s)
                  : launch<kDgrad, __nv_bfloat16>(p, grid, s);
    default:
      if (p.tma_out == 3) {
        // With every group at most kInitMaxRows rows, the box as the accumulators' start (one H200, 2026-11-29,
        // grouped_sm90_check bench2, even splits, fc1 / fc2 shapes: 128 experts at 256 rows 1.66-1.70 / 0.84-0.87 ms
        // against 1.96 / 0.98 adding the box in the epilogue; 64 experts at 32 / 64 rows 2-4 % faster; 128 rows
        // alike; at 512 rows, where tiles have eight k-blocks, it measured 8-10 % slower). Otherwise the staged
        // box in four parts from kStagedPartsMinRows rows per group (one H200, 2026-11-29, the kernel alone,
        // grouped_sm90_check bench2: 128 experts at 256 / 512 rows, fc1, 1.96 / 2.01 ms in four parts against
        // 2.01 / 2.07 in one; at 128 rows 1.80 against 1.72).
        if (most <= int64_t(kInitMaxRows)) return launch<kWgrad, float, true, 4, true>(p, grid, s);
        if (q.rows >= int64_t(kStagedPartsMinRows) * q.groups) return launch<kWgrad, float, true, 4>(p, grid, s);
        return launch<kWgrad, float, true>(p, grid, s);
      }
      return q.out_f32 ? launch<kWgrad, float>(p, grid, s) : launch<kWgrad, __nv_bfloat16>(p, grid, s);
  }
}

}  // namespace megacore::ops::cuda
