"""The same recipes give the same CPU losses, bit for bit, as the values recorded in data/recipe_losses.json.

The file holds the per-step loss and gradient norm of three tiny runs on 4 CPU ranks (TP2xPP2; DP2xTP2 with
ZeRO-1 and sequence parallelism; PP2xVP2 with selective recompute, WSD decay and SGD). It was recorded
with the recipe and trainer code that preceded the single-declaration RunConfig, so this test shows that
parsing, defaults and validation moved without changing the computation. The runs are deterministic on CPU
ranks (fixed reduction order), so any difference in a loss is a change in what is computed.

Recording again (after an intended numerical change, or on a machine whose CPU changes Eigen's kernels):
MEGACORE_RECORD_LOSSES=1 pytest tests/python/test_recipe_losses.py.
"""

import json
import os
import subprocess
import sys

import pytest

import megacore as mc
from megacore import recipes

needs_mpi = pytest.mark.skipif(not mc.comm.mpi_available(), reason="built without MPI")

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "recipe_losses.json")
STEPS = 6
RUNS = {
    "tp2_pp2": [],
    "dp2_tp2_zero_sp": ["parallel.pp=1", "parallel.zero=true", "parallel.sp=true"],
    "pp2_vp2_selective_wsd_sgd": ["parallel.tp=1", "parallel.vp=2", "data.micro_batch_size=2",
                                  "trainer.recompute=selective", "optim.lr_decay_style=wsd", "optim.optimizer=sgd",
                                  "optim.lr=0.05", "optim.min_lr=0.005"],
}


def _run(tmp_path, name, sets):
    r = recipes.tiny.pretrain_recipe(dir=str(tmp_path / name))
    r.trainer.max_steps = STEPS
    r.trainer.generate_tokens = 0
    r.trainer.val_check_interval = 0
    r.checkpoint.save_last = False
    r.data.cache_dir = str(tmp_path / "data")
    r.apply_overrides(sets)
    cfg = tmp_path / f"{name}.json"
    r.to_json(str(cfg))
    cmd = [sys.executable, "-m", "megacore.launch", "--nproc-per-node", "4", "--cpu", "-m", "megacore.train",
           "--config", str(cfg)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(r.logging.log_dir, "metrics.jsonl"))]
    return [[row["loss"], row["grad_norm"]] for row in rows if "loss" in row]


@needs_mpi
def test_recipes_reproduce_the_recorded_losses_bit_for_bit(tmp_path):
    got = {name: _run(tmp_path, name, sets) for name, sets in RUNS.items()}
    if os.environ.get("MEGACORE_RECORD_LOSSES") == "1":
        with open(GOLDEN, "w") as f:
            json.dump({"steps": STEPS, "runs": got}, f, indent=1)
        pytest.skip(f"recorded {GOLDEN}")
    want = json.load(open(GOLDEN))["runs"]
    for name in RUNS:
        assert len(got[name]) == STEPS, name
        # float equality on purpose: JSON keeps every bit of a double (shortest round-trip form)
        assert got[name] == want[name], (name, got[name], want[name])
