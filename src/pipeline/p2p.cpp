#include "megacore/pipeline/p2p.hpp"

#include <chrono>
#include <set>

#include "megacore/core/error.hpp"

namespace megacore::pipeline {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

StageP2P::StageP2P(comm::Communicator& pp, Device device) : pp_(pp) {
  cuda_ = device.is_cuda();
  const int n = pp.size(), me = pp.rank();
  if (!cuda_ || n == 1) return;
  // Every directed neighbour edge a → a ± 1 (mod n), in the same order on every rank: one split each.
  std::set<std::pair<int, int>> edges;
  for (int a = 0; a < n; ++a) {
    edges.insert({a, (a + 1) % n});
    edges.insert({a, (a + n - 1) % n});
  }
  for (const auto& [a, b] : edges) {
    const bool member = me == a || me == b;
    comm::CommOptions o = pp.options();
    o.name = fmt::format("{}_p2p_{}to{}", pp.name(), a, b);
    // key: the sender is rank 0 of the pair communicator.
    std::unique_ptr<comm::Communicator> c = pp.split(member ? 0 : -1, me == a ? 0 : 1, o);
    if (!member) continue;
    Channel& ch = channels_[{a, b}];
    ch.comm = std::move(c);
    ch.peer_in_comm = me == a ? 1 : 0;
    ch.stream = Stream::create(device);
  }
}

StageP2P::Channel& StageP2P::channel(int sender, int receiver) {
  auto it = channels_.find({sender, receiver});
  MC_CHECK(it != channels_.end(), "StageP2P: pipeline ranks {} and {} are not neighbours; the schedule only sends to "
           "the previous or next pipeline rank", sender, receiver);
  return it->second;
}

void StageP2P::send(const Tensor& t, int peer) {
  MC_CHECK(t.defined() && t.is_contiguous(), "StageP2P.send: the tensor to send to pipeline rank {} must be a defined "
           "contiguous tensor; call .contiguous() first", peer);
  queued_.push_back({comm::P2POp::Send, t, peer});
  keep_.push_back(t);
}

void StageP2P::recv(Tensor& buffer, int peer) {
  MC_CHECK(buffer.defined() && buffer.is_contiguous(), "StageP2P.recv: the receive buffer for pipeline rank {} must be "
           "allocated and contiguous", peer);
  queued_.push_back({comm::P2POp::Recv, buffer, peer});
}

void StageP2P::flush() {
  if (queued_.empty()) return;
  std::vector<comm::P2POp> ops;
  ops.swap(queued_);
  const auto t0 = std::chrono::steady_clock::now();
  const int me = pp_.rank();
  if (cuda_) {
    std::vector<std::pair<comm::WorkPtr, Stream>> recvs;
    for (const comm::P2POp& op : ops) {
      const bool send = op.kind == comm::P2POp::Send;
      Channel& ch = send ? channel(me, op.peer) : channel(op.peer, me);
      ch.stream.wait(compute_);  // sent data is ready / the receive buffer is free
      comm::WorkPtr w = ch.comm->batch_send_recv({{op.kind, op.tensor, ch.peer_in_comm}}, ch.stream);
      if (send) sends_.push_back(std::move(w));
      else recvs.emplace_back(std::move(w), ch.stream);
    }
    // The compute stream waits for the received tensors; the host does not (the watchdog enforces the
    // timeout), so it can queue the next micro-batch's work while the transfer is still in flight.
    for (auto& r : recvs) r.first->wait_on(compute_);
  } else {
    std::vector<comm::P2POp> sends, recvs;
    for (auto& op : ops) (op.kind == comm::P2POp::Send ? sends : recvs).push_back(op);
    if (!sends.empty()) sends_.push_back(pp_.batch_send_recv(sends, compute_));  // isend: waited in finish()
    if (!recvs.empty()) pp_.batch_send_recv(recvs, compute_)->wait_on(compute_);
  }
  wait_s_ += seconds_since(t0);
}

void StageP2P::finish() {
  flush();
  const auto t0 = std::chrono::steady_clock::now();
  // Stream-ordered on CUDA (the compute stream waits for the send channels below; the watchdog enforces the
  // timeout); MPI's isends finish here.
  for (auto& w : sends_) w->wait_on(compute_);
  sends_.clear();
  if (cuda_)
    for (auto& [edge, ch] : channels_) compute_.wait(ch.stream);  // sent buffers may be reused after this
  keep_.clear();
  wait_s_ += seconds_since(t0);
}

}  // namespace megacore::pipeline
