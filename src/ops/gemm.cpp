#include "megacore/ops/gemm.hpp"

#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "megacore/build_config.hpp"
#include "megacore/ops/ops_common.hpp"
#if MEGACORE_WITH_CUDA
#include "ops/cuda/gemm_cuda.hpp"
#endif
#if MEGACORE_HAVE_EIGEN
#include <Eigen/Core>
#endif

namespace megacore::ops {

namespace ref {

double gelu_tanh(double x) {
  const double c = 0.7978845608028654;  // sqrt(2 / pi)
  return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}

void gemm_f64(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
              const double* b, double beta, double* c) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = trans_a ? a[p * m + i] : a[i * k + p];
        const double bv = trans_b ? b[j * k + p] : b[p * n + j];
        acc += av * bv;
      }
      c[i * n + j] = alpha * acc + (beta == 0 ? 0.0 : beta * c[i * n + j]);
    }
  }
}

}  // namespace ref

namespace {

constexpr const char* kOp = "gemm";

/// One operand as the BLAS sees it: row-major [rows, cols] with leading dimension ld, possibly
/// taken transposed, with a batch stride (0 = shared).
struct Operand {
  const void* ptr = nullptr;
  int64_t rows = 0, cols = 0, ld = 0, batch = 1, batch_stride = 0;
  bool trans = false;
};

Operand normalise(const Tensor& t, bool trans, const char* name) {
  MC_CHECK(t.dim() == 2 || t.dim() == 3, "{}: {} must be 2-D [rows, cols] or 3-D [batch, rows, cols], got shape {}",
           kOp, name, shape_str(t.shape()));
  Operand o;
  o.ptr = t.data_ptr();
  o.batch = t.dim() == 3 ? t.size(0) : 1;
  o.batch_stride = t.dim() == 3 ? t.stride(0) : 0;
  const int64_t r = t.size(-2), c = t.size(-1), sr = t.stride(-2), sc = t.stride(-1);
  if (sc == 1 || c == 1) {
    o.rows = r, o.cols = c, o.ld = r <= 1 ? std::max<int64_t>(c, 1) : sr, o.trans = trans;
  } else if (sr == 1 || r == 1) {
    // A transposed view of a row-major matrix: the stored matrix is [c, r].
    o.rows = c, o.cols = r, o.ld = c <= 1 ? std::max<int64_t>(r, 1) : sc, o.trans = !trans;
  } else {
    raise("{}: {} (shape {}, strides {}) has neither contiguous rows nor contiguous columns; call .contiguous()",
          kOp, name, shape_str(t.shape()), shape_str(t.strides()));
  }
  MC_CHECK(o.ld >= o.cols, "{}: {} has overlapping rows (leading dimension {} < {} columns); call .contiguous()", kOp,
           name, o.ld, o.cols);
  return o;
}

bool needs_bias(GemmEpilogue e) { return e == GemmEpilogue::Bias || e == GemmEpilogue::BiasGelu; }
bool is_bias_grad(GemmEpilogue e) { return e == GemmEpilogue::BiasGradA || e == GemmEpilogue::BiasGradB; }

template <class T>
double ld_as_double(const void* p, int64_t i) {
  return double(float(static_cast<const T*>(p)[i]));
}

double load(DType dt, const void* p, int64_t i) {
  switch (dt) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::BF16: return ld_as_double<bfloat16>(p, i);
    case DType::F16: return ld_as_double<float16>(p, i);
    default: return 0;
  }
}

void store(DType dt, void* p, int64_t i, double v) {
  switch (dt) {
    case DType::F32: static_cast<float*>(p)[i] = float(v); break;
    case DType::BF16: static_cast<bfloat16*>(p)[i] = bfloat16(float(v)); break;
    case DType::F16: static_cast<float16*>(p)[i] = float16(float(v)); break;
    default: break;
  }
}

// op(x) of one batch entry as a float matrix [rows_op, cols_op].
std::vector<float> gather_op(DType dt, const Operand& o, int64_t batch_index, int64_t rows_op, int64_t cols_op) {
  std::vector<float> v(size_t(rows_op * cols_op));
  const int64_t base = batch_index * o.batch_stride;
  for (int64_t i = 0; i < rows_op; ++i)
    for (int64_t j = 0; j < cols_op; ++j) {
      const int64_t idx = o.trans ? base + j * o.ld + i : base + i * o.ld + j;
      v[size_t(i * cols_op + j)] = float(load(dt, o.ptr, idx));
    }
  return v;
}

