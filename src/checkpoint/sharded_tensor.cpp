// Sharded tensor descriptions (see sharded_tensor.hpp) and the CRC-32 the checkpoint files carry.
#include "megacore/checkpoint/sharded_tensor.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#include "megacore/core/error.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/optim/optimizer.hpp"
#include "megacore/parallel/process_grid.hpp"

namespace megacore::checkpoint {

namespace {

// Slicing-by-8 tables for the reflected polynomial 0xEDB88320 (zlib's crc32): table[k][b] is the CRC of
// byte b followed by k zero bytes, so eight input bytes fold into the state with eight lookups.
struct CrcTables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  CrcTables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b)
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  }
};

const CrcTables& crc_tables() {
  static const CrcTables tables;
  return tables;
}

std::string shape_text(const Shape& s) { return shape_str(s); }

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  const auto& t = crc_tables().t;
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
    --n;
  }
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;  // little-endian hosts only (static_assert below)
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^ t[3][hi & 0xFF] ^
        t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return ~c;
}
static_assert(std::endian::native == std::endian::little, "the checkpoint CRC and safetensors assume little-endian");

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
  st.pieces.push_back({Shape(t.shape().size(), 0), Shape(t.shape().size(), 0), t.shape()});
  return st;
}

ShardedTensor shard_parameter(const layers::Parameter& p, const ShardLayout& layout, const Shape& global_shape) {
  MC_CHECK(p.data.defined(), "checkpoint: parameter '{}' has no data", p.name);
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
    ShardPiece piece{Shape(size_t(nd), 0), Shape(size_t(nd), 0), ls};
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
    if (m.is_tied_copy(*p)) st.write = false;  // the first stage writes the tied embedding
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
    out.push_back(std::move(st));
  }
  return out;
}

}  // namespace megacore::checkpoint
