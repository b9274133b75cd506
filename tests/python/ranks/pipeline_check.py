"""Run on 2 or 4 CPU ranks (by tests/python/test_pipeline.py through megacore.launch): PP = world size,
VP 2, tiny Llama (4·PP layers). The engine's loss must equal the token-weighted mean loss of a whole
model run on this rank (micro-batches with different masks, so the weighting matters), on every rank, and
the executed ops must be rank_schedule(). Prints 'rank R ok'; any mismatch raises."""

import numpy as np

import megacore as mc
from megacore import model, parallel, pipeline

world = mc.comm.init_from_env("cpu", timeout_s=60)
pp = world.size
grid = parallel.ProcessGrid(world, parallel.ParallelConfig(pipeline=pp, virtual_pipeline=2))
cfg = model.tiny_llama()
cfg.num_layers = 4 * pp
layout = pipeline.PipelineLayout.uniform(cfg.num_layers, pp, 2)
r = grid.pp_rank
chunks = [pipeline.make_stage(cfg, grid.tp, layout.layer_indices(r, c), layout.has_embedding(r, c),
                              layout.has_head(r, c)) for c in range(2)]
engine = pipeline.PipelineEngine(grid.pp, layout, chunks, dp=grid.dp, record_ops=True)

rng = np.random.default_rng(0)  # the same batches on every rank
mbs = []
for i in range(2 * pp):
    mask = (rng.random((2, 8)) < 0.3 + 0.15 * i).astype(np.float32)
    mask[0, 0] = 1.0
    mbs.append((rng.integers(0, cfg.vocab_size, (2, 8)), rng.integers(0, cfg.vocab_size, (2, 8)), mask))
res = engine.step(mbs)

whole = model.GPTModel(cfg, grid.tp)
losses = [whole.forward(t, l, m) for t, l, m in mbs]
tokens = [float(m.sum()) for _, _, m in mbs]
want = sum(a * b for a, b in zip(losses, tokens)) / sum(tokens)
assert abs(res["loss"] - want) <= 1e-5 * want, (res["loss"], want)
assert res["tokens"] == sum(tokens), (res["tokens"], sum(tokens))
assert res["executed"] == pipeline.rank_schedule(pp, 2, 2 * pp, r)
assert 0.0 <= res["idle_fraction"] <= 1.0
print(f"rank {r} ok")
