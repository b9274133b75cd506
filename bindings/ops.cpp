// megacore._C.ops: the stateless ops layer for Python callers, starting with attention (the op users most
// often want to call or compare on its own). Tensors may be megacore.Tensor, DLPack producers (torch,
// cupy, jax) or numpy arrays; outputs are written in place, so DLPack and contiguous numpy outputs share
// memory with the caller's array.
#include "bindings.hpp"

#include <pybind11/stl.h>

#include <string>

#include "megacore/ops/attention.hpp"
#include "megacore/ops/fp8.hpp"
#include "megacore/ops/gemm_fp8.hpp"
#include "megacore/ops/moe.hpp"

namespace megacore::py {

namespace {

using namespace megacore::ops;

// The reason an explicit backend="cudnn" call quotes after Python turned the path off.
constexpr const char* kPythonCudnnOff =
    "it was turned off from Python with megacore.ops.set_cudnn_attention_enabled(False); call "
    "set_cudnn_attention_enabled(True) to turn it back on, or use backend='flash'";

// Group sizes are host integers (the kernels plan their tiles on the host): a list or tuple of ints, or a 1-D
// integer numpy array / CPU tensor (megacore, torch, anything with __dlpack_device__). A device tensor would be read
// element by element with a sync each, so it is refused with the fix; so are floats, bools, strings, bytes, sets
// and dicts (no group order), and values outside int64.
std::vector<int64_t> group_sizes_arg(const pyb::handle& o) {
  constexpr const char* kFix = "pass the rows of each group as host integers (a list, or an integer CPU array)";
  if (pyb::isinstance<Tensor>(o)) {
    const Tensor t = o.cast<Tensor>();
    MC_CHECK(t.device().is_cpu(), "ops: group_sizes is a megacore tensor on {}; the grouped GEMM plans its tiles on "
             "the host, so pass sizes.to('cpu') (or a list)", t.device().str());
    return group_sizes_arg(o.attr("numpy")());
  }
  MC_CHECK(!pyb::isinstance<pyb::str>(o) && !pyb::isinstance<pyb::bytes>(o) && !PyAnySet_Check(o.ptr()) &&
               !PyDict_Check(o.ptr()),
           "ops: group_sizes is {}; {}", std::string(pyb::repr(o)), kFix);
  if (pyb::hasattr(o, "__dlpack_device__")) {  // numpy, torch, cupy, jax: (device type, id); 1 = CPU, 3 = pinned
    const pyb::tuple dev = o.attr("__dlpack_device__")();
    const int type = dev[0].cast<int>();
    MC_CHECK(type == 1 || type == 3, "ops: group_sizes is a device array (DLPack device type {}); the grouped GEMM "
             "plans its tiles on the host, so pass host sizes (e.g. counts.tolist() or counts.cpu())", type);
  }
  if (pyb::hasattr(o, "dtype")) {  // integer dtypes only: int8..int64, uint8..uint64 (not bool, not floats)
    const std::string dt = pyb::str(o.attr("dtype"));
    MC_CHECK(dt.find("int") != std::string::npos, "ops: group_sizes has dtype {}; {}", dt, kFix);
  }
  if (pyb::hasattr(o, "ndim")) {
    const int nd = o.attr("ndim").cast<int>();
    MC_CHECK(nd == 1, "ops: group_sizes has {} dimensions; pass one size per group (1-D)", nd);
  }
  MC_CHECK(pyb::hasattr(o, "__iter__"), "ops: group_sizes must be a sequence of ints (rows per group), got {}",
           std::string(pyb::repr(o)));
  std::vector<int64_t> v;
  for (const pyb::handle& e : pyb::iter(o)) {
    MC_CHECK(!PyBool_Check(e.ptr()), "ops: group_sizes holds {}, a bool; {}", std::string(pyb::repr(e)), kFix);
    PyObject* idx = PyNumber_Index(e.ptr());
    if (idx == nullptr) {
      PyErr_Clear();
      raise<ValueError>("ops: group_sizes[{}] is {}, not an integer; {}", v.size(), std::string(pyb::repr(e)), kFix);
    }
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    MC_CHECK(overflow == 0, "ops: group_sizes[{}] = {} does not fit in int64; {}", v.size(), std::string(pyb::repr(e)),
             kFix);
    v.push_back(int64_t(x));
  }
  return v;
}

// Every tensor shares the caller's memory (outputs are written in place; inputs are never copied).
Tensor share_arg(const pyb::handle& o, const char* what) {
  return tensor_arg(o, std::string("ops: ") + what, TensorArg::Share);
}

// One grouped product from Python: a, b and out shared with the caller, host group sizes, the stream; run without
// the GIL as run(a, b, sizes, out, stream).
template <class Run>
void grouped_call(const pyb::object& a, const char* an, const pyb::object& b, const char* bn, const pyb::object& sizes,
                  const pyb::object& out, const char* on, const pyb::object& stream, Run run) {
  Tensor ta = share_arg(a, an), tb = share_arg(b, bn), to = share_arg(out, on);
  const std::vector<int64_t> g = group_sizes_arg(sizes);
  const Stream s = stream_arg(stream, ta.device());
  pyb::gil_scoped_release nogil;
  run(ta, tb, g, to, s);
}

AttentionBackend backend_arg(const std::string& s) {
  if (s == "auto") return AttentionBackend::Auto;
  if (s == "cudnn") return AttentionBackend::Cudnn;
  if (s == "flash") return AttentionBackend::Flash;
  if (s == "reference") return AttentionBackend::Reference;
  raise<ValueError>("ops: unknown attention backend '{}'; use 'auto', 'cudnn', 'flash' or 'reference'", s);
}

AttentionOptions options(bool causal, float scale, const std::string& backend, bool deterministic,
                         const pyb::object& cu_q, const pyb::object& cu_kv, int64_t max_q, int64_t max_kv) {
  AttentionOptions o;
  o.causal = causal;
  o.softmax_scale = scale;
  o.backend = backend_arg(backend);
  o.deterministic = deterministic;
  MC_CHECK(cu_q.is_none() == cu_kv.is_none(),
           "ops: packed attention needs both cu_seqlens_q and cu_seqlens_kv (got only one); pass both or neither");
  if (!cu_q.is_none()) {
    o.cu_seqlens_q = share_arg(cu_q, "cu_seqlens_q");
    o.cu_seqlens_kv = share_arg(cu_kv, "cu_seqlens_kv");
    o.max_seqlen_q = max_q;
    o.max_seqlen_kv = max_kv;
  }
  return o;
}

}  // namespace

void bind_ops(pyb::module_& root) {
  pyb::module_ m = root.def_submodule("ops", "Stateless ops (attention) on megacore, DLPack or numpy tensors.");
  m.def(
      "attention_forward",
      [](const pyb::object& q, const pyb::object& k, const pyb::object& v, const pyb::object& out,
         const pyb::object& lse, bool causal, float scale, const std::string& backend, bool deterministic,
         const pyb::object& cu_q, const pyb::object& cu_kv, int64_t max_q, int64_t max_kv, const pyb::object& stream) {
        Tensor tq = share_arg(q, "q"), tk = share_arg(k, "k"), tv = share_arg(v, "v");
        Tensor to = share_arg(out, "out"), tl = share_arg(lse, "lse");
        const AttentionOptions o = options(causal, scale, backend, deterministic, cu_q, cu_kv, max_q, max_kv);
        const Stream s = stream_arg(stream, tq.device());
        pyb::gil_scoped_release nogil;
        attention_forward(tq, tk, tv, to, tl, o, s);
      },
      pyb::arg("q"), pyb::arg("k"), pyb::arg("v"), pyb::arg("out"), pyb::arg("lse"), pyb::kw_only(),
      pyb::arg("causal") = false, pyb::arg("softmax_scale") = 0.f, pyb::arg("backend") = "auto",
      pyb::arg("deterministic") = false, pyb::arg("cu_seqlens_q") = pyb::none(), pyb::arg("cu_seqlens_kv") = pyb::none(),
      pyb::arg("max_seqlen_q") = 0, pyb::arg("max_seqlen_kv") = 0, pyb::arg("stream") = pyb::none(),
      "out = softmax(scale q k^T + mask) v and its log-sum-exp lse (f32), written into out and lse.\n"
      "Dense layouts: q/out [B, Sq, H, D], k/v [B, Skv, Hkv, D], lse [B, H, Sq]; packed (cu_seqlens given):\n"
      "q/out [Tq, H, D], k/v [Tkv, Hkv, D], lse [H, Tq]. backend: 'auto', 'cudnn', 'flash' or 'reference'.");
  m.def(
      "attention_backward",
      [](const pyb::object& q, const pyb::object& k, const pyb::object& v, const pyb::object& out,
         const pyb::object& lse, const pyb::object& dout, const pyb::object& dq, const pyb::object& dk,
         const pyb::object& dv, bool causal, float scale, const std::string& backend, bool deterministic,
         const pyb::object& cu_q, const pyb::object& cu_kv, int64_t max_q, int64_t max_kv, const pyb::object& stream) {
        Tensor tq = share_arg(q, "q"), tk = share_arg(k, "k"), tv = share_arg(v, "v");
        Tensor to = share_arg(out, "out"), tl = share_arg(lse, "lse"), tdo = share_arg(dout, "dout");
        Tensor tdq = share_arg(dq, "dq"), tdk = share_arg(dk, "dk"), tdv = share_arg(dv, "dv");
        const AttentionOptions o = options(causal, scale, backend, deterministic, cu_q, cu_kv, max_q, max_kv);
        const Stream s = stream_arg(stream, tq.device());
        pyb::gil_scoped_release nogil;
        attention_backward(tq, tk, tv, to, tl, tdo, tdq, tdk, tdv, o, s);
      },
      pyb::arg("q"), pyb::arg("k"), pyb::arg("v"), pyb::arg("out"), pyb::arg("lse"), pyb::arg("dout"), pyb::arg("dq"),
      pyb::arg("dk"), pyb::arg("dv"), pyb::kw_only(), pyb::arg("causal") = false, pyb::arg("softmax_scale") = 0.f,
      pyb::arg("backend") = "auto", pyb::arg("deterministic") = false, pyb::arg("cu_seqlens_q") = pyb::none(),
      pyb::arg("cu_seqlens_kv") = pyb::none(), pyb::arg("max_seqlen_q") = 0, pyb::arg("max_seqlen_kv") = 0,
      pyb::arg("stream") = pyb::none(),
      "Gradients of sum(out * dout) for q, k, v (overwriting dq, dk, dv), from the forward's out and lse.");
  m.def(
      "attention_resolve_backend",
      [](const pyb::object& q, const pyb::object& k, bool causal, const std::string& backend) {
        const AttentionOptions o = options(causal, 0.f, backend, false, pyb::none(), pyb::none(), 0, 0);
        return std::string(attention_backend_name(attention_resolve_backend(share_arg(q, "q"), share_arg(k, "k"), o)));
      },
      pyb::arg("q"), pyb::arg("k"), pyb::kw_only(), pyb::arg("causal") = false, pyb::arg("backend") = "auto",
      "The backend a call would use: 'cudnn', 'flash' or 'reference' (raises what the call would).");
  m.def("attention_cudnn_available", &attention_cudnn_available,
        "True when this build contains the cuDNN SDPA path and it is enabled (the default).");
  m.def("attention_cudnn_built", &attention_cudnn_built, "True when this build contains the cuDNN SDPA path.");
  m.def("set_cudnn_attention_enabled", [](bool on) { set_cudnn_attention_enabled(on, kPythonCudnnOff); },
        pyb::arg("on"),
        "Turns the cuDNN SDPA path on (the default where built in) or off for this process; off, Auto runs "
        "megacore's flash kernel and backend='cudnn' raises ValueError.");
  m.def("cudnn_attention_enabled", &cudnn_attention_enabled);
  m.def("set_cudnn_attention_autotune", &set_cudnn_attention_autotune, pyb::arg("on"),
        "cuDNN SDPA plan choice: on, the first call of a shape times every plan cuDNN offers and keeps the "
        "fastest (synchronises the device once per shape); off (the default), the heuristic's first plan.");
  m.def("cudnn_attention_autotune", &cudnn_attention_autotune);

  // ---- Grouped GEMM over experts (ops/moe.hpp): the MoE layer's three products on the caller's tensors.
  m.def(
      "grouped_gemm_forward",
      [](const pyb::object& x, const pyb::object& w, const pyb::object& sizes, const pyb::object& y,
         const pyb::object& stream) { grouped_call(x, "x", w, "w", sizes, y, "y", stream, grouped_gemm_forward); },
      pyb::arg("x"), pyb::arg("w"), pyb::arg("group_sizes"), pyb::arg("y"), pyb::kw_only(),
      pyb::arg("stream") = pyb::none(),
      "y [N, M] = x_g [rows_g, K] @ w_g^T per group g: x [N, K] holds the groups' rows one after another "
      "(group_sizes: host ints summing to N, zeros allowed), w [G, M, K] one weight per group. f32, bf16 or f16 "
      "(accumulating in f32); y is written in place.");
  m.def(
      "grouped_gemm_dgrad",
      [](const pyb::object& dy, const pyb::object& w, const pyb::object& sizes, const pyb::object& dx,
         const pyb::object& stream) { grouped_call(dy, "dy", w, "w", sizes, dx, "dx", stream, grouped_gemm_dgrad); },
      pyb::arg("dy"), pyb::arg("w"), pyb::arg("group_sizes"), pyb::arg("dx"), pyb::kw_only(),
      pyb::arg("stream") = pyb::none(), "dx [N, K] = dy_g [rows_g, M] @ w_g per group (w [G, M, K]); dx in place.");
  m.def(
      "grouped_gemm_wgrad",
      [](const pyb::object& dy, const pyb::object& x, const pyb::object& sizes, const pyb::object& dw, float beta,
         const pyb::object& stream) {
        grouped_call(dy, "dy", x, "x", sizes, dw, "dw", stream,
                     [beta](const Tensor& a, const Tensor& b, std::span<const int64_t> g, Tensor& out,
                            const Stream& s) { grouped_gemm_wgrad(a, b, g, out, beta, s); });
      },
      pyb::arg("dy"), pyb::arg("x"), pyb::arg("group_sizes"), pyb::arg("dw"), pyb::kw_only(), pyb::arg("beta") = 1.f,
      pyb::arg("stream") = pyb::none(),
      "dw_g = beta * dw_g + dy_g^T @ x_g per group: dw [G, M, K] is f32 (the main grad) for 16-bit inputs, or "
      "their dtype; beta = 1 accumulates, a group with no rows keeps beta * dw_g.");
  m.def("grouped_gemm_path", [] { return std::string(grouped_gemm_path_name(grouped_gemm_path())); },
        "The process's grouped-GEMM path setting: 'auto', 'loop', 'grouped' or 'sm90' (MEGACORE_MOE_GEMM).");
  m.def("set_grouped_gemm_path", [](const std::string& p) {
          set_grouped_gemm_path(parse_grouped_gemm_path(p, "megacore.ops.set_grouped_gemm_path"));
        }, pyb::arg("path"),
        "Forces the CUDA grouped-GEMM path for the process: 'auto', 'loop', 'grouped' or 'sm90' (where sm90 cannot "
        "run, the log says why and auto's cuBLAS path runs).");
  m.def("grouped_gemm_sm90_available", [](const pyb::object& d) { return grouped_gemm_sm90_available(device_arg(d)); },
        pyb::arg("device") = "cuda:0", "Whether megacore's Hopper grouped kernel can run on this device.");
  m.def("grouped_gemm_sm90_launches", &grouped_gemm_sm90_launches,
        "How many grouped GEMMs this process has run on the Hopper kernel (shows which path a call took).");

  // ---- FP8 (ops/fp8.hpp, ops/gemm_fp8.hpp): FP8 tensors are megacore.Tensor (no numpy dtype; read their
  // codes with t.view_as_dtype('u8')).
  auto opt = [](const pyb::object& o, const char* what) { return o.is_none() ? Tensor() : share_arg(o, what); };
  m.def(
      "fp8_cast",
      [opt](const pyb::object& x, const pyb::object& scale, const pyb::object& out, const pyb::object& amax,
            const pyb::object& counts) {
        Tensor tx = share_arg(x, "x"), to = share_arg(out, "out");
        fp8_cast(tx, share_arg(scale, "scale"), to, opt(amax, "amax"), opt(counts, "counts"),
                 stream_arg(pyb::none(), tx.device()));
      },
      pyb::arg("x"), pyb::arg("scale"), pyb::arg("out"), pyb::arg("amax") = pyb::none(), pyb::arg("counts") = pyb::none(),
      "out (f8e4m3/f8e5m2) = fp8(x * scale), nearest even, saturating; amax (f32 [1]) = max(amax, max|x|); counts "
      "(i64 [2]) += (saturated, flushed to zero).");
  m.def(
      "fp8_cast_transpose",
      [opt](const pyb::object& x, const pyb::object& scale, const pyb::object& out, const pyb::object& out_t,
            const pyb::object& amax, const pyb::object& counts) {
        Tensor tx = share_arg(x, "x");
        fp8_cast_transpose(tx, share_arg(scale, "scale"), opt(out, "out"), share_arg(out_t, "out_t"), opt(amax, "amax"),
                           opt(counts, "counts"), stream_arg(pyb::none(), tx.device()));
      },
      pyb::arg("x"), pyb::arg("scale"), pyb::arg("out"), pyb::arg("out_t"), pyb::arg("amax") = pyb::none(),
      pyb::arg("counts") = pyb::none(),
      "One pass over x [rows, cols]: out (or None) = fp8_cast's codes, out_t [cols, rows] = their transpose; amax and "
      "counts as fp8_cast.");
  m.def(
      "fp8_amax", [](const pyb::object& x, const pyb::object& amax) { fp8_amax(share_arg(x, "x"), share_arg(amax, "amax")); },
      pyb::arg("x"), pyb::arg("amax"), "amax (f32 [1]) = max(amax, max|x|).");
  m.def(
      "fp8_dequant",
      [](const pyb::object& q, const pyb::object& scale_inv, const pyb::object& out) {
        Tensor to = share_arg(out, "out");
        fp8_dequant(share_arg(q, "q"), share_arg(scale_inv, "scale_inv"), to);
      },
      pyb::arg("q"), pyb::arg("scale_inv"), pyb::arg("out"), "out = float(q) * scale_inv.");
  m.def(
      "fp8_update_scales",
      [](const pyb::object& history, const pyb::object& scale, const pyb::object& scale_inv, const pyb::object& fp8_max,
         const std::string& algo, int margin, bool roll) {
        MC_CHECK(algo == "max" || algo == "most_recent", "ops.fp8_update_scales: algo '{}' is not max or most_recent",
                 algo);
        fp8_update_scales(share_arg(history, "history"), share_arg(scale, "scale"), share_arg(scale_inv, "scale_inv"),
                          share_arg(fp8_max, "fp8_max"), algo == "max" ? Fp8AmaxAlgo::Max : Fp8AmaxAlgo::MostRecent,
                          margin, roll);
      },
      pyb::arg("history"), pyb::arg("scale"), pyb::arg("scale_inv"), pyb::arg("fp8_max"), pyb::kw_only(),
      pyb::arg("algo") = "max", pyb::arg("margin") = 0, pyb::arg("roll") = true,
      "Delayed-scaling update of n tensors: history f32 [L, n] (row 0 = this step), scale/scale_inv/fp8_max f32 [n].");
  m.def(
      "gemm_fp8",
      [](const pyb::object& a, const pyb::object& b, const pyb::object& out, const pyb::object& sa,
         const pyb::object& sb, float beta, bool fast_accum) {
        Tensor ta = share_arg(a, "a"), to = share_arg(out, "out");
        gemm_fp8(ta, share_arg(b, "b"), to, share_arg(sa, "scale_inv_a"), share_arg(sb, "scale_inv_b"),
                 {.beta = beta, .fast_accum = fast_accum}, stream_arg(pyb::none(), ta.device()));
      },
      pyb::arg("a"), pyb::arg("b"), pyb::arg("out"), pyb::arg("scale_inv_a"), pyb::arg("scale_inv_b"), pyb::kw_only(),
      pyb::arg("beta") = 0.f, pyb::arg("fast_accum") = false,
      "out [M, N] = scale_inv_a * scale_inv_b * a [M, K] @ b [N, K]^T + beta * out (FP8 a, b; bf16/f32 out).");
}

}  // namespace megacore::py
