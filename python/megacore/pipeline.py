"""Pipeline parallelism (see docs/pipeline.md): ``PipelineLayout`` (layers per pipeline rank and virtual
chunk), schedules as data (``rank_schedule``, ``theoretical_bubble_fraction``), ``make_stage`` (a
``GPTModel`` holding one stage) and ``PipelineEngine``, which runs a training step's forwards and backwards
over this rank's chunks with the 1F1B or interleaved 1F1B schedule::

    layout = pipeline.PipelineLayout.uniform(cfg.num_layers, pp, vp)
    # or balanced for the head's extra work (in layers): PipelineLayout.balanced(L, pp, vp, head_cost=1.5),
    # with the cost derived from the model's shape: stage_costs_from_model(cfg, seq_len, tp) -> (0.0, 4.0);
    # under block recompute (full, first N layers of each chunk) pass recompute_num_layers=N to it and to
    # balanced / choose_layout / rank_work / describe_layout: those N layers cost 4/3 of a plain layer
    chunks = [pipeline.make_stage(cfg, grid.tp, layout.layer_indices(r, c), layout.has_embedding(r, c),
                                  layout.has_head(r, c)) for c in range(vp)]
    engine = pipeline.PipelineEngine(grid.pp, layout, chunks, dp=grid.dp)
    result = engine.step([(tokens, labels, mask), ...])   # result["loss"]: global per-token mean
"""

from ._C import pipeline as _p

PipelineLayout = _p.PipelineLayout
PipelineEngine = _p.PipelineEngine
make_stage = _p.make_stage
rank_schedule = _p.rank_schedule
theoretical_bubble_fraction = _p.theoretical_bubble_fraction
num_microbatches = _p.num_microbatches
stage_costs_from_profile = _p.stage_costs_from_profile
stage_costs_from_model = _p.stage_costs_from_model
resolve_stage_costs = _p.resolve_stage_costs
choose_layout = _p.choose_layout
rank_work = _p.rank_work
describe_layout = _p.describe_layout

__all__ = [
    "PipelineLayout", "PipelineEngine", "make_stage", "rank_schedule", "theoretical_bubble_fraction",
    "num_microbatches", "stage_costs_from_profile", "stage_costs_from_model", "resolve_stage_costs", "choose_layout",
    "rank_work", "describe_layout",
]
