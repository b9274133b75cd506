// What the model-level benchmarks (model, training, pipeline) share: the Llama-1.1B shape they measure and
// an NCCL communicator over the MPI world (the unique id made on rank 0 and broadcast through MPI).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "megacore/comm/communicator.hpp"
#include "megacore/comm/nccl_communicator.hpp"
#include "megacore/model/transformer_config.hpp"

namespace bench {

/// Llama-3.2-1B's layers with a 32000-token untied vocabulary, no RoPE scaling, 4096 positions, bf16:
/// the ~1.1B-parameter model of ../shared/NOTES.md that the peers are measured on too.
inline megacore::model::TransformerConfig llama_1b() {
  megacore::model::TransformerConfig c = megacore::model::presets::llama32_1b();
  c.vocab_size = 32000;
  c.tie_word_embeddings = false;
  c.rope_scaling = {};
  c.max_position_embeddings = 4096;
  c.params_dtype = megacore::DType::BF16;
  return c;
}

/// An NCCL communicator over all ranks of `mpi` on `dev` (collective over `mpi`); max_ctas > 0 caps
/// NCCL's CTAs (CommOptions::nccl_max_ctas).
inline std::unique_ptr<megacore::comm::Communicator> nccl_over(megacore::comm::Communicator& mpi,
                                                               megacore::Device dev, const std::string& name,
                                                               std::chrono::seconds timeout, int max_ctas = 0) {
  megacore::comm::CommOptions o;
  o.name = name;
  o.timeout = timeout;
  o.nccl_max_ctas = max_ctas;
  return megacore::comm::make_nccl_communicator_over(mpi, dev, o);
}

}  // namespace bench
