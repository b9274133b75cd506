#include "megacore/optim/fp8_param_gather.hpp"

#include <unordered_map>

#include "megacore/core/error.hpp"
#include "megacore/ops/fp8.hpp"

namespace megacore::optim {

namespace {
// One parameter of a deferred bucket and the part of it this rank owns.
struct Piece {
  const Fp8Weight* w;
  Tensor codes;  // the parameter's codes in the bucket's gathered buffer
  int64_t own_off = 0, own_len = 0;  // owned elements of the flattened parameter (len 0: none)
  Tensor data;                       // the parameter's bf16 data, flattened
};
}  // namespace

Fp8GatherStats fp8_param_gather(DistributedOptimizer& opt, const std::vector<Fp8Weight>& weights,
                                comm::Communicator& amax_group, const Stream& s) {
  Fp8GatherStats stats;
  const std::vector<DistributedOptimizer::DeferredBucket> deferred = opt.take_deferred_gather();
  if (deferred.empty()) return stats;
  std::unordered_map<const layers::Parameter*, const Fp8Weight*> by_param;
  for (const Fp8Weight& w : weights) {
    MC_CHECK(w.param && w.state, "fp8_param_gather: a weight has no parameter or no FP8 state");
    by_param.emplace(w.param, &w);
  }

  // Every deferred parameter with its owned range and its place in its bucket's codes.
  std::vector<Tensor> codes(deferred.size());
  std::vector<Piece> pieces;
  for (size_t k = 0; k < deferred.size(); ++k) {
    const ParamAndGradBuffer& buf = deferred[k].ddp->buffer();
    const Bucket& b = buf.buckets()[size_t(deferred[k].bucket)];
    codes[k] = Tensor::empty({b.numel}, DType::F8E4M3, buf.device(), s);
    const int64_t rs = b.offset + deferred[k].ddp->shard_begin(b.index), re = rs + deferred[k].ddp->shard_size(b.index);
    // The alignment gaps and padding of this rank's range stay defined (zero codes).
    codes[k].narrow(0, rs - b.offset, re - rs).view_as_dtype(DType::U8).zero_(s);
    for (size_t i : b.params) {
      const layers::Parameter* p = buf.parameters()[i];
      auto it = by_param.find(p);
      MC_CHECK(it != by_param.end(),
               "fp8_param_gather: parameter '{}' sits in a deferred bucket but is not among the FP8 weights given; "
               "build the DDP's separate_params from the same FP8 weights",
               p->name);
      const ParamLocation& l = buf.location(i);
      const int64_t st = std::max(rs, l.offset), en = std::min(re, l.offset + l.numel);
      Piece pc{it->second, codes[k].narrow(0, l.offset - b.offset, l.numel), st < en ? st - l.offset : 0,
               st < en ? en - st : 0, p->data.view({-1})};
      pieces.push_back(pc);
    }
    ++stats.buckets;
    stats.elements += b.numel;
    stats.bytes += codes[k].nbytes();
  }
  stats.weights = int64_t(pieces.size());

  // 1. Scales that need the full weight's amax: the owned pieces' amaxes, max-reduced over the group.
  std::vector<layers::Fp8LinearState*> need;
  for (const Fp8Weight& w : weights)
    if (w.state->weight_amax_needed()) need.push_back(w.state);
  if (!need.empty()) {
    const Device dev = pieces.front().data.device();
    Tensor amax = Tensor::zeros({int64_t(need.size())}, DType::F32, dev, s);
    std::unordered_map<const layers::Fp8LinearState*, int64_t> slot;
    for (size_t j = 0; j < need.size(); ++j) slot.emplace(need[j], int64_t(j));
    for (const Piece& pc : pieces) {
      auto it = slot.find(pc.w->state);
      if (it != slot.end() && pc.own_len > 0)
        ops::fp8_amax(pc.data.narrow(0, pc.own_off, pc.own_len), amax.narrow(0, it->second, 1), s);
    }
    if (amax_group.size() > 1) amax_group.all_reduce(amax, comm::ReduceOp::Max, s)->wait_on(s);
    for (size_t j = 0; j < need.size(); ++j) need[j]->set_weight_amax(amax.narrow(0, int64_t(j), 1), s);
  }

  // 2. This rank's pieces to codes.
  for (const Piece& pc : pieces)
    if (pc.own_len > 0) {
      Tensor q = pc.codes.narrow(0, pc.own_off, pc.own_len);
      pc.w->state->cast_weight_piece(pc.data.narrow(0, pc.own_off, pc.own_len), q, s);
    }

  // 3. One all-gather of codes per bucket.
  for (size_t k = 0; k < deferred.size(); ++k) {
    DistributedDataParallel& ddp = *deferred[k].ddp;
    const int b = deferred[k].bucket;
    Tensor mine = codes[k].narrow(0, ddp.shard_begin(b), ddp.shard_size(b));
    if (codes[k].device().is_cuda()) ddp.comm_stream().wait(s);
    ddp.group().all_gather(mine, codes[k], ddp.comm_stream())->wait_on(s);
  }

  // 4. The codes as each layer's FP8 weight, and the bf16 weights from them.
  for (const Piece& pc : pieces) {
    const layers::Parameter& p = *pc.w->param;
    Tensor q = pc.codes.view(p.data.shape());
    pc.w->state->set_weight_codes(q, s);
    Tensor out = p.data;
    ops::fp8_dequant(q, pc.w->state->scale_inv(layers::Fp8LinearState::kWeight), out, s);
  }
  return stats;
}

}  // namespace megacore::optim
