// Shared pieces of the single-rank MoE layer tests.
#pragma once

#include "layers_test_util.hpp"
#include "megacore/layers/moe.hpp"

namespace layers_test {

/// Every MoE group (TP, EP, expert-TP, TP×EP) of one rank alone.
struct SoloMoEGroups {
  NoCommCommunicator c{0, 1};
  megacore::layers::MoEGroups groups() { return {&c, &c, &c, &c}; }
};

}  // namespace layers_test
