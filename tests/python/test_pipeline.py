"""megacore.pipeline from Python: layouts and schedules as data, a PP = 1 stage engine on one rank
against the whole model, and a real pipeline (PP 2 and 4, interleaved) on CPU ranks through
megacore.launch (tests/python/ranks/pipeline_check.py: loss = the token-weighted mean of a whole model)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import megacore as mc
from megacore import model, pipeline

HERE = os.path.dirname(os.path.abspath(__file__))


def test_layout_and_schedule_as_data():
    lay = pipeline.PipelineLayout.uniform(8, 2, 2)
    assert lay.counts == [2, 2, 2, 2]
    assert lay.layer_indices(1, 0) == [2, 3] and lay.layer_indices(0, 1) == [4, 5]
    assert lay.has_embedding(0, 0) and lay.has_head(1, 1) and not lay.has_head(1, 0)
    with pytest.raises(mc.ConfigError):
        pipeline.PipelineLayout.uniform(8, 3, 1)
    ops = pipeline.rank_schedule(2, 1, 4, 0)
    # Rank 0 of 1F1B with PP 2: one warm-up forward, then F/B pairs, each forward sent to rank 1.
    assert ops[:3] == [("F", 0, 0, -1), ("SendForward", 0, 0, 1), ("F", 1, 0, -1)]
    assert sum(op[0] == "F" for op in ops) == 4 and sum(op[0] == "B" for op in ops) == 4
    assert pipeline.theoretical_bubble_fraction(4, 1, 8) == pytest.approx(3 / 11)
    assert pipeline.num_microbatches(64, 2, 4) == 8


def test_single_stage_engine_equals_whole_model():
    world = mc.comm.init_from_env("cpu")
    cfg = model.tiny_llama()
    lay = pipeline.PipelineLayout.uniform(cfg.num_layers, 1, 1)
    stage = pipeline.make_stage(cfg, world, lay.layer_indices(0, 0), True, True)
    engine = pipeline.PipelineEngine(world, lay, [stage], record_ops=True)
    rng = np.random.default_rng(3)
    mbs = [(rng.integers(0, 256, (2, 8)), rng.integers(0, 256, (2, 8))) for _ in range(3)]
    res = engine.step(mbs)
    whole = model.GPTModel(cfg, world)
    want = np.mean([whole.forward(t, l) for t, l in mbs])  # equal token counts: mean of means
    assert res["loss"] == pytest.approx(want, rel=1e-6)
    assert res["executed"] == pipeline.rank_schedule(1, 1, 3, 0)
    grads = {n: np.asarray(g).copy() for n, (_, g) in stage.parameters().items()}
    whole.zero_grad()
    for t, l in mbs:
        whole.forward(t, l)
        whole.backward()
    for n, (_, g) in whole.parameters().items():
        np.testing.assert_allclose(grads[n], np.asarray(g) / 3, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not mc.comm.mpi_available(), reason="built without MPI")
@pytest.mark.parametrize("nproc", [2, 4])
def test_pipeline_on_cpu_ranks(nproc):
    cmd = [sys.executable, "-m", "megacore.launch", "--nproc-per-node", str(nproc), "--cpu",
           os.path.join(HERE, "ranks", "pipeline_check.py")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for r in range(nproc):
        assert f"rank {r} ok" in p.stdout
