// Watchdog: turns a rank that stops making progress into a report and an exit, instead of a silent hang.
//
// The trainer beats it: at each phase change (its construction, the first step, later steps, checkpoint saves;
// idle in between) and at the start and end of every step and each validation batch. A thread checks the time since the last beat against the phase's timeout
// (trainer.startup_timeout_s, first_step_timeout_s, step_timeout_s, save_timeout_s; 0 = that phase is not
// watched). When one expires, the rank
//   1. snapshots the flight record of every communicator of the process (comm/flight_recorder.hpp) and
//      publishes it in the job's folder (MEGACORE_JOB_DIR, made by megacore.launch), where the other ranks,
//      whose watchdogs fire too, publish theirs;
//   2. waits a few seconds for the peers' records and works out, per group, which collective it is waiting in
//      (op, bytes, sequence number) and which ranks had not arrived at it (their last started collective of
//      that group is older), or which peers are waiting for it;
//   3. prints the report to stderr, records its first line as this rank's error for the launcher's summary,
//      aborts its communicators and exits with code 124 (MPI_Abort under mpirun, so the whole job ends).
// Without a job folder the report has this rank's own record only.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "megacore/comm/flight_recorder.hpp"

namespace megacore::train {

/// What the rank is doing, which decides its timeout.
enum class WatchPhase { Startup, FirstStep, Step, Save, Idle };

struct WatchdogOptions {
  double startup_timeout_s = 0;     ///< 0 = phase not watched
  double first_step_timeout_s = 0;
  double step_timeout_s = 0;
  double save_timeout_s = 0;
  int rank = 0;                     ///< world rank
  int world_size = 1;
  /// Folder shared by the job's ranks on this node for the flight records ("" = none: own record only).
  std::string job_dir;
  /// Name of this attempt of the job (restarts reuse the folder), part of the record's file name.
  std::string attempt = "0";
  /// Longest wait for the peers' records before reporting with what has arrived.
  double exchange_s = 5;
  /// Aborts this rank's communicators; runs on the watchdog thread just before the exit.
  std::function<void()> abort;
  /// Replaces the exit (tests); the default ends the job with comm::abort_job(124).
  std::function<void(const std::string& report)> on_timeout;
};

class Watchdog {
 public:
  static constexpr int kExitCode = 124;

  /// Starts watching in phase Startup.
  explicit Watchdog(WatchdogOptions options);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// Enters `phase` at `step` (also a heartbeat).
  void enter(WatchPhase phase, int64_t step);
  /// Progress within the current phase.
  void beat();

  /// The report for this rank given every rank's records (`peers[r]` empty when rank r did not publish);
  /// `what` is the first line's description of the stall. Pure: tested on its own.
  static std::string report(int rank, const std::string& what, const std::vector<comm::FlightSnapshot>& mine,
                            const std::vector<std::vector<comm::FlightSnapshot>>& peers,
                            const std::vector<bool>& published);
  /// A snapshot list as JSON text and back (the records the ranks exchange).
  static std::string to_json(const std::vector<comm::FlightSnapshot>& records);
  static std::vector<comm::FlightSnapshot> from_json(const std::string& text);

 private:
  void run();
  void fire(double idle_s, WatchPhase phase, int64_t step, double timeout_s);

  WatchdogOptions o_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  WatchPhase phase_ = WatchPhase::Startup;
  int64_t step_ = 0;
  std::chrono::steady_clock::time_point last_;
  std::thread thread_;
};

/// The name of a phase's timeout field ("trainer.step_timeout_s", ...).
const char* watch_phase_field(WatchPhase p);

}  // namespace megacore::train
