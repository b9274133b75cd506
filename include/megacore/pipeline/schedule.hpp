// Pipeline schedules as data: the exact sequence of compute and point-to-point operations each
// pipeline rank performs in one training step, before anything runs.
//
// Writing a schedule down as a list (instead of interleaving it with the execution code) lets it be
// checked exhaustively on CPU — every micro-batch forward and backward once, sends matched by receives
// in order across ranks, no deadlock — and lets the executor stay a dumb loop over the list.
//
// Virtual stages are numbered in model order s = chunk · PP + pp_rank (see layout.hpp). A forward of
// (micro-batch, chunk) on stage s receives its activation from stage s − 1 and sends its output to
// stage s + 1; a backward receives the output gradient from s + 1 and sends the input gradient to s − 1.
// With interleaving the wrap from rank PP − 1 (chunk c) to rank 0 (chunk c + 1) is one such hop.
// Sends are meant to be posted non-blocking (isend); a receive blocks until its message arrives.
//
// Schedules (m micro-batches, PP ranks, VP chunks per rank):
//   NoPipelining     PP = 1: F(i), B(i) for each micro-batch — gradient accumulation.
//   OneFOneB         warm-up of min(PP − rank − 1, m) forwards, then one forward + one backward per
//                    step, then the remaining backwards; at most PP − rank micro-batches in flight.
//   Interleaved1F1B  VP chunks per rank; forwards walk "virtual micro-batches" k = 0 .. m·VP − 1, where
//                    micro-batches go through the chunks in groups of PP: chunk(k) = (k mod PP·VP) / PP,
//                    micro-batch(k) = (k / (PP·VP))·PP + k mod PP; backwards walk the chunks in reverse.
//                    Warm-up min((PP − rank − 1)·2 + (VP − 1)·PP, m·VP) forwards (all of them when
//                    m = PP). Needs PP >= 2 and m a multiple of PP.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace megacore::pipeline {

enum class ScheduleKind { NoPipelining, OneFOneB, Interleaved1F1B };
std::string_view schedule_kind_name(ScheduleKind k);

enum class OpKind { Forward, Backward, SendForward, RecvForward, SendBackward, RecvBackward };
std::string_view op_kind_name(OpKind k);

/// One step of a rank's schedule. chunk is the local model chunk (0 .. VP − 1) the op belongs to:
/// for a send, the chunk that produced the tensor; for a receive, the chunk that will consume it.
struct Op {
  OpKind kind = OpKind::Forward;
  int64_t microbatch = 0;
  int chunk = 0;
  int peer = -1;  ///< pipeline rank sent to / received from; -1 for compute ops

  bool is_compute() const { return kind == OpKind::Forward || kind == OpKind::Backward; }
  friend bool operator==(const Op&, const Op&) = default;
};
/// "F(mb 3, chunk 1)", "SendForward(mb 3, chunk 1 -> rank 2)" — for logs and test failures.
std::string to_string(const Op& op);

struct ScheduleConfig {
  ScheduleKind kind = ScheduleKind::OneFOneB;
  int pipeline_parallel = 1;
  int virtual_stages = 1;
  int64_t num_microbatches = 1;
};

/// The natural schedule for the sizes: NoPipelining for PP = 1, OneFOneB for VP = 1, else Interleaved1F1B.
ScheduleConfig make_schedule_config(int pipeline_parallel, int virtual_stages, int64_t num_microbatches);

/// Throws ConfigError naming the fix when the schedule cannot run with these sizes.
void validate(const ScheduleConfig& cfg);

/// global_batch / (micro_batch × data_parallel); ConfigError unless every size is positive and the
/// division is exact (a remainder would silently drop samples or change the effective batch).
int64_t num_microbatches(int64_t global_batch, int64_t micro_batch, int64_t data_parallel);

/// Forward ops a rank runs before its first backward (virtual micro-batches when interleaved).
/// Validates the config; ValueError when pp_rank is out of range.
int64_t num_warmup_forwards(const ScheduleConfig& cfg, int pp_rank);

/// The full op sequence of pp_rank for one step. Validates the config.
std::vector<Op> rank_schedule(const ScheduleConfig& cfg, int pp_rank);

/// The ideal idle fraction of each rank with equal-cost stages and free communication:
/// 0 without pipelining, (PP − 1)/(m + PP − 1) for 1F1B, (PP − 1)/(VP·m + PP − 1) interleaved.
double theoretical_bubble_fraction(const ScheduleConfig& cfg);

}  // namespace megacore::pipeline
