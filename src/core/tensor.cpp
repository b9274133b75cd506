#include "megacore/core/tensor.hpp"
#include "megacore/core/host_sync.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/cuda_backend.hpp"
#include "megacore/core/allocator.hpp"

namespace megacore {

// ---- storage ------------------------------------------------------------------------------------

std::shared_ptr<Storage> Storage::allocate(int64_t nbytes, Device d, const Stream& s) {
  MC_CHECK(nbytes >= 0, "cannot allocate a negative number of bytes ({})", nbytes);
  auto st = std::shared_ptr<Storage>(new Storage());
  st->data_ = Allocator::get(d).allocate(size_t(nbytes), s);
  st->nbytes_ = nbytes;
  st->device_ = d;
  st->owned_ = true;
  return st;
}

std::shared_ptr<Storage> Storage::wrap(void* data, int64_t nbytes, Device d, std::function<void()> release) {
  auto st = std::shared_ptr<Storage>(new Storage());
  st->data_ = data;
  st->nbytes_ = nbytes;
  st->device_ = d;
  st->release_ = std::move(release);
  return st;
}

Storage::~Storage() {
  try {
    if (owned_) Allocator::get(device_).deallocate(data_);
    else if (release_) release_();
  } catch (...) {
    // A destructor must not throw; the only failure here is a CUDA context already torn down at exit.
  }
}

// ---- shape helpers --------------------------------------------------------------------------------

Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t acc = 1;
  for (int64_t i = int64_t(shape.size()) - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= std::max<int64_t>(shape[i], 1);
  }
  return st;
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    MC_CHECK(s >= 0, "invalid shape {}: dimensions must be >= 0", shape_str(shape));
    n *= s;
  }
  return n;
}

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

namespace {

int64_t wrap_dim(int64_t d, int64_t ndim, const char* what) {
  int64_t w = d < 0 ? d + ndim : d;
  MC_CHECK(w >= 0 && w < ndim, "{}: dimension {} is out of range for a tensor with {} dimension(s)", what, d, ndim);
  return w;
}

cuda_impl::StridedDesc desc_of(const Tensor& t) {
  MC_CHECK(t.dim() <= cuda_impl::kMaxDims, "tensors on CUDA support at most {} dimensions, got {}", cuda_impl::kMaxDims,
           t.dim());
  cuda_impl::StridedDesc d;
  d.ndim = int(t.dim());
  for (int i = 0; i < d.ndim; ++i) {
    d.shape[i] = t.shape()[i];
    d.stride[i] = t.strides()[i];
  }
  d.numel = t.numel();
  return d;
}

// Calls f(element_offset) for every element in row-major logical order.
template <class F>
void for_each_offset(const Shape& shape, const Shape& strides, int64_t base, F&& f) {
  int64_t n = shape_numel(shape);
  if (n == 0) return;
  size_t nd = shape.size();
  if (nd == 0) {
    f(base);
    return;
  }
  std::vector<int64_t> idx(nd, 0);
  int64_t off = base;
  for (int64_t i = 0; i < n; ++i) {
    f(off);
    for (int64_t k = int64_t(nd) - 1; k >= 0; --k) {
      if (++idx[k] < shape[k]) {
        off += strides[k];
        break;
      }
      off -= strides[k] * (shape[k] - 1);
      idx[k] = 0;
    }
  }
}

template <class D, class S>
D convert(S v) {
  if constexpr (is_narrow_float_v<S>) {
    return convert<D, float>(float(v));
  } else if constexpr (is_narrow_float_v<D>) {
    return D(float(v));
  } else {
    return static_cast<D>(v);
  }
}

void check_stream_device(const Stream& s, Device d, const char* what) {
  MC_CHECK(s.device().is_cpu() || s.device() == d, "{}: stream is on {} but the tensor is on {}", what,
           s.device().str(), d.str());
}

void* stream_for(const Stream& s) { return s.device().is_cpu() ? nullptr : s.native(); }

}  // namespace

// ---- tensor ---------------------------------------------------------------------------------------

