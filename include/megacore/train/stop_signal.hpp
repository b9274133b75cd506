// Preemption: a request to stop after the current step, set by a signal and agreed by every rank.
//
// A scheduler that wants the job gone (Slurm's --signal=TERM@120, a Kubernetes eviction, the launcher
// forwarding a Ctrl-C) signals the ranks; the handlers below only raise a flag. Trainer::fit all-reduces
// the flag after every step (one tiny collective), so every rank stops after the same step, saves a
// checkpoint and returns: a rank stopping on its own would leave the others waiting in the next step.
// The flag is process-wide by nature (a signal has no other place to go): it is the one piece of global
// state of the training loop, and nothing but these functions touches it.
#pragma once

namespace megacore::train {

/// Installs the handlers: SIGTERM and SIGUSR1 request a stop; SIGINT requests one the first time and ends
/// the process at once (exit code 130) the second time. Idempotent.
void install_stop_signal_handlers();
/// Restores the handlers that were installed before install_stop_signal_handlers().
void uninstall_stop_signal_handlers();
/// The signal that asked for a stop (0 when none did).
int stop_requested();
/// Asks for a stop as a signal would (tests, embedding code); `sig` is what stop_requested() reports.
void request_stop(int sig);
/// Forgets a request (a new run in the same process).
void clear_stop_request();

}  // namespace megacore::train
