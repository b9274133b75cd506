// Sharded tensor descriptions (see sharded_tensor.hpp).
#include "megacore/checkpoint/sharded_tensor.hpp"

#include <algorithm>

#include "megacore/core/error.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/optim/distributed_optimizer.hpp"
#include "megacore/optim/optimizer.hpp"
#include "megacore/parallel/process_grid.hpp"

namespace megacore::checkpoint {

namespace {

std::string shape_text(const Shape& s) { return shape_str(s); }

}  // namespace

ShardLayout shard_layout(const parallel::ProcessGrid& grid) {
  ShardLayout l;
  if (grid.has_group(parallel::GroupKind::Tp)) {
    l.tp_rank = grid.tp().rank();
    l.tp_size = grid.tp().size();
  } else {
    l.tp_rank = grid.tp_rank();
    l.tp_size = grid.layout().tp_size();
  }
  l.replica_writer = grid.dp_rank() == 0 && grid.cp_rank() == 0;
  l.expert_tp_rank = grid.layout().expert_tp_rank(grid.rank());
  l.expert_tp_size = grid.layout().expert_tp_size();
  l.expert_replica_writer = grid.layout().expert_dp_rank(grid.rank()) == 0;
  return l;
}

ShardedTensor replicated_tensor(const std::string& name, const Tensor& t, bool write) {
  MC_CHECK(t.defined(), "checkpoint: tensor '{}' is undefined; pass a defined tensor", name);
  ShardedTensor st;
  st.name = name;
  st.global_shape = t.shape();
  st.dtype = t.dtype();
  st.local = t;
  st.write = write;
  st.pieces.push_back({Shape(t.shape().size(), 0), Shape(t.shape().size(), 0), t.shape(), Tensor()});
  return st;
}

ShardedTensor shard_parameter(const layers::Parameter& p, const ShardLayout& layout, const Shape& global_shape) {
  MC_CHECK(p.data.defined(), "checkpoint: parameter '{}' has no data", p.name);
  if (p.expert) {
    // Split over expert-TP like a dense weight over TP, then placed among all experts along dim 0.
    MC_CHECK(p.data.dim() >= 1 && p.partition_dim != 0 && p.num_experts >= 1 && p.expert_offset >= 0 &&
                 p.expert_offset + p.data.size(0) <= p.num_experts,
             "checkpoint: expert parameter '{}' (shape {}, partition_dim {}) holds experts [{}, {}) of {}; an expert "
             "weight needs dim 0 = its local experts inside [0, num_experts) and a partition_dim other than 0",
             p.name, shape_text(p.data.shape()), p.partition_dim, p.expert_offset,
             p.expert_offset + (p.data.dim() >= 1 ? p.data.size(0) : 0), p.num_experts);
    layers::Parameter local = p;
    local.expert = false;
    ShardLayout el = layout;
    el.tp_rank = layout.expert_tp_rank;
    el.tp_size = layout.expert_tp_size;
    el.replica_writer = layout.expert_replica_writer;
    Shape gs = global_shape;
    if (!gs.empty()) {
      MC_CHECK(gs[0] == p.num_experts, "checkpoint: expert parameter '{}' has {} experts but global shape {} was asked",
               p.name, p.num_experts, shape_text(gs));
      gs[0] = p.data.size(0);
    }
    ShardedTensor st = shard_parameter(local, el, gs);
    st.global_shape[0] = p.num_experts;
    for (ShardPiece& pc : st.pieces) pc.global_offsets[0] += p.expert_offset;
    return st;
  }
  MC_CHECK(layout.tp_size >= 1 && layout.tp_rank >= 0 && layout.tp_rank < layout.tp_size,
           "checkpoint: TP rank {} of size {} is not a valid position; pass 0 <= tp_rank < tp_size", layout.tp_rank,
           layout.tp_size);
  const Shape& ls = p.data.shape();
  const int64_t nd = int64_t(ls.size());
  if (p.partition_dim < 0) {
    ShardedTensor st = replicated_tensor(p.name, p.data, layout.replica_writer && layout.tp_rank == 0);
    if (!global_shape.empty()) {
      MC_CHECK(global_shape == ls, "checkpoint: replicated parameter '{}' has shape {} but global shape {} was asked",
               p.name, shape_text(ls), shape_text(global_shape));
    }
    return st;
  }
  const int64_t d = p.partition_dim;
  MC_CHECK(d < nd, "checkpoint: parameter '{}' has partition_dim {} but only {} dimensions", p.name, d, nd);
  const int64_t c = std::max(1, p.partition_chunks);
  MC_CHECK(ls[size_t(d)] % c == 0,
           "checkpoint: parameter '{}' has {} rows along dim {}, not divisible into its {} partition_chunks", p.name,
           ls[size_t(d)], d, c);
  const int64_t b = ls[size_t(d)] / c;     // this rank's rows of one block
  const int64_t B = b * layout.tp_size;    // one block of the full tensor
  Shape gs = ls;
  gs[size_t(d)] = B * c;
  if (!global_shape.empty()) {
    bool ok = int64_t(global_shape.size()) == nd;
    for (int64_t i = 0; ok && i < nd; ++i)
      ok = i == d ? (global_shape[size_t(i)] <= gs[size_t(i)] && (c == 1 || global_shape[size_t(i)] == gs[size_t(i)]))
                  : global_shape[size_t(i)] == ls[size_t(i)];
    MC_CHECK(ok,
             "checkpoint: parameter '{}' (local shape {}, split over {} ranks along dim {} in {} chunks, so at most {}) "
             "cannot have global shape {}",
             p.name, shape_text(ls), layout.tp_size, d, c, shape_text(gs), shape_text(global_shape));
    gs = global_shape;
  }
  ShardedTensor st;
  st.name = p.name;
  st.global_shape = gs;
  st.dtype = p.data.dtype();
  st.local = p.data;
  st.write = layout.replica_writer;
  for (int64_t j = 0; j < c; ++j) {
    const int64_t g0 = j * B + layout.tp_rank * b;
    const int64_t g1 = std::min(g0 + b, gs[size_t(d)]);
    if (g1 <= g0) continue;  // all padding
    ShardPiece piece{Shape(size_t(nd), 0), Shape(size_t(nd), 0), ls, Tensor()};
    piece.local_offsets[size_t(d)] = j * b;
    piece.global_offsets[size_t(d)] = g0;
    piece.shape[size_t(d)] = g1 - g0;
    st.pieces.push_back(std::move(piece));
  }
  return st;
}

std::vector<ShardedTensor> shard_model(const model::GPTModel& m, const ShardLayout& layout) {
  const model::TransformerConfig& cfg = m.config();
  std::vector<ShardedTensor> out;
  for (const layers::Parameter* p : m.parameters()) {
    Shape gs;
    // The vocabulary padding depends on TP; the checkpoint stores the real rows only.
    if ((p->name == "embedding.weight" || p->name == "output_layer.weight") && p->data.dim() == 2 &&
        p->partition_dim == 0)
      gs = {cfg.vocab_size, p->data.size(1)};
    ShardedTensor st = shard_parameter(*p, layout, gs);
    if (m.is_tied_copy(*p)) st.write = false, st.tied_copy = true;  // the first stage writes the tied embedding
    out.push_back(std::move(st));
  }
  return out;
}

std::vector<ShardedTensor> shard_optimizer_state(const std::vector<optim::NamedTensor>& state,
                                                 const std::vector<ShardedTensor>& params, const std::string& prefix) {
  std::map<std::string, const ShardedTensor*> by_name;
  for (const ShardedTensor& p : params) by_name[p.name] = &p;
  std::vector<ShardedTensor> out;
  for (const optim::NamedTensor& nt : state) {
    const size_t dot = nt.name.rfind('.');
    MC_CHECK(dot != std::string::npos && dot > 0,
             "checkpoint: optimizer state '{}' is not named '<parameter>.<kind>'; name it after its parameter", nt.name);
    const std::string pname = nt.name.substr(0, dot);
    auto it = by_name.find(pname);
    MC_CHECK(it != by_name.end(),
             "checkpoint: optimizer state '{}' belongs to parameter '{}', which is not among the {} described "
             "parameters; describe the model's parameters first (shard_model) and pass them",
             nt.name, pname, params.size());
    const ShardedTensor& p = *it->second;
    MC_CHECK(nt.tensor.shape() == p.local.shape(),
             "checkpoint: optimizer state '{}' has shape {} but its parameter's shard is {}; pass TP-local state "
             "(a ZeRO optimizer's gathered_state())",
             nt.name, shape_text(nt.tensor.shape()), shape_text(p.local.shape()));
    ShardedTensor st = p;
    st.name = prefix + nt.name;
    st.dtype = nt.tensor.dtype();
    st.local = nt.tensor;
    st.convert_dtype = true;
    out.push_back(std::move(st));
  }
  return out;
}

std::vector<std::pair<Shape, Shape>> flat_range_boxes(const Shape& shape, int64_t begin, int64_t end) {
  const int64_t n = int64_t(shape.size());
  int64_t total = 1;
  for (int64_t d : shape) total *= d;
  MC_CHECK(0 <= begin && begin <= end && end <= total, "flat_range_boxes: range [{}, {}) is outside a tensor of {} "
           "elements", begin, end, total);
  std::vector<std::pair<Shape, Shape>> out;
  if (n == 0) {
    if (begin < end) out.push_back({{}, {}});
    return out;
  }
  std::vector<int64_t> stride(size_t(n), 1);
  for (int64_t d = n - 2; d >= 0; --d) stride[size_t(d)] = stride[size_t(d + 1)] * shape[size_t(d + 1)];
  int64_t a = begin;
  while (a < end) {
    // The outermost dimension d whose unit (stride[d]) `a` is aligned to and that still fits before `end`.
    int64_t d = n - 1;
    while (d > 0 && a % stride[size_t(d - 1)] == 0 && a + stride[size_t(d - 1)] <= end) --d;
    const int64_t idx = (a / stride[size_t(d)]) % shape[size_t(d)];
    const int64_t count = std::min(shape[size_t(d)] - idx, (end - a) / stride[size_t(d)]);
    Shape off(static_cast<size_t>(n), 0), sz(static_cast<size_t>(n), 1);
    int64_t rem = a;
    for (int64_t k = 0; k < n; ++k) {
      off[size_t(k)] = rem / stride[size_t(k)];
      rem %= stride[size_t(k)];
    }
    sz[size_t(d)] = count;
    for (int64_t k = d + 1; k < n; ++k) sz[size_t(k)] = shape[size_t(k)];
    out.push_back({std::move(off), std::move(sz)});
    a += count * stride[size_t(d)];
  }
  return out;
}

std::vector<ShardedTensor> shard_zero_state(const optim::DistributedOptimizer& opt,
                                            const std::vector<ShardedTensor>& params, const ShardLayout& layout,
                                            const std::string& prefix) {
  std::map<std::string, const ShardedTensor*> by_name;
  for (const ShardedTensor& p : params) by_name[p.name] = &p;
  const std::vector<layers::Parameter*>& ps = opt.parameters();
  static const char* kinds[3] = {"master", "exp_avg", "exp_avg_sq"};
  // One ShardedTensor per (parameter, kind), in parameter order.
  std::vector<ShardedTensor> out(3 * ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    const layers::Parameter& p = *ps[i];
    auto it = by_name.find(p.name);
    MC_CHECK(it != by_name.end(),
             "shard_zero_state: the optimizer's parameter '{}' is not among the {} described parameters; describe the "
             "model's parameters first (shard_model) and pass them",
             p.name, params.size());
    const ShardedTensor& desc = *it->second;
    MC_CHECK(desc.local.shape() == p.data.shape(), "shard_zero_state: '{}' is described with local shape {} but the "
             "parameter is {}", p.name, shape_text(desc.local.shape()), shape_text(p.data.shape()));
    // Whether this rank's copy is the one to write, ignoring DP (every DP rank owns different elements):
    // TP-partitioned or TP rank 0 (expert-TP for an expert), and not the tied embedding's copy on the last
    // pipeline stage.
    const bool tp_writer = p.partition_dim >= 0 || (p.expert ? layout.expert_tp_rank : layout.tp_rank) == 0;
    const bool tied_copy = desc.tied_copy;
    for (int k = 0; k < 3; ++k) {
      ShardedTensor& st = out[3 * i + size_t(k)];
      st.name = prefix + p.name + "." + kinds[k];
      st.global_shape = desc.global_shape;
      st.dtype = k == 0 ? opt.master_dtype(i) : k == 1 ? opt.config().exp_avg_dtype : opt.config().exp_avg_sq_dtype;
      st.write = tp_writer && !tied_copy;
      st.convert_dtype = true;
    }
  }
  for (const optim::DistributedOptimizer::OwnedRange& r : opt.owned_ranges()) {
    const layers::Parameter& p = *ps[r.param];
    const ShardedTensor& desc = *by_name.at(p.name);
    const Tensor views[3] = {r.master, r.exp_avg, r.exp_avg_sq};
    // The owned flat range as boxes, each contiguous in the flattened parameter; each box meets each piece
    // (a box of the local tensor) in a box, a strided view of the box's state.
    for (const auto& [off, shape] : flat_range_boxes(p.data.shape(), r.param_offset, r.param_offset + r.numel)) {
      int64_t flat = 0, vol = 1, stride = 1;
      for (int64_t d = int64_t(shape.size()) - 1; d >= 0; --d) {
        flat += off[size_t(d)] * stride;
        stride *= p.data.size(d);
        vol *= shape[size_t(d)];
      }
      for (const ShardPiece& pc : desc.pieces) {
        Shape lo(off.size()), len(off.size());
        bool empty = false;
        for (size_t d = 0; d < off.size(); ++d) {
          lo[d] = std::max(off[d], pc.local_offsets[d]);
          len[d] = std::min(off[d] + shape[d], pc.local_offsets[d] + pc.shape[d]) - lo[d];
          empty |= len[d] <= 0;
        }
        if (empty) continue;
        Shape global(off.size());
        for (size_t d = 0; d < off.size(); ++d) global[d] = lo[d] - pc.local_offsets[d] + pc.global_offsets[d];
        for (int k = 0; k < 3; ++k) {
          Tensor v = views[k].narrow(0, flat - r.param_offset, vol).view(shape);
          for (size_t d = 0; d < off.size(); ++d) v = v.narrow(int64_t(d), lo[d] - off[d], len[d]);
          ShardPiece piece;
          piece.local_offsets = Shape(off.size(), 0);
          piece.global_offsets = global;
          piece.shape = len;
          piece.data = v;
          out[3 * r.param + size_t(k)].pieces.push_back(std::move(piece));
        }
      }
    }
  }
  return out;
}

}  // namespace megacore::checkpoint
