// VocabParallelEmbedding and VocabParallelCrossEntropy under mpirun: for every TP in {1, 2, 4} that
// divides the world (split with a ProcessGrid), with and without sequence parallelism, each rank's
// results equal the single-rank computation done locally with the ops on the full tensors.
//
// Tolerances: the embedding is data movement plus a sum of one non-zero row and TP−1 zero rows
// (exact in f32), and its gradient sums the same rows in the same token order (exact). The
// cross-entropy differs from ops::cross_entropy_fused only in how the f32 statistics are combined
// across shards: relative error 1e-5 for losses and gradients.
#include "layers_test_util.hpp"
#include "megacore/parallel/process_grid.hpp"

using namespace megacore;
using namespace megacore::parallel;
using namespace layers_test;
namespace ly = megacore::layers;

namespace {

constexpr int64_t kVocab = 200;

// Ids that hit the first and last real row of every 64-row shard, repeats, and a spread of others.
Tensor test_ids(int64_t s, int64_t b) {
  std::vector<int64_t> v{0, 63, 64, 127, 128, 191, 192, 199, 5, 5, 199, 0};
  while (int64_t(v.size()) < s * b) v.push_back((int64_t(v.size()) * 37 + 11) % kVocab);
  v.resize(size_t(s * b));
  return Tensor::from_vector<int64_t>(v, {s, b});
}

void run_embedding(comm::Communicator& tp, bool sp, int64_t padded) {
  const int tpn = tp.size(), r = tp.rank();
  INFO("TP " << tpn << " SP " << sp << " padded_vocab_size " << padded);
  const int64_t s = 8, b = 2, h = 6;
  ly::VocabParallelEmbedding emb(tp, kVocab, h,
                                 {.padded_vocab_size = padded, .sequence_parallel = sp, .init_std = 0.5, .seed = 11,
                                  .init_offset = 7});
  const int64_t pv = emb.padded_vocab_size();
  REQUIRE(pv % (tpn * (padded > 0 ? 1 : 128)) == 0);
  const Tensor E = ly::init_full_weight(kVocab, h, 0.5, 11, 7);
  // The gathered table is the TP-invariant full table followed by zero padding rows.
  Tensor table = all_gather_along(tp, emb.weight().data, 0);
  require_equal(table.narrow(0, 0, kVocab).contiguous(), E, "gathered table");
  require_equal(table.narrow(0, kVocab, pv - kVocab).contiguous(), Tensor::zeros({pv - kVocab, h}), "padding rows");

  const Tensor ids = test_ids(s, b), G = randn({s, b, h}, 40);
  Tensor Y = Tensor::empty({s, b, h}), dE = Tensor::zeros({kVocab, h});
  ops::embedding_forward(E, ids, Y);
  ops::embedding_backward(G, ids, dE);
  ly::ForwardContext ctx;
  for (int micro = 0; micro < 2; ++micro) {
    Tensor y = emb.forward(ctx, ids);
    require_equal(y, sp ? chunk(Y, 0, tpn, r) : Y, "embedding output");
    emb.backward(ctx, sp ? chunk(G, 0, tpn, r) : G);
  }
  Tensor grad = all_gather_along(tp, emb.weight().main_grad, 0);
  require_close(grad.narrow(0, 0, kVocab).contiguous(), scaled(dE, 2), 1e-6, "gathered weight gradient");
  require_equal(grad.narrow(0, kVocab, pv - kVocab).contiguous(), Tensor::zeros({pv - kVocab, h}),
                "padding rows get no gradient");
  if (sp && tpn > 1)
    REQUIRE_THROWS_WITH(emb.forward(ctx, test_ids(tpn + 1, 1)), Catch::Contains("multiple of TP"));
}

struct CeCase {
  float label_smoothing;
  bool ignore;  // some labels are ignore_index
  bool mask;    // a loss mask with zeros
};

void run_cross_entropy(comm::Communicator& tp, int64_t padded, const CeCase& c) {
  const int tpn = tp.size(), r = tp.rank();
  INFO("TP " << tpn << " padded " << padded << " eps " << c.label_smoothing << " ignore " << c.ignore << " mask "
             << c.mask);
  const int64_t s = 6, b = 2, n = s * b;
  const Tensor full = scaled(randn({s, b, padded}, 50), 3.0);
  // Large values in the padding columns would dominate the softmax if they were not masked out.
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = kVocab; j < padded; ++j) full.data<float>()[i * padded + j] = 40.f;
  std::vector<int64_t> lab;
  for (int64_t i = 0; i < n; ++i) lab.push_back(test_ids(s, b).data<int64_t>()[i]);
  if (c.ignore) lab[3] = lab[8] = -100;
  const Tensor labels = Tensor::from_vector<int64_t>(lab, {s, b});
  Tensor mask;
  if (c.mask) {
    std::vector<float> m(size_t(n), 1.f);
    m[1] = 0.f;
    m[5] = 0.5f;
    mask = Tensor::from_vector<float>(m, {s, b});
  }
  // Reference: the fused op on the unpadded logits [n, vocab].
  const Tensor z = full.view({n, padded}).narrow(1, 0, kVocab).contiguous();
  Tensor loss = Tensor::empty({n}), lse = Tensor::empty({n}), dz = Tensor::empty({n, kVocab});
  const float scale = 1.f / float(n);
  ops::cross_entropy_fused(z, labels.view({n}), loss, lse, dz, scale, c.mask ? mask.view({n}) : Tensor(),
                           {.label_smoothing = c.label_smoothing});
  Tensor dz_padded = Tensor::zeros({n, padded});
  dz_padded.narrow(1, 0, kVocab).copy_(dz);

  ly::VocabParallelCrossEntropy ce(tp, kVocab, {.label_smoothing = c.label_smoothing});
  ly::ForwardContext ctx;
  const Tensor mine = chunk(full, -1, tpn, r);
  for (bool tensor_dloss : {false, true}) {
    Tensor l = ce.forward(ctx, mine, labels, mask);
    REQUIRE(l.shape() == Shape{s, b});
    require_close(l.view({n}), loss, 1e-5, "per-token loss");
    require_close(ce.lse(), lse, 1e-5, "lse");
    Tensor d = tensor_dloss ? ce.backward(ctx, Tensor::full({s, b}, scale)) : ce.backward(ctx, scale);
    REQUIRE(d.shape() == mine.shape());
    require_close(all_gather_along(tp, d, -1).view({n, padded}), dz_padded, 1e-5, "gathered logits gradient");
  }
}

}  // namespace

TEST_CASE("VocabParallelEmbedding equals the full-table lookup, with and without SP", "[layers][mpi]") {
  auto world = world_comm();
  for (int tpn : tp_sizes_for(world->size())) {
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    for (bool sp : {false, true}) {
      if (sp && tpn == 1) continue;  // SP requires TP > 1
      run_embedding(grid.tp(), sp, 0);    // derived padding (TP 4: 512 rows, two shards all padding)
      run_embedding(grid.tp(), sp, 256);  // every shard holds real rows
    }
  }
}

TEST_CASE("vocab-parallel cross-entropy equals ops::cross_entropy_fused on the full logits", "[layers][mpi]") {
  auto world = world_comm();
  for (int tpn : tp_sizes_for(world->size())) {
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    for (int64_t padded : {ly::pad_vocab_size(kVocab, 128, tpn), int64_t(256)})
      for (CeCase c : {CeCase{0.f, false, false}, CeCase{0.1f, false, false}, CeCase{0.f, true, true},
                       CeCase{0.2f, true, true}})
        run_cross_entropy(grid.tp(), padded, c);
  }
}
