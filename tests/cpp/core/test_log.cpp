#include <cstdio>
#include <string>

#include "megacore/core/log.hpp"
#include "test_helpers.hpp"

using namespace megacore;

TEST_CASE("log levels parse by name, any case") {
  CHECK(parse_log_level("debug") == LogLevel::Debug);
  CHECK(parse_log_level("INFO") == LogLevel::Info);
  CHECK(parse_log_level("Warning") == LogLevel::Warning);
  CHECK(parse_log_level("warn") == LogLevel::Warning);
  CHECK(parse_log_level("error") == LogLevel::Error);
  CHECK(parse_log_level("off") == LogLevel::Off);
  CHECK_FALSE(parse_log_level("verbose").has_value());
  CHECK_FALSE(parse_log_level("").has_value());
}

TEST_CASE("the level filters lines and log_once prints a key once per process") {
  const LogLevel before = log_level();
  set_log_level(LogLevel::Info);
  CHECK(log_enabled(LogLevel::Info));
  CHECK(log_enabled(LogLevel::Error));
  CHECK_FALSE(log_enabled(LogLevel::Debug));
  CHECK_FALSE(log_enabled(LogLevel::Off));
  // Below the level: not printed, and the key is used up (a shape-keyed line stays quiet for good).
  CHECK_FALSE(log_once(LogLevel::Debug, "test_log quiet", "test", "not shown"));
  set_log_level(LogLevel::Debug);
  CHECK_FALSE(log_once(LogLevel::Debug, "test_log quiet", "test", "still not shown"));
  CHECK(log_once(LogLevel::Debug, "test_log once", "test", "shown once (debug)"));
  for (int i = 0; i < 5; ++i) CHECK_FALSE(log_once(LogLevel::Debug, "test_log once", "test", "again"));
  set_log_level(LogLevel::Off);
  CHECK_FALSE(log_enabled(LogLevel::Error));
  CHECK_FALSE(log_once(LogLevel::Error, "test_log off", "test", "off"));
  set_log_level(before);
}
