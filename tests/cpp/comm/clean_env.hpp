// CleanEnv: clears every environment variable the bootstrap and its rendezvous store read (launcher, MPI,
// Slurm and megacore's own) for the scope of a test, and restores them after.
#pragma once

#include <cstdlib>
#include <map>
#include <string>

namespace mctest {

class CleanEnv {
 public:
  CleanEnv() {
    for (const char* k : kVars) {
      if (const char* v = std::getenv(k)) saved_[k] = v;
      ::unsetenv(k);
    }
  }
  ~CleanEnv() {
    for (const char* k : kVars) {
      auto it = saved_.find(k);
      if (it == saved_.end()) ::unsetenv(k);
      else ::setenv(k, it->second.c_str(), 1);
    }
  }
  void set(const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); }

 private:
  static constexpr const char* kVars[] = {
      "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PET_NPROC_PER_NODE",
      "PET_NNODES", "PET_NODE_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "OMPI_COMM_WORLD_RANK",
      "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID",
      "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_ID",
      "SLURM_STEPID", "MEGACORE_STORE_PORT", "MEGACORE_STORE_BIND", "MEGACORE_STORE_TOKEN", "PMI_SIZE", "PMIX_RANK"};
  std::map<std::string, std::string> saved_;
};

}  // namespace mctest
