"""megacore: Megatron-Core-style parallelism for training large language models.

The compiled core lives in ``megacore._C``; this package re-exports it with a Pythonic surface.
"""

from contextlib import contextmanager

from . import checkpoint, comm, convert, data, errors, layers, model, ops, optim, parallel, peft, pipeline, recipes
from ._C import (
    Event,
    Generator,
    Stream,
    Tensor,
    build_info,
    cuda_available,
    cuda_device_count,
    cuda_device_name,
    cuda_device_total_memory,
    current_stream,
    empty,
    empty_cache,
    from_dlpack,
    from_numpy,
    full,
    host_sync_count,
    host_sync_counts,
    log_level,
    memory_stats,
    reset_host_syncs,
    reset_peak_memory_stats,
    set_log_level,
    set_memory_limit,
    synchronize,
    zeros,
)
from ._C import _set_current_stream
from .errors import (CommError, ConfigError, CudaError, Error, InternalError, IOError, OutOfMemoryError, PeerIOError,
                     ValueError)
from .executors import KubernetesExecutor, LocalExecutor, SlurmExecutor, run
from .finetuning import finetune

__version__ = build_info()["version"]


@contextmanager
def stream(s):
    """Makes ``s`` the current stream of its device inside the block (like ``torch.cuda.stream``)."""
    prev = _set_current_stream(s)
    try:
        yield s
    finally:
        _set_current_stream(prev)


def tensor(array, dtype=None, device="cpu"):
    """A new tensor holding a copy of ``array`` (anything numpy can convert)."""
    import numpy as np

    np_dtypes = {"f32": np.float32, "float32": np.float32, "f16": np.float16, "float16": np.float16,
                 "bf16": np.float32, "bfloat16": np.float32, "i32": np.int32, "int32": np.int32,
                 "i64": np.int64, "int64": np.int64, "u8": np.uint8, "uint8": np.uint8}
    if dtype is not None and dtype not in np_dtypes:
        raise errors.ValueError(f"unknown dtype '{dtype}'; use one of f32, bf16, f16, i32, i64, u8")
    a = np.ascontiguousarray(np.asarray(array, dtype=np_dtypes.get(dtype)))
    if a.dtype == np.float64:
        a = a.astype(np.float32)
    t = from_numpy(a).clone()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.to(device) if device != "cpu" else t


__all__ = [
    "Error", "ValueError", "ConfigError", "CommError", "CudaError", "OutOfMemoryError", "IOError", "PeerIOError",
    "InternalError", "errors",
    "Tensor", "Generator", "Stream", "Event", "empty", "zeros", "full", "tensor", "from_numpy", "from_dlpack",
    "cuda_available", "cuda_device_count", "cuda_device_name", "cuda_device_total_memory", "current_stream", "stream", "synchronize",
    "memory_stats", "reset_peak_memory_stats", "host_sync_count", "host_sync_counts", "reset_host_syncs", "empty_cache", "set_memory_limit", "build_info", "log_level",
    "set_log_level", "comm", "data", "parallel",
    "model", "layers", "optim", "pipeline", "checkpoint", "convert", "recipes", "run", "LocalExecutor", "SlurmExecutor", "KubernetesExecutor",
    "peft", "finetune",
]
