// Host-side packing of the multi-tensor kernels' launches (optimizer.cu): tensors are cut into chunks of
// `Chunk` elements, and consecutive chunks go into launches of at most MaxBlocks chunks from at most MaxTensors
// tensors. A launch's table is a struct T with `void* p[NP][MaxTensors]`, `int64_t n[MaxTensors]`, and per block
// `tensor[MaxBlocks]` (the tensor's slot) and `chunk[MaxBlocks]` (the chunk's index within its tensor); a tensor
// whose chunks do not fit one launch continues in slot 0 of the next. Plain C++, so the CPU tests check it at
// small limits (tests/cpp/ops/test_optimizer.cpp).
#pragma once

#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace megacore::ops::cuda {

template <int NP, int MaxTensors, int MaxBlocks, int64_t Chunk, class T, class Launch>
void pack_launches(T& m, const std::vector<std::array<void*, NP>>& ptrs, const std::vector<int64_t>& n,
                   Launch&& launch) {
  int t = 0, b = 0;
  for (size_t i = 0; i < n.size(); ++i) {
    if (n[i] == 0) continue;
    for (int k = 0; k < NP; ++k) m.p[k][t] = ptrs[i][k];
    m.n[t] = n[i];
    const int64_t chunks = (n[i] + Chunk - 1) / Chunk;
    for (int64_t c = 0; c < chunks; ++c) {
      m.tensor[b] = static_cast<std::remove_reference_t<decltype(m.tensor[0])>>(t);
      m.chunk[b] = static_cast<std::remove_reference_t<decltype(m.chunk[0])>>(c);
      ++b;
      const bool last = c == chunks - 1;
      if (b == MaxBlocks || (last && t + 1 == MaxTensors)) {
        launch(static_cast<const T&>(m), b);
        b = 0;
        if (!last) {  // the rest of this tensor continues in slot 0 of the next launch
          for (int k = 0; k < NP; ++k) m.p[k][0] = m.p[k][t];
          m.n[0] = m.n[t];
          t = 0;
        } else {
          t = -1;
        }
      }
    }
    ++t;
  }
  if (b > 0) launch(static_cast<const T&>(m), b);
}

}  // namespace megacore::ops::cuda