void gemm_cpu(const Operand& a, const Operand& b, Tensor& out, int64_t m, int64_t n, int64_t k, int64_t batch,
              DType ab, const GemmOptions& opts) {
  const int64_t ldc = out.stride(-2), sc = out.dim() == 3 ? out.stride(0) : 0;
  const DType odt = out.dtype();
  void* optr = out.data_ptr();
  // The beta term's source: out itself, or opts.c with its own strides.
  const bool own_c = opts.c.defined();
  const void* cptr = own_c ? opts.c.data_ptr() : optr;
  const int64_t ldci = own_c ? opts.c.stride(-2) : ldc, sci = own_c ? (opts.c.dim() == 3 ? opts.c.stride(0) : 0) : sc;
  std::vector<double> bias_acc;
  for (int64_t bi = 0; bi < batch; ++bi) {
    std::vector<float> av = gather_op(ab, a, a.batch > 1 ? bi : 0, m, k);
    std::vector<float> bv = gather_op(ab, b, b.batch > 1 ? bi : 0, k, n);
    std::vector<float> cv(size_t(m * n));
#if MEGACORE_HAVE_EIGEN
    using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    Eigen::Map<const Mat> A(av.data(), m, k), B(bv.data(), k, n);
    Eigen::Map<Mat> C(cv.data(), m, n);
    C.noalias() = A * B;
#else
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float acc = 0;
        for (int64_t p = 0; p < k; ++p) acc += av[size_t(i * k + p)] * bv[size_t(p * n + j)];
        cv[size_t(i * n + j)] = acc;
      }
#endif
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        const int64_t idx = bi * sc + i * ldc + j;
        double v = double(opts.alpha) * cv[size_t(i * n + j)];
        if (opts.beta != 0.f) v += double(opts.beta) * load(odt, cptr, bi * sci + i * ldci + j);
        if (needs_bias(opts.epilogue)) v += load(opts.bias.dtype(), opts.bias.data_ptr(), j);
        if (opts.epilogue == GemmEpilogue::Gelu || opts.epilogue == GemmEpilogue::BiasGelu) v = ref::gelu_tanh(v);
        store(odt, optr, idx, v);
      }
    if (is_bias_grad(opts.epilogue)) {
      const bool from_a = opts.epilogue == GemmEpilogue::BiasGradA;
      const int64_t len = from_a ? m : n;
      bias_acc.assign(size_t(len), 0.0);
      for (int64_t p = 0; p < k; ++p)
        for (int64_t i = 0; i < len; ++i) bias_acc[size_t(i)] += from_a ? av[size_t(i * k + p)] : bv[size_t(p * n + i)];
      for (int64_t i = 0; i < len; ++i) store(opts.bias.dtype(), opts.bias.data_ptr(), i, bias_acc[size_t(i)]);
    }
  }
}

}  // namespace