Tensor::Tensor(std::shared_ptr<Storage> storage, Shape shape, Shape strides, DType dtype, int64_t offset)
    : storage_(std::move(storage)), shape_(std::move(shape)), strides_(std::move(strides)), offset_(offset),
      dtype_(dtype) {
  MC_CHECK(storage_ != nullptr, "a tensor needs storage");
  MC_CHECK(shape_.size() == strides_.size(), "shape {} and strides {} have different lengths", shape_str(shape_),
           shape_str(strides_));
  numel_ = shape_numel(shape_);
  MC_CHECK(offset_ >= 0, "tensor offset must be >= 0, got {}", offset_);
  if (numel_ > 0) {
    int64_t lo = offset_, hi = offset_;
    for (size_t i = 0; i < shape_.size(); ++i) {
      int64_t span = (shape_[i] - 1) * strides_[i];
      (span < 0 ? lo : hi) += span;
    }
    MC_CHECK(lo >= 0 && (hi + 1) * dtype_size(dtype_) <= storage_->nbytes(),
             "view with shape {}, strides {}, offset {} ({}) reaches elements [{}, {}] outside its storage of {} bytes",
             shape_str(shape_), shape_str(strides_), offset_, dtype_name(dtype_), lo, hi, storage_->nbytes());
  }
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device, const Stream& s) {
  int64_t n = shape_numel(shape);
  check_device(device);
  return Tensor(Storage::allocate(n * dtype_size(dtype), device, s), shape, contiguous_strides(shape), dtype);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device, const Stream& s) {
  Tensor t = empty(shape, dtype, device, s);
  t.fill_(0.0, s);
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device, const Stream& s) {
  Tensor t = empty(shape, dtype, device, s);
  t.fill_(value, s);
  return t;
}

Tensor Tensor::from_blob(void* data, const Shape& shape, const Shape& strides, DType dtype, Device device,
                         std::function<void()> release) {
  MC_CHECK(data != nullptr || shape_numel(shape) == 0, "from_blob: null data pointer for a non-empty tensor");
  MC_CHECK(shape.size() == strides.size(), "from_blob: shape {} and strides {} have different lengths",
           shape_str(shape), shape_str(strides));
  // The storage spans exactly the elements the strides reach.
  int64_t hi = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    MC_CHECK(strides[i] >= 0, "from_blob: negative strides are not supported (dimension {} has stride {})", i,
             strides[i]);
    if (shape[i] > 0) hi += (shape[i] - 1) * strides[i];
  }
  int64_t nbytes = shape_numel(shape) == 0 ? 0 : (hi + 1) * dtype_size(dtype);
  return Tensor(Storage::wrap(data, nbytes, device, std::move(release)), shape, strides, dtype);
}

void Tensor::check_defined(const char* what) const {
  MC_CHECK(defined(), "{} called on an undefined tensor", what);
}

int64_t Tensor::size(int64_t d) const { return shape_[wrap_dim(d, dim(), "size")]; }
int64_t Tensor::stride(int64_t d) const { return strides_[wrap_dim(d, dim(), "stride")]; }

bool Tensor::is_contiguous() const {
  int64_t expect = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expect) return false;
    expect *= shape_[i];
  }
  return true;
}

void* Tensor::data_ptr() const {
  check_defined("data_ptr");
  return static_cast<char*>(storage_->data()) + offset_ * element_size();
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return fmt::format("Tensor(shape={}, dtype={}, device={})", shape_str(shape_), dtype_name(dtype_), device().str());
}

Tensor Tensor::view(const Shape& shape) const {
  check_defined("view");
  Shape s = shape;
  int64_t infer = -1, known = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      MC_CHECK(infer < 0, "view {}: only one dimension may be -1", shape_str(shape));
      infer = int64_t(i);
    } else {
      MC_CHECK(s[i] >= 0, "view {}: dimensions must be >= 0 or -1", shape_str(shape));
      known *= s[i];
    }
  }
  if (infer >= 0) {
    MC_CHECK(known > 0 && numel_ % known == 0, "view {}: cannot infer -1 for a tensor of {} elements",
             shape_str(shape), numel_);
    s[infer] = numel_ / known;
  }
  MC_CHECK(shape_numel(s) == numel_, "view: shape {} has {} elements but the tensor {} has {}", shape_str(shape),
           shape_numel(s), shape_str(shape_), numel_);
  MC_CHECK(is_contiguous(), "view {} of a non-contiguous tensor (shape {}, strides {}); call contiguous() or "
           "reshape() first", shape_str(shape), shape_str(shape_), shape_str(strides_));
  return Tensor(storage_, s, contiguous_strides(s), dtype_, offset_);
}

