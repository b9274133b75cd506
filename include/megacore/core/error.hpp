// Typed errors and the MC_CHECK family of macros (the caller's mistakes), apart from MC_INTERNAL_ASSERT
// (megacore's own bugs).
//
// Every failure megacore reports is one of the classes below, so callers (and the Python bindings)
// can tell a bad argument from a communication failure from a CUDA fault. Messages say what is wrong
// and, where there is one, how to fix it.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace megacore {

/// Base of every megacore error.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
/// A bad argument: wrong dtype, shape, device, index, or a value out of range.
class ValueError : public Error {
 public:
  using Error::Error;
};
/// A configuration that cannot work as a whole (parallel sizes, model shape); raised before any work.
class ConfigError : public ValueError {
 public:
  using ValueError::ValueError;
};
/// A collective or point-to-point operation failed, timed out, or a peer died.
class CommError : public Error {
 public:
  using Error::Error;
};
/// A CUDA, cuBLAS, cuDNN or driver call failed.
class CudaError : public Error {
 public:
  using Error::Error;
};
/// An allocation failed (host or device), after the caching allocator released what it could.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};
/// A file is missing, truncated, corrupt or of the wrong kind.
class IOError : public Error {
 public:
  using Error::Error;
};
/// A broken invariant inside megacore: a bug in the library, not a problem with the caller's input
/// (MC_INTERNAL_ASSERT). Deliberately not a ValueError, so code that handles bad input does not swallow it.
class InternalError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <class E, class... Args>
[[noreturn]] void throw_error(fmt::format_string<Args...> f, Args&&... args) {
  throw E(fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
[[noreturn]] void throw_internal(const char* file, int line, const char* cond, fmt::format_string<Args...> f,
                                 Args&&... args) {
  throw InternalError(fmt::format("internal error at {}:{}: `{}` does not hold: {}. This is a bug in megacore, not in "
                                  "your input; please report it with this message",
                                  file, line, cond, fmt::format(f, std::forward<Args>(args)...)));
}
}  // namespace detail

/// Throws E with a fmt-formatted message.
template <class E = ValueError, class... Args>
[[noreturn]] void raise(fmt::format_string<Args...> f, Args&&... args) {
  detail::throw_error<E>(f, std::forward<Args>(args)...);
}

}  // namespace megacore

/// MC_CHECK(cond, "fmt {}", args...) throws megacore::ValueError with the message when cond is false.
#define MC_CHECK(cond, ...)                                              \
  do {                                                                   \
    if (!(cond)) ::megacore::detail::throw_error<::megacore::ValueError>(__VA_ARGS__); \
  } while (0)

/// MC_CHECK_AS(ErrorType, cond, "fmt {}", args...) throws the given megacore error type.
#define MC_CHECK_AS(Type, cond, ...)                                                 \
  do {                                                                               \
    if (!(cond)) ::megacore::detail::throw_error<::megacore::Type>(__VA_ARGS__);     \
  } while (0)

/// MC_INTERNAL_ASSERT(cond, "fmt {}", args...): an invariant of megacore's own code (as TORCH_INTERNAL_ASSERT;
/// MC_CHECK is for the caller's mistakes). Throws megacore::InternalError naming file:line and the condition.
#define MC_INTERNAL_ASSERT(cond, ...)                                                             \
  do {                                                                                            \
    if (!(cond)) ::megacore::detail::throw_internal(__FILE__, __LINE__, #cond, __VA_ARGS__);      \
  } while (0)
