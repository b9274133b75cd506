#include "megacore/parallel/context_parallel.hpp"

#include "megacore/core/error.hpp"

namespace megacore::parallel {

int64_t cp_global_position(int64_t local, int64_t local_len, int rank, int size) {
  if (size <= 1) return local;
  MC_CHECK(local_len % 2 == 0 && local >= 0 && local < local_len && rank >= 0 && rank < size,
           "cp_global_position: token {} of a local sequence of {} on CP rank {} of {}; the local sequence holds two "
           "equal chunks (even length) and the index must be inside it",
           local, local_len, rank, size);
  const int64_t c = local_len / 2;
  const int64_t chunk = local < c ? rank : 2 * int64_t(size) - 1 - rank;
  return chunk * c + local % c;
}

Tensor cp_slice_sequence(const Tensor& t, int64_t dim, int rank, int size, const Stream& s) {
  if (size <= 1) return t;
  MC_CHECK(t.defined() && dim >= 0 && dim < t.dim(), "cp_slice_sequence: dimension {} is not in a {}-d tensor", dim,
           t.defined() ? t.dim() : 0);
  const int64_t S = t.size(dim);
  MC_CHECK(S % (2 * int64_t(size)) == 0,
           "cp_slice_sequence: the sequence length {} is not divisible by 2 × CP = {} (context parallelism cuts it "
           "into 2·CP equal chunks); pad or choose a seq_length that is a multiple of {}",
           S, 2 * size, 2 * size);
  const int64_t c = S / (2 * int64_t(size));
  Shape shape = t.shape();
  shape[size_t(dim)] = 2 * c;
  Tensor out = Tensor::empty(shape, t.dtype(), t.device(), s);
  out.narrow(dim, 0, c).copy_(t.narrow(dim, int64_t(rank) * c, c), s);
  out.narrow(dim, c, c).copy_(t.narrow(dim, (2 * int64_t(size) - 1 - rank) * c, c), s);
  return out;
}

Tensor cp_unslice_sequence(const std::vector<Tensor>& parts, int64_t dim, const Stream& s) {
  const int size = int(parts.size());
  MC_CHECK(size >= 1 && parts[0].defined(), "cp_unslice_sequence: pass one part per CP rank");
  if (size == 1) return parts[0];
  const int64_t l = parts[0].size(dim);
  MC_CHECK(l % 2 == 0, "cp_unslice_sequence: local parts of {} tokens; they must hold two equal chunks", l);
  const int64_t c = l / 2;
  Shape shape = parts[0].shape();
  shape[size_t(dim)] = l * size;
  Tensor out = Tensor::empty(shape, parts[0].dtype(), parts[0].device(), s);
  for (int r = 0; r < size; ++r) {
    MC_CHECK(parts[size_t(r)].shape() == parts[0].shape(), "cp_unslice_sequence: part {} has shape {} but part 0 {}",
             r, shape_str(parts[size_t(r)].shape()), shape_str(parts[0].shape()));
    out.narrow(dim, int64_t(r) * c, c).copy_(parts[size_t(r)].narrow(dim, 0, c), s);
    out.narrow(dim, (2 * int64_t(size) - 1 - r) * c, c).copy_(parts[size_t(r)].narrow(dim, c, c), s);
  }
  return out;
}

}  // namespace megacore::parallel
