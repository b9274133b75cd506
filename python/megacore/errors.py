"""megacore's exception classes.

Each C++ error type arrives in Python as one of these. They also derive from the matching built-in
exception, so ``except ValueError`` catches ``megacore.ValueError`` and ``megacore.ConfigError``.
"""

import builtins


class Error(Exception):
    """Base of every megacore error."""


class ValueError(Error, builtins.ValueError):  # noqa: A001 - deliberately mirrors the builtin
    """A bad argument: wrong dtype, shape, device, index, or a value out of range."""


class ConfigError(ValueError):
    """A configuration that cannot work as a whole; raised before any work starts."""


class CommError(Error, builtins.RuntimeError):
    """A collective failed, timed out, or a peer died."""


class CudaError(Error, builtins.RuntimeError):
    """A CUDA, cuBLAS, cuDNN or driver call failed."""


class OutOfMemoryError(Error, builtins.MemoryError):
    """An allocation failed after the caching allocator released what it could."""


class IOError(Error, builtins.OSError):  # noqa: A001
    """A file is missing, truncated, corrupt or of the wrong kind."""


class PeerIOError(IOError):
    """This rank stops because another rank failed in a step every rank takes together (a checkpoint's save or
    load): that rank's own error says why. ``failed_rank`` is the rank that failed."""

    failed_rank = None


class InternalError(Error, builtins.RuntimeError):
    """A broken invariant inside megacore: a bug in the library, not in the caller's input."""


__all__ = ["Error", "ValueError", "ConfigError", "CommError", "CudaError", "OutOfMemoryError", "IOError",
           "PeerIOError", "InternalError"]