void gemm(const Tensor& a, const Tensor& b, Tensor& out, const GemmOptions& opts, const Stream& s) {
  detail::check_defined(a, kOp, "a");
  detail::check_defined(b, kOp, "b");
  detail::check_defined(out, kOp, "out");
  const DType ab = a.dtype();
  MC_CHECK(ab == DType::F32 || ab == DType::BF16 || ab == DType::F16, "{}: a has dtype {}; it must be f32, bf16 or f16",
           kOp, dtype_name(ab));
  MC_CHECK(b.dtype() == ab, "{}: a is {} but b is {}; both inputs must have the same dtype", kOp, dtype_name(ab),
           dtype_name(b.dtype()));
  MC_CHECK(out.dtype() == ab || (out.dtype() == DType::F32 && ab != DType::F32),
           "{}: out has dtype {}; for {} inputs it must be {}{}", kOp, dtype_name(out.dtype()), dtype_name(ab),
           dtype_name(ab), ab == DType::F32 ? "" : " or f32");
  MC_CHECK(!opts.allow_tf32 || ab == DType::F32, "{}: allow_tf32 applies to f32 inputs only (inputs are {})", kOp,
           dtype_name(ab));
  const Device dev = a.device();
  detail::check_same_device(b, dev, kOp, "b");
  detail::check_same_device(out, dev, kOp, "out");

  const Operand oa = normalise(a, opts.trans_a, "a");
  const Operand ob = normalise(b, opts.trans_b, "b");
  // Logical sizes from the caller's view: op(a) is [M, K], op(b) is [K, N].
  const int64_t m = opts.trans_a ? a.size(-1) : a.size(-2);
  const int64_t ka = opts.trans_a ? a.size(-2) : a.size(-1);
  const int64_t kb = opts.trans_b ? b.size(-1) : b.size(-2);
  const int64_t n = opts.trans_b ? b.size(-2) : b.size(-1);
  MC_CHECK(ka == kb, "{}: inner dimensions differ: op(a) is [{}, {}] but op(b) is [{}, {}] (trans_a={}, trans_b={})",
           kOp, m, ka, kb, n, opts.trans_a, opts.trans_b);
  const int64_t batch = std::max(oa.batch, ob.batch);
  MC_CHECK((oa.batch == 1 || oa.batch == batch) && (ob.batch == 1 || ob.batch == batch) &&
               !(a.dim() == 3 && b.dim() == 3 && a.size(0) != b.size(0)),
           "{}: batch sizes differ: a {} and b {}", kOp, shape_str(a.shape()), shape_str(b.shape()));
  const bool batched = a.dim() == 3 || b.dim() == 3;
  const Shape want = batched ? Shape{batch, m, n} : Shape{m, n};
  MC_CHECK(out.shape() == want, "{}: out has shape {}, expected {}", kOp, shape_str(out.shape()), shape_str(want));
  MC_CHECK(out.stride(-1) == 1 || n == 1, "{}: out must have contiguous rows (stride(-1) == 1), got strides {}", kOp,
           shape_str(out.strides()));
  MC_CHECK(!batched || batch == 1 || out.stride(0) != 0, "{}: out's batch stride is 0", kOp);
  if (opts.c.defined()) {
    MC_CHECK(opts.c.shape() == out.shape() && opts.c.dtype() == out.dtype(),
             "{}: opts.c is {} {} but out is {} {}; pass the beta term's source in out's shape and dtype", kOp,
             dtype_name(opts.c.dtype()), shape_str(opts.c.shape()), dtype_name(out.dtype()), shape_str(out.shape()));
    MC_CHECK(opts.c.stride(-1) == 1 || n == 1, "{}: opts.c must have contiguous rows (stride(-1) == 1), got strides {}",
             kOp, shape_str(opts.c.strides()));
    MC_CHECK(!batched || batch == 1 || opts.c.stride(0) != 0, "{}: opts.c's batch stride is 0", kOp);
    detail::check_same_device(opts.c, dev, kOp, "opts.c");
  }

  if (needs_bias(opts.epilogue) || is_bias_grad(opts.epilogue)) {
    detail::check_defined(opts.bias, kOp, "opts.bias");
    const int64_t len = opts.epilogue == GemmEpilogue::BiasGradA ? m : n;
    MC_CHECK(opts.bias.numel() == len && opts.bias.is_contiguous(),
             "{}: bias must be a contiguous vector of {} elements ({}), got shape {}", kOp, len,
             opts.epilogue == GemmEpilogue::BiasGradA ? "M" : "N", shape_str(opts.bias.shape()));
    MC_CHECK(opts.bias.dtype() == out.dtype(), "{}: bias has dtype {}; it must match out ({})", kOp,
             dtype_name(opts.bias.dtype()), dtype_name(out.dtype()));
    detail::check_same_device(opts.bias, dev, kOp, "opts.bias");
    MC_CHECK(!is_bias_grad(opts.epilogue) || batch == 1,
             "{}: bias-gradient epilogues need an unbatched product (batch is {})", kOp, batch);
  }
  if (m == 0 || n == 0 || batch == 0) return;
  if (ka == 0) {
    // An empty sum: only the beta term remains (and a zero bias gradient).
    MC_CHECK(opts.epilogue == GemmEpilogue::None, "{}: K = 0 with an epilogue is not supported", kOp);
    MC_CHECK(!opts.c.defined(), "{}: K = 0 with a separate beta source (opts.c) is not supported", kOp);
    if (opts.beta == 0.f) out.zero_(s);
    return;
  }

  if (dev.is_cpu()) {
    gemm_cpu(oa, ob, out, m, n, ka, batch, ab, opts);
    return;
  }
#if MEGACORE_WITH_CUDA
  void* stream = detail::launch_stream(s, dev, kOp);
  cuda::GemmProblem p;
  p.ab_dtype = ab;
  p.out_dtype = out.dtype();
  p.trans_a = oa.trans;
  p.trans_b = ob.trans;
  p.m = m, p.n = n, p.k = ka, p.batch = batch;
  p.a = oa.ptr, p.lda = oa.ld, p.stride_a = oa.batch_stride;
  p.b = ob.ptr, p.ldb = ob.ld, p.stride_b = ob.batch_stride;
  p.c = out.data_ptr();
  p.ldc = m <= 1 ? n : out.stride(-2);
  p.stride_c = batched ? out.stride(0) : 0;
  if (opts.c.defined()) {
    p.c_in = opts.c.data_ptr();
    p.ldc_in = m <= 1 ? n : opts.c.stride(-2);
    p.stride_c_in = batched ? opts.c.stride(0) : 0;
  }
  p.alpha = opts.alpha, p.beta = opts.beta;
  p.epilogue = int(opts.epilogue);
  p.bias = opts.bias.defined() ? opts.bias.data_ptr() : nullptr;
  p.bias_dtype = opts.bias.defined() ? opts.bias.dtype() : out.dtype();
  p.allow_tf32 = opts.allow_tf32;
  p.sm_margin = gemm_sm_margin(dev.index);
  const double gflop = 2.0 * double(m) * double(n) * double(ka) * double(batch) * 1e-9;
  p.autotune_candidates = opts.autotune ? gemm_autotune().candidates_for(gflop) : 0;  // beta != 0: not timed
  if (batch > 1 && (p.stride_a == 0 || p.stride_b == 0)) {
    // A shared operand next to a batched one. When a is the batched one, not transposed and packed,
    // the batch folds into M: one large product instead of many.
    if (p.stride_b == 0 && !p.trans_a && p.stride_a == m * p.lda && p.stride_c == m * p.ldc &&
        (!p.c_in || p.stride_c_in == m * p.ldc_in)) {
      p.m = m * batch;
      p.batch = 1;
      p.stride_a = p.stride_c = p.stride_c_in = 0;
      cuda::gemm(p, dev.index, stream);
      return;
    }
    // Otherwise one product per batch entry (cuBLASLt wants non-zero batch strides).
    const int64_t ea = dtype_size(ab), ec = dtype_size(out.dtype());
    cuda::GemmProblem q = p;
    q.batch = 1;
    for (int64_t i = 0; i < batch; ++i) {
      q.a = static_cast<const char*>(p.a) + i * p.stride_a * ea;
      q.b = static_cast<const char*>(p.b) + i * p.stride_b * ea;
      q.c = static_cast<char*>(p.c) + i * p.stride_c * ec;
      if (p.c_in) q.c_in = static_cast<const char*>(p.c_in) + i * p.stride_c_in * ec;
      q.stride_a = q.stride_b = q.stride_c = q.stride_c_in = 0;
      cuda::gemm(q, dev.index, stream);
    }
    return;
  }
  cuda::gemm(p, dev.index, stream);
#else
  raise<CudaError>("{}: tensors are on {} but megacore was built without CUDA", kOp, dev.str());
#endif
}

