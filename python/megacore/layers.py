"""Tensor-parallel layers usable directly from Python, with explicit forward and backward.

``ColumnParallelLinear(tp_comm, in_features, out_features, bias=True, gather_output=False, ...)`` and
``RowParallelLinear(tp_comm, in_features, out_features, bias=True, input_is_parallel=False, ...)``:
``forward(x)`` / ``backward(dy)`` run on the current stream of the tensor's device; ``weight`` and
``bias`` are ``(data, main_grad)`` pairs. Inputs may be megacore tensors, numpy arrays or DLPack tensors.
"""

from ._C import layers as _l

ColumnParallelLinear = _l.ColumnParallelLinear
RowParallelLinear = _l.RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
