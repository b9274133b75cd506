"""Loss scaling and DDP helpers from ``megacore/optim`` (C++).

``DynamicLossScaler(LossScalerConfig(initial_scale=2**16, hysteresis=2))`` follows Megatron-Core's
DynamicGradScaler: multiply the loss by ``scale``, call ``update(found_inf)`` after each step (skip the
step when ``found_inf``), and save ``state()`` in checkpoints. DDP, the distributed optimizer (ZeRO-1),
AdamW/SGD and gradient clipping run inside the C++ Trainer (``megacore.train``); docs/optim.md describes
them.
"""

from ._C import optim as _o

LossScalerConfig = _o.LossScalerConfig
DynamicLossScaler = _o.DynamicLossScaler
default_bucket_size = _o.default_bucket_size

__all__ = ["LossScalerConfig", "DynamicLossScaler", "default_bucket_size"]