Tensor Tensor::reshape(const Shape& shape, const Stream& s) const {
  return is_contiguous() ? view(shape) : contiguous(s).view(shape);
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  check_defined("slice");
  d = wrap_dim(d, dim(), "slice");
  MC_CHECK(step > 0, "slice: step must be positive, got {}", step);
  int64_t n = shape_[d];
  if (start < 0) start += n;
  if (end < 0) end += n;
  end = std::min(end, n);
  MC_CHECK(start >= 0 && start <= n, "slice: start {} is out of range for dimension {} of size {}", start, d, n);
  MC_CHECK(end >= start, "slice: end {} is before start {} in dimension {}", end, start, d);
  Shape sh = shape_, st = strides_;
  sh[d] = (end - start + step - 1) / step;
  st[d] = strides_[d] * step;
  return Tensor(storage_, sh, st, dtype_, offset_ + start * strides_[d]);
}

Tensor Tensor::select(int64_t d, int64_t i) const {
  check_defined("select");
  d = wrap_dim(d, dim(), "select");
  int64_t n = shape_[d];
  int64_t j = i < 0 ? i + n : i;
  MC_CHECK(j >= 0 && j < n, "select: index {} is out of range for dimension {} of size {}", i, d, n);
  Shape sh = shape_, st = strides_;
  sh.erase(sh.begin() + d);
  st.erase(st.begin() + d);
  return Tensor(storage_, sh, st, dtype_, offset_ + j * strides_[d]);
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  check_defined("transpose");
  d0 = wrap_dim(d0, dim(), "transpose");
  d1 = wrap_dim(d1, dim(), "transpose");
  Shape sh = shape_, st = strides_;
  std::swap(sh[d0], sh[d1]);
  std::swap(st[d0], st[d1]);
  return Tensor(storage_, sh, st, dtype_, offset_);
}

Tensor Tensor::permute(const std::vector<int64_t>& dims) const {
  check_defined("permute");
  MC_CHECK(int64_t(dims.size()) == dim(), "permute: got {} dims for a tensor with {} dimensions", dims.size(), dim());
  std::vector<bool> seen(dims.size(), false);
  Shape sh(dims.size()), st(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = wrap_dim(dims[i], dim(), "permute");
    MC_CHECK(!seen[d], "permute: dimension {} appears twice in {}", d, shape_str(dims));
    seen[d] = true;
    sh[i] = shape_[d];
    st[i] = strides_[d];
  }
  return Tensor(storage_, sh, st, dtype_, offset_);
}

Tensor Tensor::unsqueeze(int64_t d) const {
  check_defined("unsqueeze");
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  Shape sh = shape_, st = strides_;
  int64_t stride = d < dim() ? strides_[d] * shape_[d] : 1;
  sh.insert(sh.begin() + d, 1);
  st.insert(st.begin() + d, stride);
  return Tensor(storage_, sh, st, dtype_, offset_);
}

Tensor Tensor::squeeze(int64_t d) const {
  check_defined("squeeze");
  d = wrap_dim(d, dim(), "squeeze");
  MC_CHECK(shape_[d] == 1, "squeeze: dimension {} has size {}, not 1", d, shape_[d]);
  Shape sh = shape_, st = strides_;
  sh.erase(sh.begin() + d);
  st.erase(st.begin() + d);
  return Tensor(storage_, sh, st, dtype_, offset_);
}

Tensor Tensor::view_as_dtype(DType dt) const {
  check_defined("view_as_dtype");
  MC_CHECK(dtype_size(dt) == element_size(), "view_as_dtype: {} has {} bytes per element but {} has {}",
           dtype_name(dt), dtype_size(dt), dtype_name(dtype_), element_size());
  return Tensor(storage_, shape_, strides_, dt, offset_);
}

