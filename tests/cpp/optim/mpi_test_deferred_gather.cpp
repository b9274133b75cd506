// ZeRO-1's deferred gathers (DistributedOptimizer::set_deferred_gather) under mpirun: step() leaves the separate
// buckets ungathered (only each rank's own range is updated), take_deferred_gather() hands them over, and
// finish_param_gather() gathers what is left in the params' dtype, after which every parameter equals a plain
// ZeRO-1 run's bit for bit.
#include <cmath>

#include <fmt/format.h>

#include "layers/layers_test_util.hpp"
#include "megacore/optim/distributed_optimizer.hpp"

using namespace megacore;
using namespace layers_test;
namespace ly = megacore::layers;
namespace op = megacore::optim;

namespace {

struct Net {
  std::vector<std::unique_ptr<ly::Parameter>> owned;
  std::vector<ly::Parameter*> list;
  std::vector<const ly::Parameter*> separate;
};

// norm, weight, norm, weight, ... in bf16, the weights separate; the same values on every rank.
Net make_net() {
  Net n;
  for (int l = 0; l < 3; ++l)
    for (int k = 0; k < 2; ++k) {
      auto p = std::make_unique<ly::Parameter>();
      p->name = fmt::format("layers.{}.{}", l, k ? "fc.weight" : "norm.weight");
      const Shape shape = k ? Shape{24, 16 + 8 * l} : Shape{16 + 8 * l};
      p->data = randn(shape, uint64_t(100 + 10 * l + k)).to(DType::BF16);
      p->main_grad = Tensor::zeros(shape);
      if (k) n.separate.push_back(p.get());
      n.list.push_back(p.get());
      n.owned.push_back(std::move(p));
    }
  return n;
}

}  // namespace

TEST_CASE("ZeRO-1 deferred gathers leave the separate buckets to the caller", "[optim][ddp][mpi]") {
  auto world = world_comm();
  const int dp = world->size();
  Net plain = make_net(), deferred = make_net();
  op::DDPConfig dc;
  dc.use_distributed_optimizer = true;
  dc.bucket_size = 300;  // several buckets of each kind; shard boundaries cut parameters
  dc.param_align = 4;
  op::DistributedDataParallel ddp_plain(plain.list, *world, dc);
  dc.separate_params = deferred.separate;
  op::DistributedDataParallel ddp_def(deferred.list, *world, dc);
  op::DistributedOptimizer zero_plain(ddp_plain), zero_def(ddp_def);
  zero_def.set_deferred_gather(true);
  int separate_buckets = 0;
  for (const op::Bucket& b : ddp_def.buffer().buckets()) separate_buckets += b.separate ? 1 : 0;
  REQUIRE(separate_buckets >= 2);

  for (int step = 0; step < 3; ++step) {
    // Different gradients per rank, the same in both runs; multiples of 1/8, so the DP sum is exact in any
    // order (the two layouts give each element another owner, and so another reduction order).
    for (Net* n : {&plain, &deferred})
      for (size_t i = 0; i < n->list.size(); ++i) {
        std::vector<float> g;
        for (double v : randn(n->list[i]->data.shape(), uint64_t(1000 * step + 10 * i + world->rank())).to_double_vector())
          g.push_back(float(std::round(v * 8) / 8));
        n->list[i]->main_grad.copy_(Tensor::from_vector<float>(g, n->list[i]->data.shape()));
      }
    ddp_plain.finish_grad_sync();
    ddp_def.finish_grad_sync();
    std::vector<std::vector<double>> before;
    for (ly::Parameter* p : deferred.list) before.push_back(p->data.to_double_vector());
    zero_plain.step(1e-2f);
    zero_def.step(1e-2f);
    if (dp == 1) {
      REQUIRE_FALSE(zero_def.deferred_gather_pending());  // nothing to gather at DP 1
    } else {
      REQUIRE(zero_def.deferred_gather_pending());
      // Only this rank's range of a separate parameter changed; the other parameters are gathered.
      const op::ParamAndGradBuffer& buf = ddp_def.buffer();
      for (size_t i = 0; i < deferred.list.size(); ++i) {
        const op::ParamLocation& l = buf.location(i);
        const op::Bucket& b = buf.buckets()[size_t(l.bucket)];
        const int64_t rs = b.offset + ddp_def.shard_begin(b.index), re = rs + ddp_def.shard_size(b.index);
        const std::vector<double> got = deferred.list[i]->data.to_double_vector(),
                                  want = plain.list[i]->data.to_double_vector();
        for (int64_t e = 0; e < l.numel; ++e) {
          const bool own = l.offset + e >= rs && l.offset + e < re;
          INFO(deferred.list[i]->name << " element " << e);
          REQUIRE(got[size_t(e)] == (b.separate && !own ? before[i][size_t(e)] : want[size_t(e)]));
        }
      }
      if (step == 1) {
        // The caller takes them: exactly the separate buckets, no longer pending.
        const std::vector<op::DistributedOptimizer::DeferredBucket> taken = zero_def.take_deferred_gather();
        REQUIRE(int(taken.size()) == separate_buckets);
        for (const auto& t : taken) REQUIRE(t.ddp->buffer().buckets()[size_t(t.bucket)].separate);
        REQUIRE_FALSE(zero_def.deferred_gather_pending());
        // ... and gathers them (here in bf16, as the optimizer would).
        for (const auto& t : taken) {
          Tensor full = t.ddp->buffer().bucket_params(t.bucket);
          t.ddp->group().all_gather(full.narrow(0, t.ddp->shard_begin(t.bucket), t.ddp->shard_size(t.bucket)), full)
              ->wait();
        }
      }
    }
    zero_def.finish_param_gather();
    REQUIRE_FALSE(zero_def.deferred_gather_pending());
    for (size_t i = 0; i < plain.list.size(); ++i) {
      INFO(plain.list[i]->name << " step " << step);
      REQUIRE(deferred.list[i]->data.to_double_vector() == plain.list[i]->data.to_double_vector());
    }
    zero_plain.zero_grad();
    zero_def.zero_grad();
  }
  // bf16 masters cannot defer: the owner's range is the master.
  op::AdamWConfig bf;
  bf.main_params_dtype = DType::BF16;
  op::DistributedOptimizer zero_bf(ddp_def, bf);
  REQUIRE_THROWS_WITH(zero_bf.set_deferred_gather(true), Catch::Contains("main_params_dtype = f32"));
}