namespace {
// Held margins per CUDA device (a multiset: the largest is in force).
struct MarginRegistry {
  std::mutex mu;
  std::map<int, std::multiset<int>> held;
  std::array<std::atomic<int>, 64> in_force{};  // read on every GEMM launch without the lock
};
MarginRegistry& margins() {
  static MarginRegistry* r = new MarginRegistry();
  return *r;
}
void publish(MarginRegistry& r, int device) {
  auto& h = r.held[device];
  r.in_force[size_t(device)].store(h.empty() ? 0 : *h.rbegin(), std::memory_order_relaxed);
}
}  // namespace

GemmSmMarginRequest::GemmSmMarginRequest(int device, int margin) {
  MC_CHECK(device >= 0 && device < 64, "GemmSmMarginRequest: device index {} is out of range [0, 64)", device);
  MC_CHECK(margin >= 0, "GemmSmMarginRequest: the SM margin must be >= 0, got {}", margin);
  auto& r = margins();
  std::lock_guard<std::mutex> lock(r.mu);
  r.held[device].insert(margin);
  publish(r, device);
  device_ = device;
  margin_ = margin;
}

GemmSmMarginRequest& GemmSmMarginRequest::operator=(GemmSmMarginRequest&& o) noexcept {
  if (this != &o) {
    release();
    device_ = o.device_;
    margin_ = o.margin_;
    o.device_ = -1;
  }
  return *this;
}

