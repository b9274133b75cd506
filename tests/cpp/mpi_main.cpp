// Catch2 entry point of the multi-rank tests (run under mpirun). Every rank runs the same test
// cases in the same order. Rank 0 prints its report; the other ranks write theirs to a temporary
// file that is shown only if that rank failed, so a passing run prints one summary, not N.
// The exit code is non-zero on every rank if any rank failed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
    std::fprintf(stderr, "MPI_Init_thread failed\n");
    return 1;
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  std::vector<char*> args(argv, argv + argc);
  std::string out_path, out_flag = "--out";
  if (rank != 0) {
    // Same pid-derived name on no two ranks: the rank is part of it.
    out_path = "/tmp/megacore_mpi_tests." + std::to_string(::getpid()) + ".rank" + std::to_string(rank) + ".txt";
    args.push_back(out_flag.data());
    args.push_back(out_path.data());
  }
  if (rank == 0) std::printf("megacore MPI tests on %d ranks\n", size);

  int failed = 0;
  {
    Catch::Session session;
    int rc = session.applyCommandLine(int(args.size()), args.data());
    failed = rc != 0 ? 1 : session.run();
  }
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  // One rank at a time, so failure reports do not interleave.
  for (int r = 1; r < size; ++r) {
    if (rank == r && !out_path.empty()) {
      if (failed) {
        std::ifstream in(out_path);
        std::string line;
        std::cerr << "==== rank " << r << " failed; its report: ====\n";
        while (std::getline(in, line)) std::cerr << "[rank " << r << "] " << line << "\n";
        std::cerr.flush();
      }
      std::remove(out_path.c_str());
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  if (rank == 0 && any && !failed) std::fprintf(stderr, "some other rank failed (see its report above)\n");
  MPI_Finalize();
  return any ? 1 : 0;
}
