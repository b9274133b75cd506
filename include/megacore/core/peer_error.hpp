// PeerIOError: the error of a rank that stops because another rank failed (kept out of error.hpp, which every
// file includes, since only the agreements that raise it and the Python bindings need it).
#pragma once

#include <string>

#include "megacore/core/error.hpp"

namespace megacore {

/// This rank stops because another rank failed in a step every rank takes together (a checkpoint's save or load
/// phase, which ends with an agreement): that rank's own error says why, nothing went wrong here. An IOError, like
/// the failure it passes on; failed_rank() is the rank that failed (the lowest, where several did).
class PeerIOError : public IOError {
 public:
  PeerIOError(const std::string& what, int failed_rank) : IOError(what), failed_rank_(failed_rank) {}
  int failed_rank() const { return failed_rank_; }

 private:
  int failed_rank_;
};

}  // namespace megacore
