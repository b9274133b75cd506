#include "megacore/train/stop_signal.hpp"

#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace megacore::train {
namespace {

// Only lock-free atomics are touched in the handler (async-signal-safe).
std::atomic<int> g_stop{0};
std::atomic<int> g_interrupts{0};
std::atomic<bool> g_installed{false};
struct sigaction g_old_term, g_old_usr1, g_old_int;

void on_signal(int sig) {
  if (sig == SIGINT && g_interrupts.fetch_add(1) >= 1) {
    static const char msg[] = "megacore: second interrupt; exiting now\n";
    (void)!::write(2, msg, sizeof(msg) - 1);
    ::_exit(130);
  }
  int none = 0;
  g_stop.compare_exchange_strong(none, sig);
}

}  // namespace

void install_stop_signal_handlers() {
  if (g_installed.exchange(true)) return;
  struct sigaction sa = {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a blocking call interrupted by the signal carries on; the flag is read per step
  sigaction(SIGTERM, &sa, &g_old_term);
  sigaction(SIGUSR1, &sa, &g_old_usr1);
  sigaction(SIGINT, &sa, &g_old_int);
}

void uninstall_stop_signal_handlers() {
  if (!g_installed.exchange(false)) return;
  sigaction(SIGTERM, &g_old_term, nullptr);
  sigaction(SIGUSR1, &g_old_usr1, nullptr);
  sigaction(SIGINT, &g_old_int, nullptr);
}

int stop_requested() { return g_stop.load(); }
void request_stop(int sig) {
  int none = 0;
  g_stop.compare_exchange_strong(none, sig);
}
void clear_stop_request() {
  g_stop = 0;
  g_interrupts = 0;
}

}  // namespace megacore::train
