// ParamAndGradBuffer: the parameters and their main_grads (f32, or bf16) laid out in contiguous buffers, split
// into buckets, so data-parallel reduction is one collective per bucket instead of one per tensor.
//
// Layout (Megatron-Core's _ParamAndGradBuffer, re-derived):
//   - one group per parameter dtype; each group owns a param buffer (that dtype) and a grad buffer
//     (BufferConfig::grad_dtype: f32, or bf16 as Megatron-Core's main_grads_dtype) of the same length and layout;
//   - parameters are placed in the REVERSE of the order given: GPTModel::parameters() runs from the
//     embedding to the output layer, backward produces gradients from the output layer back, so the
//     first bucket is the first one whose gradients are all final;
//   - every parameter starts at a multiple of `param_align` elements (16-byte vector access on the GPU);
//   - a bucket is closed once it holds at least `bucket_size` elements (a parameter is never split),
//     and its length is padded to a multiple of dp_size × param_align, so a DP reduce-scatter of the
//     bucket divides evenly and every rank's shard starts aligned. Padding stays zero;
//   - BufferConfig::separate parameters fill buckets of their own (Bucket::separate), so a bucket never mixes
//     them with the others: the separate and the other parameters each fill their own open bucket in the
//     order above, and the closed buckets are laid out by their first parameter (ZeRO-1 gathers the FP8
//     linears' weights this way as FP8 codes, optim/fp8_param_gather.hpp).
// Construction re-points every Parameter's `data` and `main_grad` to views of the buffers, copying the
// current values in. Other Parameter objects that alias a registered one (the output layer's copy of a
// tied embedding weight) must be passed as `shared_copies` so they are re-pointed too — otherwise they
// would keep reading the old tensors.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "megacore/core/tensor.hpp"
#include "megacore/layers/parameter.hpp"

namespace megacore::optim {

/// Megatron-Core's default bucket size: max(40M, 1M × DP) elements.
int64_t default_bucket_size(int dp_size);

struct BufferConfig {
  /// Elements per bucket (a bucket closes once it reaches this); 0 = default_bucket_size(dp_size);
  /// a negative value puts everything of a dtype in one bucket.
  int64_t bucket_size = 0;
  /// Bucket lengths are padded to a multiple of dp_size × param_align.
  int dp_size = 1;
  /// Every parameter starts at a multiple of this many elements (>= 1).
  int64_t param_align = 64;
  /// The main gradients' dtype: F32 or BF16 (every backward accumulates into them in this dtype).
  DType grad_dtype = DType::F32;
  /// Parameters kept in buckets of their own (each must be registered; empty: none).
  std::vector<const layers::Parameter*> separate;
};

/// One bucket: a contiguous range [offset, offset + numel) of its group's buffers.
struct Bucket {
  int index = 0;    ///< position in ParamAndGradBuffer::buckets()
  int group = 0;    ///< dtype group
  int64_t offset = 0;
  int64_t numel = 0;  ///< padded length
  bool separate = false;  ///< holds BufferConfig::separate parameters (and only those)
  /// Indices into ParamAndGradBuffer::parameters() of the parameters it holds, in buffer order.
  std::vector<size_t> params;
};

/// Where one parameter lives.
struct ParamLocation {
  int group = 0;
  int bucket = 0;
  int64_t offset = 0;  ///< element offset in the group's buffers
  int64_t numel = 0;
};

class ParamAndGradBuffer {
 public:
  /// `params` (each once, all on one device, contiguous data and an f32/bf16 main_grad of the same shape)
  /// must outlive the buffer. ValueError for a null, duplicated or grad-sharing parameter, a shared copy
  /// that aliases no registered parameter, or a bad config.
  ParamAndGradBuffer(std::vector<layers::Parameter*> params, const BufferConfig& cfg = {},
                     std::vector<layers::Parameter*> shared_copies = {});
  ParamAndGradBuffer(const ParamAndGradBuffer&) = delete;
  ParamAndGradBuffer& operator=(const ParamAndGradBuffer&) = delete;

  /// The parameters in the order given at construction.
  const std::vector<layers::Parameter*>& parameters() const { return params_; }
  const BufferConfig& config() const { return cfg_; }
  /// The bucket size actually used (the default resolved).
  int64_t bucket_size() const { return bucket_size_; }
  Device device() const { return device_; }

  int num_groups() const { return int(groups_.size()); }
  DType group_dtype(int g) const { return groups_.at(size_t(g)).dtype; }
  /// The whole param buffer of a group (1-D, the group's dtype) and its grad buffer (1-D, grad_dtype).
  const Tensor& param_buffer(int g) const { return groups_.at(size_t(g)).params; }
  const Tensor& grad_buffer(int g) const { return groups_.at(size_t(g)).grads; }

  /// Buckets of all groups, group by group, each in buffer order (= the order backward fills them).
  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// 1-D views of a bucket's parameters and gradients (padding included).
  Tensor bucket_params(int b) const;
  Tensor bucket_grads(int b) const;

  /// True when the parameter (or a shared copy of one) is registered.
  bool contains(const layers::Parameter* p) const { return index_.count(p) != 0; }
  /// Index into parameters(); ValueError naming the parameter when it is not registered.
  size_t index_of(const layers::Parameter* p) const;
  const ParamLocation& location(size_t i) const { return locations_.at(i); }
  const ParamLocation& location(const layers::Parameter* p) const { return locations_[index_of(p)]; }

  /// Elements of all groups, padding included, and the parameters' own elements.
  int64_t numel() const;
  int64_t param_numel() const { return param_numel_; }
  /// Zeroes every gradient (and the padding).
  void zero_grads(const Stream& s = {});

 private:
  struct Group {
    DType dtype;
    Tensor params, grads;
  };
  BufferConfig cfg_;
  int64_t bucket_size_ = 0;
  Device device_;
  std::vector<layers::Parameter*> params_;
  std::vector<ParamLocation> locations_;
  std::vector<Group> groups_;
  std::vector<Bucket> buckets_;
  std::unordered_map<const layers::Parameter*, size_t> index_;  // registered parameters and shared copies
  int64_t param_numel_ = 0;
};

}  // namespace megacore::optim
