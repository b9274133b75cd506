// Point-to-point transfers between pipeline stages (activations forward, their gradients backward).
//
// StageP2P collects the consecutive send/receive ops of a rank's schedule (see schedule.hpp) and posts
// them when the next compute op needs them, with the semantics rank_schedule()'s deadlock-freedom proof
// assumes: a send never blocks (isend), a receive blocks until its message arrived, and messages between
// two ranks match in posting order.
//
//   host tensors (MPI)   sends are posted non-blocking on the pipeline communicator and only waited for
//                        at the end of the step; the receives of a run are posted together and waited for.
//   CUDA tensors (NCCL)  an NCCL send occupies its stream until the peer's receive runs, and one
//                        communicator's operations execute in issue order, so a send in front of a
//                        receive would block it (posting a run of sends and receives as one group
//                        deadlocked interleaved 1F1B with PP = 4 on 4 GPUs). So each DIRECTED pair of
//                        neighbouring ranks (p → p ± 1 mod PP) gets its own two-rank communicator and CUDA
//                        stream, used only for p's sends to that peer: sends queue in FIFO order behind
//                        each other and nothing else, exactly isend semantics. The comm streams wait for
//                        the compute stream before each op (the data is ready, the buffer is free) and the
//                        compute stream waits for a receive's stream after it.
//
// Building the directed communicators is collective over the pipeline group (StageP2P's constructor on a
// CUDA device). Every wait goes through a communicator timeout, so a dead or failed peer stage becomes
// a CommError on this rank instead of a hang. Receive buffers are allocated by the caller with the
// shape agreed before the step (the engine derives it from the micro-batch size).
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::pipeline {

class StageP2P {
 public:
  /// `pp` must outlive this object. On a CUDA `device` this is collective over `pp` (it splits the
  /// directed neighbour communicators); on the CPU it communicates nothing.
  StageP2P(comm::Communicator& pp, Device device);

  /// Starts a step on the stream the model runs on, dropping what a failed earlier step left queued.
  void begin_step(const Stream& compute) {
    compute_ = compute;
    queued_.clear();
    sends_.clear();
    keep_.clear();
  }
  /// Queues a send of `t` (contiguous) to pipeline rank `peer`.
  void send(const Tensor& t, int peer);
  /// Queues a receive into `buffer` (contiguous, already allocated) from `peer`.
  void recv(Tensor& buffer, int peer);
  /// Posts the queued ops; returns when the received tensors may be used on the compute stream.
  void flush();
  /// Waits for every send posted so far (end of step). Throws CommError on timeout or failure.
  void finish();
  /// Host seconds spent blocked in flush()/finish() (waiting for peers) since construction.
  double wait_seconds() const { return wait_s_; }

 private:
  struct Channel {  // CUDA: one direction between this rank and a neighbour
    std::unique_ptr<comm::Communicator> comm;
    int peer_in_comm = 0;
    Stream stream;
  };
  Channel& channel(int sender, int receiver);

  comm::Communicator& pp_;
  Stream compute_;
  bool cuda_ = false;
  std::map<std::pair<int, int>, Channel> channels_;  // (sender, receiver) in pp ranks
  std::vector<comm::P2POp> queued_;
  std::vector<comm::WorkPtr> sends_;
  std::vector<Tensor> keep_;  // sent tensors, alive until finish()
  double wait_s_ = 0;
};

}  // namespace megacore::pipeline
