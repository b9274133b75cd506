// Single-process checks of VocabParallelEmbedding and VocabParallelCrossEntropy: bad sizes and
// arguments are refused with a ValueError naming the fix (before any collective: the communicator
// here throws on every collective), and the embedding's TP-invariant initialisation and padding.
#include "layers_test_util.hpp"

using namespace megacore;
using namespace layers_test;
namespace ly = megacore::layers;

TEST_CASE("VocabParallelEmbedding pads the vocabulary and refuses bad sizes with the fix", "[layers]") {
  NoCommCommunicator tp4(1, 4);
  REQUIRE(ly::pad_vocab_size(200, 128, 4) == 512);
  REQUIRE(ly::pad_vocab_size(256, 128, 2) == 256);
  REQUIRE(ly::pad_vocab_size(257, 128, 1) == 384);
  REQUIRE_THROWS_AS(ly::VocabParallelEmbedding(tp4, 0, 8), ValueError);
  REQUIRE_THROWS_WITH(ly::VocabParallelEmbedding(tp4, 0, 8), Catch::Contains("must be positive"));
  REQUIRE_THROWS_WITH(ly::VocabParallelEmbedding(tp4, 200, 8, {.padded_vocab_size = 100}),
                      Catch::Contains("smaller than vocab_size 200; pass 0 to derive it"));
  REQUIRE_THROWS_WITH(ly::VocabParallelEmbedding(tp4, 200, 8, {.padded_vocab_size = 202}),
                      Catch::Contains("not divisible by the TP size 4; pass a multiple of 4"));
  REQUIRE_THROWS_WITH(ly::VocabParallelEmbedding(tp4, 200, 8, {.make_vocab_size_divisible_by = 0}),
                      Catch::Contains("use a positive value"));
  REQUIRE_THROWS_WITH(ly::VocabParallelEmbedding(tp4, 200, 8, {.params_dtype = DType::I32}),
                      Catch::Contains("use f32, bf16 or f16"));

  // Rank 1 of 4 over a 512-row table owns rows [128, 256): 72 real rows, the rest zero padding.
  ly::VocabParallelEmbedding emb(tp4, 200, 8, {.init_std = 0.5, .seed = 9, .init_offset = 3});
  REQUIRE(emb.padded_vocab_size() == 512);
  REQUIRE(emb.vocab_start() == 128);
  REQUIRE(emb.vocab_per_rank() == 128);
  REQUIRE(emb.valid_rows() == 72);
  REQUIRE(emb.weight().partition_dim == 0);
  const Tensor full = ly::init_full_weight(200, 8, 0.5, 9, 3);
  require_equal(emb.weight().data.narrow(0, 0, 72).contiguous(), full.narrow(0, 128, 72).contiguous(),
                "real rows are the full table's rows");
  require_equal(emb.weight().data.narrow(0, 72, 56).contiguous(), Tensor::zeros({56, 8}), "padding rows are zero");
  NoCommCommunicator tp4r3(3, 4);
  ly::VocabParallelEmbedding pad_only(tp4r3, 200, 8);
  REQUIRE(pad_only.valid_rows() == 0);

  ly::ForwardContext ctx;
  REQUIRE_THROWS_WITH(emb.forward(ctx, Tensor::zeros({4, 2})), Catch::Contains("token ids must be i32 or i64"));
  REQUIRE_THROWS_WITH(emb.forward(ctx, Tensor::from_vector<int64_t>({1, 200}, {2})),
                      Catch::Contains("token id 200 at flat position 1 is outside the vocabulary [0, 200)"));
  REQUIRE_THROWS_WITH(emb.forward(ctx, Tensor::from_vector<int32_t>({-1}, {1})), Catch::Contains("outside the vocabulary"));
  REQUIRE_THROWS_WITH(emb.backward(ctx, Tensor::zeros({2, 8})), Catch::Contains("call forward with ctx.training = true"));
}

TEST_CASE("VocabParallelCrossEntropy refuses bad arguments with the fix", "[layers]") {
  NoCommCommunicator tp4(0, 4);
  REQUIRE_THROWS_AS(ly::VocabParallelCrossEntropy(tp4, 0), ValueError);
  REQUIRE_THROWS_WITH(ly::VocabParallelCrossEntropy(tp4, 0), Catch::Contains("(unpadded) vocabulary size"));
  REQUIRE_THROWS_WITH(ly::VocabParallelCrossEntropy(tp4, 100, {.label_smoothing = 1.f}),
                      Catch::Contains("use a value in [0, 1)"));
  ly::VocabParallelCrossEntropy ce(tp4, 100);
  ly::ForwardContext ctx;
  const Tensor labels = Tensor::from_vector<int64_t>({1, 2, 3}, {3});
  REQUIRE_THROWS_WITH(ce.forward(ctx, Tensor::zeros({3, 20}), labels),
                      Catch::Contains("80 over TP = 4, fewer than vocab_size 100; pass the vocab-parallel logits"));
  REQUIRE_THROWS_WITH(ce.forward(ctx, Tensor::zeros({4, 32}), labels), Catch::Contains("pass one label per row"));
  REQUIRE_THROWS_WITH(ce.forward(ctx, Tensor::zeros({3, 32}), labels, Tensor::zeros({3}, DType::BF16)),
                      Catch::Contains("loss_mask must be f32 with one entry per token"));
  REQUIRE_THROWS_WITH(ce.backward(ctx, 1.f), Catch::Contains("call forward with ctx.training = true"));
}
