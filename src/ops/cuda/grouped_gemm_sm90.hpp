// Private interface of megacore's Hopper grouped GEMM (grouped_gemm_sm90.cu): every group of a MoE layer's
// forward, dgrad or wgrad in one persistent launch. Plain types only, so the kernel file builds on its own.
// Row-major tensors, the same operands as ops::grouped_gemm_forward / _dgrad / _wgrad:
//   forward: y[r0:r1]  = x[r0:r1] · w_g^T          x [rows, k], w [groups, mo, k], y [rows, mo]
//   dgrad:   dx[r0:r1] = dy[r0:r1] · w_g           dy [rows, mo], w [groups, mo, k], dx [rows, k]
//   wgrad:   dw_g = dy[r0:r1]^T · x[r0:r1] + beta · dw_g    dy [rows, mo], x [rows, k], dw [groups, mo, k]
// with [r0, r1) = [offsets[g], offsets[g + 1]).
#pragma once

#include <cstdint>

namespace megacore::ops::cuda {

/// Most groups one launch takes (the per-group offsets ride in the kernel's parameters).
inline constexpr int kGroupedSm90MaxGroups = 256;

/// One call: bf16 inputs (and forward/dgrad outputs).
struct GroupedSm90 {
  enum class Kind { Forward, Dgrad, Wgrad };
  Kind kind = Kind::Forward;
  bool out_f32 = false;  // wgrad only: dw is f32 (the main grad)
  int groups = 0;
  int64_t rows = 0;  // all groups' rows together
  int64_t mo = 0;    // w's output features (dy's columns)
  int64_t k = 0;     // w's input features (x's columns)
  const void* a = nullptr;  // forward x; dgrad and wgrad dy
  const void* b = nullptr;  // forward and dgrad w; wgrad x
  void* out = nullptr;      // y, dx or dw
  const int64_t* offsets = nullptr;  // host [groups + 1], offsets[0] = 0, offsets[groups] = rows
  float beta = 0.f;                  // wgrad only
  // f32 wgrad epilogue: -1 the kernel's choice; 0 from registers; 1 TMA store / reduce-add (beta 0 / 1);
  // 2 the main grad loaded into shared memory by TMA ahead of the epilogue and stored back (beta 1).
  int epilogue = -1;
};

/// Why the Hopper kernel cannot run on `device` at all (nullptr when it can): not built for sm_90a, another GPU,
/// a driver without tensor maps. The device's properties are asked once per device.
const char* grouped_sm90_device_unsupported(int device);

/// Why the Hopper kernel cannot run this problem on `device` (nullptr when it can): not built for sm_90a,
/// another GPU, a dtype or shape TMA cannot describe (features not a multiple of 8, misaligned pointers),
/// too many groups.
const char* grouped_sm90_unsupported(const GroupedSm90& p, int device);

/// Launches it on `stream` (a cudaStream_t). Returns the CUDA error of the launch (0: none); a driver without
/// tensor maps gives cudaErrorNotSupported. `launched` (optional) says whether a kernel was launched: a problem
/// with no output tiles (no rows, or no output features) launches nothing.
int grouped_sm90(const GroupedSm90& p, int device, void* stream, bool* launched = nullptr);

}  // namespace megacore::ops::cuda
