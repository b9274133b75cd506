// Sharded tensors: how the pieces a rank holds map onto the global (unsharded, unpadded) tensors a
// checkpoint stores, independently of the parallel layout that produced them.
//
// A ShardedTensor names one global tensor (its global shape and dtype) and lists this rank's pieces:
// rectangular boxes of its local tensor together with where each box sits in the global tensor.
// Saving writes each piece as its own entry; loading intersects the pieces a rank needs with the
// pieces in the checkpoint, so any layout loads into any other (resharding is just box intersection).
//
// How a layers::Parameter maps (see its comment): partition_dim = -1 is one piece covering the whole
// tensor; otherwise the full dimension is partition_chunks equal blocks, each split evenly over TP,
// and rank r holds its 1/TP of every block (SwiGLU fc1: [gate_r; up_r] ↔ rows r·f/T.. of gate and of
// up). The global tensor may be shorter than TP × local along the partition dimension: the vocabulary
// padding of the embedding and output layer (which depends on TP) is cut off, so the checkpoint
// stores [vocab_size, hidden] whatever the TP degree, and padding rows are never written or read.
//
// Who writes: replicas (DP/CP copies, and TP copies of replicated tensors) must not write the same
// bytes twice, so `write` is true on exactly one holder of every piece: the DP/CP rank 0 replica and,
// for replicated tensors, TP rank 0 (for MoE expert weights: expert-DP rank 0 and expert-TP rank 0). A tied embedding's copy on the last pipeline stage is loaded but
// never written.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "megacore/core/tensor.hpp"
#include "megacore/layers/parameter.hpp"

namespace megacore::model {
class GPTModel;
}
namespace megacore::optim {
struct NamedTensor;
class DistributedOptimizer;
}
namespace megacore::parallel {
class ProcessGrid;
}