Tensor Tensor::contiguous(const Stream& s) const {
  check_defined("contiguous");
  return is_contiguous() ? *this : clone(s);
}

Tensor Tensor::clone(const Stream& s) const {
  check_defined("clone");
  Tensor out = empty(shape_, dtype_, device(), s);
  out.copy_(*this, s);
  return out;
}

Tensor Tensor::to(Device d, const Stream& s) const {
  check_defined("to");
  if (d == device()) return *this;
  Tensor out = empty(shape_, dtype_, d, d.is_cuda() ? s : Stream{});
  out.copy_(*this, s);
  return out;
}

Tensor Tensor::to(DType dt, const Stream& s) const {
  check_defined("to");
  if (dt == dtype_) return *this;
  Tensor out = empty(shape_, dt, device(), s);
  out.copy_(*this, s);
  return out;
}

namespace {
void cpu_copy(const Tensor& dst, const Tensor& src) {
  dispatch_dtype(dst.dtype(), [&](auto dtag) {
    using D = decltype(dtag);
    dispatch_dtype(src.dtype(), [&](auto stag) {
      using S = decltype(stag);
      D* dp = static_cast<D*>(dst.storage()->data());
      const S* sp = static_cast<const S*>(src.storage()->data());
      if (dst.is_contiguous() && src.is_contiguous()) {
        D* d = dp + dst.offset();
        const S* sv = sp + src.offset();
        for (int64_t i = 0; i < dst.numel(); ++i) d[i] = convert<D, S>(sv[i]);
        return;
      }
      std::vector<int64_t> soffs;
      soffs.reserve(size_t(src.numel()));
      for_each_offset(src.shape(), src.strides(), src.offset(), [&](int64_t o) { soffs.push_back(o); });
      size_t k = 0;
      for_each_offset(dst.shape(), dst.strides(), dst.offset(), [&](int64_t o) { dp[o] = convert<D, S>(sp[soffs[k++]]); });
    });
  });
}
}  // namespace

Tensor& Tensor::copy_(const Tensor& src, const Stream& s) {
  check_defined("copy_");
  MC_CHECK(src.defined(), "copy_: source tensor is undefined");
  MC_CHECK(src.shape() == shape_, "copy_: source shape {} does not match destination shape {}", shape_str(src.shape()),
           shape_str(shape_));
  if (numel_ == 0) return *this;
  Device dd = device(), sd = src.device();
  if (dd.is_cpu() && sd.is_cpu()) {
    cpu_copy(*this, src);
    return *this;
  }
  if (dd.is_cuda() && sd.is_cuda()) {
    MC_CHECK(dd == sd, "copy_: copies between two CUDA devices ({} and {}) are not supported; go through the host or "
             "a communicator", sd.str(), dd.str());
    check_stream_device(s, dd, "copy_");
    cuda_impl::copy(data_ptr(), dtype_, desc_of(*this), src.data_ptr(), src.dtype(), desc_of(src), stream_for(s),
                    dd.index);
    return *this;
  }
  if (dd.is_cuda()) {  // host -> device: stage a contiguous host copy of the source's dtype
    check_stream_device(s, dd, "copy_");
    Tensor hs = src.contiguous();
    if (is_contiguous() && dtype_ == hs.dtype()) {
      cuda_impl::memcpy_async(data_ptr(), hs.data_ptr(), size_t(nbytes()), cuda_impl::CopyKind::HostToDevice,
                              stream_for(s), dd.index);
      // Pageable sources are staged before cudaMemcpyAsync returns, so hs may go away now.
    } else {
      Tensor staged = empty(shape_, hs.dtype(), dd, s);
      cuda_impl::memcpy_async(staged.data_ptr(), hs.data_ptr(), size_t(hs.nbytes()), cuda_impl::CopyKind::HostToDevice,
                              stream_for(s), dd.index);
      copy_(staged, s);
    }
    return *this;
  }
  // device -> host: the host reads the result, so this waits for the stream.
  check_stream_device(s, sd, "copy_");
  note_host_sync(HostSyncReason::current("copy_to_host"));
  Tensor ds = src.contiguous(s);
  if (is_contiguous() && dtype_ == ds.dtype()) {
    cuda_impl::memcpy_async(data_ptr(), ds.data_ptr(), size_t(nbytes()), cuda_impl::CopyKind::DeviceToHost,
                            stream_for(s), sd.index);
    cuda_impl::stream_synchronize(stream_for(s), sd.index);
  } else {
    Tensor staged = empty(shape_, ds.dtype());
    cuda_impl::memcpy_async(staged.data_ptr(), ds.data_ptr(), size_t(ds.nbytes()), cuda_impl::CopyKind::DeviceToHost,
                            stream_for(s), sd.index);
    cuda_impl::stream_synchronize(stream_for(s), sd.index);
    cpu_copy(*this, staged);
  }
  return *this;
}

