// A temporary directory every rank of a communicator sees (made by rank 0, its path broadcast), removed
// by rank 0 after a barrier when the test is done.
#pragma once

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "test_helpers.hpp"

namespace ckpt_test {

struct SharedTmp {
  megacore::comm::Communicator& world;
  std::string path;
  explicit SharedTmp(megacore::comm::Communicator& w) : world(w) {
    megacore::Tensor buf = megacore::Tensor::zeros({256}, megacore::DType::U8);
    if (w.rank() == 0) {
      char tmpl[] = "/tmp/mc_dckpt_XXXXXX";
      const char* p = ::mkdtemp(tmpl);
      REQUIRE(p != nullptr);
      std::memcpy(buf.data_ptr(), p, std::strlen(p));
    }
    w.broadcast(buf, 0)->wait();
    path = std::string(static_cast<const char*>(buf.data_ptr()));
  }
  ~SharedTmp() {
    world.barrier();
    std::error_code ec;
    if (world.rank() == 0) std::filesystem::remove_all(path, ec);
  }
};

}  // namespace ckpt_test
