// The flavour choices of the transformer layers (norm, activation, positions, recompute, RoPE scaling,
// MoE routing and dispatch),
// declared here so the layers can take them without depending on the model. model::TransformerConfig
// uses the same types (model:: names them too).
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <utility>

#include "megacore/core/fields.hpp"

namespace megacore::layers {

enum class NormType { RMSNorm, LayerNorm };
/// SwiGLU: fc1 produces [gate | up] (2·ffn) and fc2 consumes ffn; GELU: fc1 ffn → fc2 (tanh GELU as GPT-2).
enum class ActivationType { SwiGLU, GELU };
enum class PositionEmbeddingType { RoPE, Learned };
/// What a layer recomputes in backward: nothing, core attention only, or the whole layer.
enum class RecomputeGranularity { None, Selective, Full };
enum class RopeScalingType { None, Llama3 };
/// How a MoE router scores the experts of a token: softmax over all experts (Mixtral, Qwen-MoE) or an
/// independent sigmoid per expert (DeepSeek-V3).
enum class MoERouterScore { Softmax, Sigmoid };
/// How a MoE layer moves tokens to the ranks that hold their experts: an all-to-all over the EP group
/// with uneven splits, or an all-gather of every token over EP with a reduce-scatter back.
enum class MoETokenDispatcher { AllToAll, AllGather };

/// Llama-3.1-style frequency scaling of RoPE (Hugging Face rope_type "llama3").
struct RopeScaling {
  RopeScalingType type = RopeScalingType::None;
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

}  // namespace megacore::layers

namespace megacore {
template <>
struct EnumNames<layers::NormType> {
  static constexpr std::array values{std::pair{layers::NormType::RMSNorm, std::string_view{"RMSNorm"}},
                                     std::pair{layers::NormType::LayerNorm, std::string_view{"LayerNorm"}}};
};
template <>
struct EnumNames<layers::ActivationType> {
  static constexpr std::array values{std::pair{layers::ActivationType::SwiGLU, std::string_view{"SwiGLU"}},
                                     std::pair{layers::ActivationType::GELU, std::string_view{"GELU"}}};
};
template <>
struct EnumNames<layers::PositionEmbeddingType> {
  static constexpr std::array values{std::pair{layers::PositionEmbeddingType::RoPE, std::string_view{"RoPE"}},
                                     std::pair{layers::PositionEmbeddingType::Learned, std::string_view{"Learned"}}};
};
template <>
struct EnumNames<layers::RecomputeGranularity> {
  static constexpr std::array values{
      std::pair{layers::RecomputeGranularity::None, std::string_view{"none"}},
      std::pair{layers::RecomputeGranularity::Selective, std::string_view{"selective"}},
      std::pair{layers::RecomputeGranularity::Full, std::string_view{"full"}}};
};
template <>
struct EnumNames<layers::RopeScalingType> {
  static constexpr std::array values{std::pair{layers::RopeScalingType::None, std::string_view{"none"}},
                                     std::pair{layers::RopeScalingType::Llama3, std::string_view{"llama3"}}};
};
template <>
struct EnumNames<layers::MoERouterScore> {
  static constexpr std::array values{std::pair{layers::MoERouterScore::Softmax, std::string_view{"softmax"}},
                                     std::pair{layers::MoERouterScore::Sigmoid, std::string_view{"sigmoid"}}};
};
template <>
struct EnumNames<layers::MoETokenDispatcher> {
  static constexpr std::array values{std::pair{layers::MoETokenDispatcher::AllToAll, std::string_view{"alltoall"}},
                                     std::pair{layers::MoETokenDispatcher::AllGather, std::string_view{"allgather"}}};
};
}  // namespace megacore
