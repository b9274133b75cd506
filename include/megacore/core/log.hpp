// Process-wide log lines on stderr, filtered by level.
//
// The level comes from the environment variable MEGACORE_LOG_LEVEL (debug, info, warning, error, off;
// default info), read once per process; set_log_level overrides it (tests, embedding programs). Each line
// is "[megacore] <component>: <message>", prefixed with "[rank N] " when a launcher set the rank
// (RANK, OMPI_COMM_WORLD_RANK or SLURM_PROCID), so interleaved output of several ranks stays attributable.
// The level is a property of the process, like the environment it comes from; nothing else is global.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace megacore {

enum class LogLevel { Debug = 0, Info = 1, Warning = 2, Error = 3, Off = 4 };

/// Parses "debug", "info", "warning" (or "warn"), "error", "off" (any case); nullopt for anything else.
std::optional<LogLevel> parse_log_level(std::string_view name);
/// The current threshold: set_log_level's value, else MEGACORE_LOG_LEVEL, else Info. An unknown
/// MEGACORE_LOG_LEVEL is reported once (as a warning) and treated as Info.
LogLevel log_level();
/// Overrides MEGACORE_LOG_LEVEL for the rest of the process.
void set_log_level(LogLevel level);
/// True when a line at `level` would be printed.
bool log_enabled(LogLevel level);
/// Prints one line "[rank N] [megacore] component: message" to stderr if `level` is enabled.
void log_line(LogLevel level, std::string_view component, std::string_view message);
/// Like log_line(), but only the first call with a given `key` in this process prints (later ones are
/// dropped even if the level changes in between). Returns true when the line was printed.
bool log_once(LogLevel level, const std::string& key, std::string_view component, std::string_view message);

}  // namespace megacore