namespace megacore::checkpoint {

/// One rectangular box: `shape` elements starting at `local_offsets` in the local tensor and at
/// `global_offsets` in the global tensor. When `data` is defined (of shape `shape`), it holds the box's
/// elements instead (the source when saving, the destination when loading; `local_offsets` unused):
/// for pieces that are not boxes of one local tensor, such as ZeRO shards (shard_zero_state).
struct ShardPiece {
  Shape local_offsets;
  Shape global_offsets;
  Shape shape;
  Tensor data;
};

/// A global tensor and this rank's pieces of it. `local` is the rank's tensor (the source when
/// saving, the destination when loading; any device).
struct ShardedTensor {
  std::string name;
  Shape global_shape;
  DType dtype = DType::F32;
  Tensor local;
  std::vector<ShardPiece> pieces;
  /// Whether this rank writes its pieces when saving (false on replicas whose copy another rank writes).
  bool write = true;
  /// A tied embedding's copy on a stage other than the first (shard_model): never written, by any rank.
  bool tied_copy = false;
  /// Loading accepts another floating dtype in the checkpoint and converts it (optimizer state, so a run
  /// can resume with another state precision); false: a dtype mismatch is an IOError (model weights).
  bool convert_dtype = false;
};

/// Where this rank sits for sharding purposes.
struct ShardLayout {
  int tp_rank = 0;
  int tp_size = 1;
  /// True on the one DP/CP replica that writes (DP rank 0 and CP rank 0).
  bool replica_writer = true;
  /// For expert parameters (Parameter::expert): the expert-TP position, and whether this rank is the one
  /// expert-DP replica that writes (expert-DP rank 0). EP needs nothing here: each rank's experts sit at
  /// their expert_offset.
  int expert_tp_rank = 0;
  int expert_tp_size = 1;
  bool expert_replica_writer = true;
};

/// TP rank/size from the grid's TP group (1 if not built); replica_writer when DP and CP ranks are 0;
/// expert-TP rank/size and expert_replica_writer (expert-DP rank 0) from the grid's layout.
ShardLayout shard_layout(const parallel::ProcessGrid& grid);

/// A one-piece tensor covering all of `t` (replicated; written when `write`).
ShardedTensor replicated_tensor(const std::string& name, const Tensor& t, bool write = true);

/// The pieces of parameter `p` (name = p.name). `global_shape` empty derives it (local × TP along
/// partition_dim); a shorter extent along partition_dim cuts padding off the end (partition_chunks must
/// then be 1). An expert parameter is split over expert-TP instead of TP, its global dim 0 is num_experts
/// and its pieces sit at expert_offset along it, so a checkpoint holds [num_experts, ...] whatever the EP
/// degree; it is written by expert-DP rank 0. ValueError when the shapes cannot correspond.
ShardedTensor shard_parameter(const layers::Parameter& p, const ShardLayout& layout, const Shape& global_shape = {});

/// Every parameter of a (stage of a) GPTModel, with the vocabulary padding cut off the embedding,
/// output layer and their optimizer state; a tied embedding's copy held by a stage that is not the
/// first is marked write = false.
std::vector<ShardedTensor> shard_model(const model::GPTModel& model, const ShardLayout& layout);

/// Optimizer state ("<param>.<kind>", e.g. AdamW::state() or a ZeRO gathered state) mapped like its
/// parameter, whose description must be in `params`; names get `prefix` ("optimizer." by default).
/// The tensors keep their dtypes and convert on load (convert_dtype). ValueError when a state tensor's parameter is unknown or its shape differs from the parameter's.
std::vector<ShardedTensor> shard_optimizer_state(const std::vector<optim::NamedTensor>& state,
                                                 const std::vector<ShardedTensor>& params,
                                                 const std::string& prefix = "optimizer.");

/// A ZeRO-1 optimizer's state as this rank's own pieces, named like shard_optimizer_state
/// ("optimizer.<param>.master", ".exp_avg", ".exp_avg_sq"): for every parameter, the flat range this
/// rank owns of its TP-local shard (DistributedOptimizer::owned_ranges), cut into boxes of the global
/// tensor whose `data` are views of the live state (in the state's dtypes, converted on load). Every rank of the DDP group writes its own pieces
/// (no gather; TP-replicated parameters on TP rank 0 only, a tied copy never), and loading into them
/// writes the state in place — call opt.finish_load(step) afterwards. The pieces of all ranks tile each
/// tensor like shard_optimizer_state's do, so checkpoints of either kind load into any layout.
/// `params` must describe the optimizer's parameters (shard_model); ValueError otherwise.
std::vector<ShardedTensor> shard_zero_state(const optim::DistributedOptimizer& opt,
                                            const std::vector<ShardedTensor>& params, const ShardLayout& layout,
                                            const std::string& prefix = "optimizer.");

/// Boxes (offsets, shape) of a row-major tensor of shape `shape` that together cover the flat element
/// range [begin, end) in order, each one contiguous in memory: at most 2·dim − 1 of them.
std::vector<std::pair<Shape, Shape>> flat_range_boxes(const Shape& shape, int64_t begin, int64_t end);

/// CRC-32 (IEEE 802.3, the polynomial of zlib's crc32, so Python's zlib.crc32 gives the same value),
/// continuing from `crc` (0 to start). Slicing-by-8 in software; what format-1 checkpoints carry.
uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);

/// CRC-32C (Castagnoli, as iSCSI, ext4 and TFRecord use it), continuing from `crc` (0 to start): what
/// format-2 checkpoints carry. SSE4.2's crc32 instruction where the CPU has it (about 3 bytes per cycle),
/// else slicing-by-8; both give the same values.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
/// The CRC-32C of the concatenation A·B from crc32c(A), crc32c(B) and B's length in bytes, so chunks of
/// one tensor can be checksummed on different threads.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
namespace detail {
/// crc32c() without the hardware path (tests compare the two).
uint32_t crc32c_software(const void* data, size_t n, uint32_t crc = 0);
}  // namespace detail

}  // namespace megacore::checkpoint
