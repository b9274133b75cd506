"""Process grid: the TP/CP/EP/DP/PP groups of Megatron-Core's rank order (``tp-cp-ep-dp-pp``).

``GridLayout(ParallelConfig(tensor=2, pipeline=2), world_size=8)`` is the pure rank math (validated up
front with ``megacore.ConfigError`` naming the fix); ``ProcessGrid(world, config)`` builds the
communicators of this rank's groups from a world communicator.
"""

from ._C import parallel as _p

ParallelConfig = _p.ParallelConfig
GridLayout = _p.GridLayout
ProcessGrid = _p.ProcessGrid
group_kinds = _p.group_kinds

__all__ = ["ParallelConfig", "GridLayout", "ProcessGrid", "group_kinds"]