Tensor& Tensor::fill_(double value, const Stream& s) {
  check_defined("fill_");
  if (device().is_cuda()) {
    check_stream_device(s, device(), "fill_");
    cuda_impl::fill(data_ptr(), dtype_, desc_of(*this), value, stream_for(s), device().index);
    return *this;
  }
  dispatch_dtype(dtype_, [&](auto tag) {
    using T = decltype(tag);
    T v = convert<T, double>(value);
    T* p = static_cast<T*>(storage_->data());
    for_each_offset(shape_, strides_, offset_, [&](int64_t o) { p[o] = v; });
  });
  return *this;
}

namespace {
Tensor& random_fill(Tensor& t, Generator& g, cuda_impl::RandomKind kind, double a, double b, const Stream& s) {
  MC_CHECK(t.defined(), "random fill of an undefined tensor");
  MC_CHECK(is_floating(t.dtype()), "random fills need a floating-point tensor (f32, bf16, f16), got {}",
           dtype_name(t.dtype()));
  uint64_t seed = g.seed(), offset = g.next_offset();
  if (t.device().is_cuda()) {
    check_stream_device(s, t.device(), "random fill");
    cuda_impl::random(t.data_ptr(), t.dtype(), desc_of(t), kind, seed, offset, a, b, stream_for(s),
                      t.device().index);
    return t;
  }
  dispatch_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(t.storage()->data());
    uint64_t i = 0;
    for_each_offset(t.shape(), t.strides(), t.offset(), [&](int64_t o) {
      float r = kind == cuda_impl::RandomKind::Uniform ? philox_uniform(seed, offset, i) : philox_normal(seed, offset, i);
      float v = kind == cuda_impl::RandomKind::Uniform ? float(a) + (float(b) - float(a)) * r : float(a) + float(b) * r;
      p[o] = convert<T, float>(v);
      ++i;
    });
  });
  return t;
}
}  // namespace

Tensor& Tensor::uniform_(Generator& g, double low, double high, const Stream& s) {
  MC_CHECK(low <= high, "uniform_: low {} is greater than high {}", low, high);
  return random_fill(*this, g, cuda_impl::RandomKind::Uniform, low, high, s);
}

Tensor& Tensor::normal_(Generator& g, double mean, double std, const Stream& s) {
  MC_CHECK(std >= 0, "normal_: std must be >= 0, got {}", std);
  return random_fill(*this, g, cuda_impl::RandomKind::Normal, mean, std, s);
}

std::vector<double> Tensor::to_double_vector() const {
  check_defined("to_double_vector");
  Tensor h = to(Device::cpu());
  std::vector<double> out;
  out.reserve(size_t(numel_));
  dispatch_dtype(h.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(h.storage()->data());
    for_each_offset(h.shape(), h.strides(), h.offset(), [&](int64_t o) {
      if constexpr (std::is_integral_v<T>) out.push_back(double(p[o]));
      else out.push_back(double(float(p[o])));
    });
  });
  return out;
}

double Tensor::item() const {
  check_defined("item");
  MC_CHECK(numel_ == 1, "item() needs a tensor with one element, got shape {}", shape_str(shape_));
  return to_double_vector()[0];
}

}  // namespace megacore
