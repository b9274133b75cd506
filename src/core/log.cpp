#include "megacore/core/log.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>

namespace megacore {

namespace {

// -1: not decided yet (read MEGACORE_LOG_LEVEL on first use).
std::atomic<int> g_level{-1};

std::mutex& once_mutex() {
  static std::mutex* mu = new std::mutex();  // never destroyed: logging may run during static destruction
  return *mu;
}

std::set<std::string>& once_keys() {
  static std::set<std::string>* keys = new std::set<std::string>();
  return *keys;
}

std::string rank_prefix() {
  for (const char* var : {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK"})
    if (const char* v = std::getenv(var); v && *v) return fmt::format("[rank {}] ", v);
  return "";
}

void emit(std::string_view component, std::string_view message) {
  // One fputs per line so lines of concurrent threads and ranks do not interleave mid-line.
  const std::string line = fmt::format("{}[megacore] {}: {}\n", rank_prefix(), component, message);
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

}  // namespace

std::optional<LogLevel> parse_log_level(std::string_view name) {
  std::string s(name);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (s == "debug") return LogLevel::Debug;
  if (s == "info") return LogLevel::Info;
  if (s == "warning" || s == "warn") return LogLevel::Warning;
  if (s == "error") return LogLevel::Error;
  if (s == "off" || s == "none") return LogLevel::Off;
  return std::nullopt;
}

LogLevel log_level() {
  int v = g_level.load(std::memory_order_relaxed);
  if (v >= 0) return LogLevel(v);
  LogLevel lv = LogLevel::Info;
  const char* env = std::getenv("MEGACORE_LOG_LEVEL");
  bool bad = false;
  if (env && *env) {
    if (auto p = parse_log_level(env)) lv = *p;
    else bad = true;
  }
  int expected = -1;
  if (g_level.compare_exchange_strong(expected, int(lv)) && bad)
    emit("log", fmt::format("MEGACORE_LOG_LEVEL='{}' is not one of debug, info, warning, error, off; using info",
                            env));
  return LogLevel(g_level.load());
}

void set_log_level(LogLevel level) { g_level.store(int(level)); }

bool log_enabled(LogLevel level) { return level != LogLevel::Off && int(level) >= int(log_level()); }

void log_line(LogLevel level, std::string_view component, std::string_view message) {
  if (log_enabled(level)) emit(component, message);
}

bool log_once(LogLevel level, const std::string& key, std::string_view component, std::string_view message) {
  {
    std::lock_guard<std::mutex> lock(once_mutex());
    if (!once_keys().insert(key).second) return false;
  }
  if (!log_enabled(level)) return false;
  emit(component, message);
  return true;
}

}  // namespace megacore
