// Tensor: a typed, strided view of a block of host or device memory.
//
// Shapes and strides are in elements. Views (view, slice, select, transpose, permute, unsqueeze)
// share storage; contiguous(), clone(), to() copy. Every operation that touches device memory
// takes the stream it runs on (a default Stream is the device's legacy default stream).
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "megacore/core/device.hpp"
#include "megacore/core/dtype.hpp"
#include "megacore/core/error.hpp"
#include "megacore/core/random.hpp"
#include "megacore/core/stream.hpp"

namespace megacore {

using Shape = std::vector<int64_t>;

/// The memory behind one or more tensors.
class Storage {
 public:
  /// Allocates nbytes on d through the device's allocator (stream s for CUDA).
  static std::shared_ptr<Storage> allocate(int64_t nbytes, Device d, const Stream& s = {});
  /// Wraps external memory; `release` runs when the last tensor using it goes away.
  static std::shared_ptr<Storage> wrap(void* data, int64_t nbytes, Device d, std::function<void()> release);
  ~Storage();
  void* data() const { return data_; }
  int64_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  bool owned() const { return owned_; }

 private:
  Storage() = default;
  void* data_ = nullptr;
  int64_t nbytes_ = 0;
  Device device_;
  bool owned_ = false;                // allocated by megacore's allocator
  std::function<void()> release_;     // external memory
};

/// Row-major (C-order) strides of a shape.
Shape contiguous_strides(const Shape& shape);
/// Number of elements of a shape; throws ValueError on a negative dimension.
int64_t shape_numel(const Shape& shape);
/// "[2, 3, 4]".
std::string shape_str(const Shape& shape);

class Tensor {
 public:
  /// An undefined tensor (defined() is false).
  Tensor() = default;
  Tensor(std::shared_ptr<Storage> storage, Shape shape, Shape strides, DType dtype, int64_t offset = 0);

  // ---- factories ----------------------------------------------------------------------------
  /// Uninitialised contiguous tensor.
  static Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu(),
                      const Stream& s = {});
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu(),
                      const Stream& s = {});
  static Tensor full(const Shape& shape, double value, DType dtype = DType::F32,
                     Device device = Device::cpu(), const Stream& s = {});
  /// Wraps memory megacore does not own; `release` (may be empty) runs when the last user is gone.
  static Tensor from_blob(void* data, const Shape& shape, const Shape& strides, DType dtype, Device device,
                          std::function<void()> release = {});
  /// Contiguous host tensor holding a copy of the values.
  template <class T>
  static Tensor from_vector(const std::vector<T>& v, const Shape& shape);

  // ---- properties -----------------------------------------------------------------------------
  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::cpu(); }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return int64_t(shape_.size()); }
  /// Size of dimension d (negative d counts from the end).
  int64_t size(int64_t d) const;
  int64_t stride(int64_t d) const;
  int64_t numel() const { return numel_; }
  int64_t element_size() const { return dtype_size(dtype_); }
  int64_t nbytes() const { return numel_ * element_size(); }
  /// Element offset of the first element into the storage.
  int64_t offset() const { return offset_; }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  /// Address of the first element.
  void* data_ptr() const;
  /// Typed address of the first element; throws ValueError if T does not match dtype().
  template <class T>
  T* data() const {
    MC_CHECK(dtype_of_v<T> == dtype_, "tensor has dtype {}, not {}", dtype_name(dtype_),
             dtype_name(dtype_of_v<T>));
    return static_cast<T*>(data_ptr());
  }
  /// "Tensor(shape=[2, 3], dtype=f32, device=cpu)".
  std::string str() const;

  // ---- views (share storage) ------------------------------------------------------------------
  /// Same elements, new shape; one dimension may be -1. Needs a contiguous tensor (use reshape).
  Tensor view(const Shape& shape) const;
  /// view() when possible, else a contiguous copy.
  Tensor reshape(const Shape& shape, const Stream& s = {}) const;
  /// Elements start, start+step, ... < end along dim (negative indices count from the end).
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const { return slice(dim, start, start + length); }
  /// Removes dimension dim, keeping index i.
  Tensor select(int64_t dim, int64_t i) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor squeeze(int64_t dim) const;
  /// Views the same bytes as another dtype of the same element size.
  Tensor view_as_dtype(DType dtype) const;

  // ---- copies ---------------------------------------------------------------------------------
  /// This tensor if contiguous, else a contiguous copy.
  Tensor contiguous(const Stream& s = {}) const;
  Tensor clone(const Stream& s = {}) const;
  /// A copy on device d (this tensor itself if already there).
  Tensor to(Device d, const Stream& s = {}) const;
  /// A copy converted to dtype (this tensor itself if already of that dtype).
  Tensor to(DType dtype, const Stream& s = {}) const;
  /// Copies src into this tensor (same shape; any devices; float dtypes convert).
  Tensor& copy_(const Tensor& src, const Stream& s = {});

  // ---- in-place fills ---------------------------------------------------------------------------
  Tensor& fill_(double value, const Stream& s = {});
  Tensor& zero_(const Stream& s = {}) { return fill_(0.0, s); }
  /// Uniform in [low, high); element i gets the same value on CPU and GPU for the same generator state.
  Tensor& uniform_(Generator& g, double low = 0.0, double high = 1.0, const Stream& s = {});
  /// Normal with the given mean and std, reproducible across devices like uniform_.
  Tensor& normal_(Generator& g, double mean = 0.0, double std = 1.0, const Stream& s = {});

  // ---- host access --------------------------------------------------------------------------------
  /// All elements as doubles in row-major order (copies from the device if needed; synchronous).
  std::vector<double> to_double_vector() const;
  /// The single element of a one-element tensor.
  double item() const;

 private:
  void check_defined(const char* what) const;
  std::shared_ptr<Storage> storage_;
  Shape shape_, strides_;
  int64_t offset_ = 0;
  int64_t numel_ = 0;
  DType dtype_ = DType::F32;
};

template <class T>
Tensor Tensor::from_vector(const std::vector<T>& v, const Shape& shape) {
  MC_CHECK(int64_t(v.size()) == shape_numel(shape), "from_vector: {} values do not fill shape {}", v.size(),
           shape_str(shape));
  Tensor t = empty(shape, dtype_of_v<T>);
  std::copy(v.begin(), v.end(), t.data<T>());
  return t;
}

}  // namespace megacore
