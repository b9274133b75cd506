// LD_PRELOAD helper: on SIGSEGV print a backtrace with the object and offset of each frame.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static void on_segv(int sig, siginfo_t* si, void* ctx) {
  (void)ctx;
  void* frames[64];
  int n = backtrace(frames, 64);
  fprintf(stderr, "SIGNAL %d addr %p\n", sig, si->si_addr);
  for (int i = 0; i < n; ++i) {
    Dl_info info;
    if (dladdr(frames[i], &info) && info.dli_fname)
      fprintf(stderr, "  #%d %p %s+0x%lx (%s)\n", i, frames[i], info.dli_fname,
              (unsigned long)((char*)frames[i] - (char*)info.dli_fbase), info.dli_sname ? info.dli_sname : "?");
    else
      fprintf(stderr, "  #%d %p ?\n", i, frames[i]);
  }
  _exit(139);
}
__attribute__((constructor)) static void install(void) {
  struct sigaction sa = {0};
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &sa, NULL);
}