void GemmSmMarginRequest::release() {
  if (device_ < 0) return;
  auto& r = margins();
  std::lock_guard<std::mutex> lock(r.mu);
  auto& h = r.held[device_];
  auto it = h.find(margin_);
  if (it != h.end()) h.erase(it);
  publish(r, device_);
  device_ = -1;
}

int gemm_sm_margin(int device) {
  if (device < 0 || device >= 64) return 0;
  return margins().in_force[size_t(device)].load(std::memory_order_relaxed);
}

namespace {
struct AutotuneState {
  std::mutex mu;
  GemmAutotune policy;
  AutotuneState() {
    const char* v = std::getenv("MEGACORE_GEMM_AUTOTUNE");
    if (v && (std::string(v) == "0" || std::string(v) == "false" || std::string(v) == "off")) policy.enabled = false;
  }
};
AutotuneState& autotune_state() {
  static AutotuneState* s = new AutotuneState();
  return *s;
}
}  // namespace

void set_gemm_autotune(const GemmAutotune& policy) {
  MC_CHECK(policy.candidates >= 2 && policy.candidates <= 32,
           "set_gemm_autotune: candidates must be in [2, 32], got {} (to turn autotuning off set enabled = false)",
           policy.candidates);
  MC_CHECK(policy.min_gflop >= 0.0, "set_gemm_autotune: min_gflop must be >= 0, got {}", policy.min_gflop);
  auto& st = autotune_state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.policy = policy;
}

GemmAutotune gemm_autotune() {
  auto& st = autotune_state();
  std::lock_guard<std::mutex> lock(st.mu);
  return st.policy;
}

Tensor matmul(const Tensor& a, const Tensor& b, const GemmOptions& opts, const Stream& s, bool out_f32) {
  detail::check_defined(a, "matmul", "a");
  detail::check_defined(b, "matmul", "b");
  MC_CHECK(a.dim() >= 2 && b.dim() >= 2, "matmul: a {} and b {} must be at least 2-D", shape_str(a.shape()),
           shape_str(b.shape()));
  const int64_t m = opts.trans_a ? a.size(-1) : a.size(-2);
  const int64_t n = opts.trans_b ? b.size(-2) : b.size(-1);
  Shape shape{m, n};
  if (a.dim() == 3 || b.dim() == 3) shape.insert(shape.begin(), a.dim() == 3 ? a.size(0) : b.size(0));
  Tensor out = Tensor::empty(shape, out_f32 ? DType::F32 : a.dtype(), a.device(), s);
  GemmOptions o = opts;
  o.beta = 0.f;
  gemm(a, b, out, o, s);
  return out;
}

void gemm_batched(std::span<const Tensor> a, std::span<const Tensor> b, std::span<Tensor> out,
                  const GemmOptions& opts, const Stream& s) {
  MC_CHECK(a.size() == b.size() && a.size() == out.size(), "gemm_batched: {} a, {} b and {} out tensors; counts must match",
           a.size(), b.size(), out.size());
  MC_CHECK(!is_bias_grad(opts.epilogue) || a.size() <= 1,
           "gemm_batched: a bias-gradient epilogue writes one bias; call gemm per product instead");
  for (size_t i = 0; i < a.size(); ++i) gemm(a[i], b[i], out[i], opts, s);
}

}  // namespace megacore::ops
