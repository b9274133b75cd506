"""The trainer on GPUs: the tiny recipe in bf16 must actually learn (a step that never reaches the weights —
e.g. an optimizer reading gradients before their reduction landed — leaves the loss flat)."""

import json
import os
import subprocess
import sys

import pytest

import megacore as mc
from megacore import recipes


def _gpu_recipe(world, run_dir, steps):
    """The tiny recipe in bf16 on `world` GPUs, head_dim 64 (the GPU attention kernels take 64 or 128)."""
    r = recipes.tiny.pretrain_recipe(num_gpus_per_node=world, dir=str(run_dir))
    r.model.kv_channels = 64
    r.trainer.precision = "bf16"
    r.trainer.max_steps = steps
    r.trainer.generate_tokens = 0
    r.trainer.val_check_interval = 0
    return r


def _train_on_gpus(r, world, cfg):
    """Runs the recipe on `world` GPUs; returns (stdout and stderr, the metrics rows that carry a loss)."""
    r.to_json(str(cfg))
    p = subprocess.run([sys.executable, "-m", "megacore.launch", "--nproc-per-node", str(world), "-m",
                        "megacore.train", "--config", str(cfg)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(x) for x in open(os.path.join(r.logging.log_dir, "metrics.jsonl"))]
    return p.stdout + p.stderr, [x for x in rows if "loss" in x]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["tp1pp1", "tp2pp2"])
def test_tiny_recipe_learns_on_gpus(tmp_path, layout):
    n = mc.cuda_device_count()
    world = 1 if layout == "tp1pp1" else 4
    if n < world:
        pytest.skip(f"needs {world} GPUs")
    r = _gpu_recipe(world, tmp_path / "run", 30)
    if layout == "tp1pp1":
        r.parallel.tensor_model_parallel_size = r.parallel.pipeline_model_parallel_size = 1
    _, rows = _train_on_gpus(r, world, tmp_path / "r.json")
    losses = [x["loss"] for x in rows]
    print(layout, [round(x, 3) for x in losses])
    # Same bar as the CPU f32 run of this recipe (which reaches about 2.4 by step 30): below 3.5.
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < 3.5, losses


@pytest.mark.gpu
def test_overlap_param_gather_on_gpus_changes_no_number(tmp_path):
    """ZeRO-1 on GPUs with overlap_param_gather: the all-gathers are left running after the step and each layer's
    forward is ordered after its own gathers on the stream, without blocking the host. A forward that ran before
    its gather landed would read last step's weights for the shards other ranks own, and the losses would drift
    from the run that waits for every gather before going on. Same losses and gradient norms, bit for bit."""
    n = mc.cuda_device_count()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    world = 4 if n >= 4 else 2
    runs = []
    for ov in (False, True):
        r = _gpu_recipe(world, tmp_path / f"pg{int(ov)}", 12)
        r.parallel.tensor_model_parallel_size = r.parallel.pipeline_model_parallel_size = 1
        r.parallel.use_distributed_optimizer = True
        r.parallel.overlap_param_gather = ov
        out, rows = _train_on_gpus(r, world, tmp_path / f"pg{int(ov)}.json")
        assert ("| overlap_param_gather" in out) == ov, out[-2000:]
        runs.append([(x["loss"], x["grad_norm"]) for x in rows])
    print(runs[1])
    assert len(runs[0]) == 12 and runs[0][0][0] > 5.0
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("cp,comm_type", [(2, "p2p"), (4, "p2p"), (2, "all_gather")])
def test_context_parallel_on_gpus_matches_cp1(tmp_path, cp, comm_type):
    """CP on GPUs (the ring on its communication stream, the merge kernels, cuDNN or flash blocks): the tiny recipe
    in bf16 at CP = cp gives the losses of CP = 1 over the same GPUs (DP = cp). The two runs round differently
    (blockwise attention merged in f32 vs one kernel over the whole row, gradients summed in another order), so
    the bar is bf16's: the first loss (same weights, forward only) within 5e-3 relative, every step within 3e-2,
    and both runs learn."""
    if mc.cuda_device_count() < cp:
        pytest.skip(f"needs {cp} GPUs")
    runs = {}
    for c in (1, cp):
        r = _gpu_recipe(cp, tmp_path / f"cp{c}", 12)
        r.parallel.tensor_model_parallel_size = r.parallel.pipeline_model_parallel_size = 1
        r.parallel.context_parallel_size = c
        r.parallel.cp_comm_type = comm_type
        out, rows = _train_on_gpus(r, cp, tmp_path / f"cp{c}.json")
        if c > 1:
            assert f"CP {c}" in out, out[-2000:]
        runs[c] = [x["loss"] for x in rows]
    print("CP 1:", runs[1], f"CP {cp}:", runs[cp])
    assert len(runs[cp]) == len(runs[1]) == 12
    assert abs(runs[cp][0] - runs[1][0]) <= 5e-3 * runs[1][0]
    assert all(abs(a - b) <= 3e-2 * b for a, b in zip(runs[cp], runs[1]))
    assert runs[cp][-1] < runs[cp][0]


@pytest.mark.gpu
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_comm_copy_engine_on_gpus_changes_no_number(tmp_path, cp):
    """`--set parallel.cp_comm_copy_engine=true` (the CP ring's K/V and dK/dV passes read by the receiving GPU's
    copy engine from the sender's tensor through CUDA IPC instead of NCCL's kernels) moves the same bytes, so the tiny recipe in bf16 at CP = cp trains to the same
    losses as with NCCL's send/receive (the rest of the step is the same kernels in the same order): within 1e-3
    relative at every step (bit-identical where the kernels are deterministic; printed), and the log says the CP
    group moves by copy engines."""
    if mc.cuda_device_count() < cp:
        pytest.skip(f"needs {cp} GPUs")
    runs = {}
    for ce in (False, True):
        r = _gpu_recipe(cp, tmp_path / f"ce{int(ce)}", 10)
        r.parallel.tensor_model_parallel_size = r.parallel.pipeline_model_parallel_size = 1
        r.parallel.context_parallel_size = cp
        r.parallel.cp_comm_copy_engine = ce
        out, rows = _train_on_gpus(r, cp, tmp_path / f"ce{int(ce)}.json")
        if ce:
            assert "move by copy engines" in out, out[-3000:]
        runs[ce] = [x["loss"] for x in rows]
    print("NCCL:", runs[False], "copy engines:", runs[True], "bit-identical:", runs[False] == runs[True])
    assert len(runs[True]) == len(runs[False]) == 10
    assert all(abs(a - b) <= 1e-3 * b for a, b in zip(runs[True], runs[False]))
    assert runs[True][-1] < runs[True][0]


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_fp8_training_tracks_bf16_on_gpus(tmp_path, scaling):
    """FP8 linears (cuBLASLt E4M3/E5M2 GEMMs) on the tiny recipe, TP 2 on 2 GPUs (or TP 1 on one): the run prints
    its FP8 line, learns (the mean loss of the last 5 of 30 steps under 60 % of the first step's), and that mean is
    within 5 % of the bf16 run's (skipped on cards other than H100/H200). 5 %: at this size and learning rate the
    two trajectories part after about 10 steps and do not meet again by step 30 — on one H200 (2026-11-29, TP 1,
    model and data seeds 1234 / 7 / 42) the last-5 means differed by -2.5 / +0.2 / +3.0 % with current scaling and
    -1.5 / -0.3 / +3.2 % with delayed, both FP8 modes to the same side for a seed. The numerics of each FP8 GEMM are
    held to a CPU reference by the [fp8][gpu] tests; the CPU emulation tracks bf16 to 0.15 % at 20 steps."""
    n = mc.cuda_device_count()
    world = 2 if n >= 2 else 1
    runs = {}
    for name in ("bf16", scaling):
        r = _gpu_recipe(world, tmp_path / name, 30)
        r.parallel.tensor_model_parallel_size, r.parallel.pipeline_model_parallel_size = world, 1
        if name != "bf16":
            r.trainer.fp8 = scaling
        if name != "bf16" and "H100" not in mc.cuda_device_name(0) and "H200" not in mc.cuda_device_name(0):
            pytest.skip("FP8 needs compute capability 8.9+ (tested on H100/H200)")
        out, rows = _train_on_gpus(r, world, tmp_path / f"{name}.json")
        runs[name] = [x["loss"] for x in rows]
        if name != "bf16":
            assert f"FP8 {scaling} scaling" in out and "CPU emulation" not in out
    a, b = sum(runs[scaling][-5:]) / 5, sum(runs["bf16"][-5:]) / 5
    print(scaling, [round(x, 3) for x in runs[scaling]], "bf16", [round(x, 3) for x in runs["bf16"]])
    assert a < 0.6 * runs[scaling][0], (a, runs[scaling][0])
    assert abs(a - b) / b < 0.05, (a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("tp,scaling", [(2, "delayed"), (1, "current")])
def test_fp8_param_gather_on_gpus_changes_no_number(tmp_path, tp, scaling):
    """ZeRO-1 with FP8 on 4 GPUs (TP 2 x DP 2, or DP 4; on a 2-GPU machine DP 2 for both), overlap_param_gather on:
    gathering the FP8 weights as E4M3 codes (each rank casts its shard on the GPU, NCCL gathers bytes, the transposed
    codes and the dequantized bf16 weights are built on the GPU) gives the same 8 losses and gradient norms bit for
    bit as the bf16 gather (skipped on fewer than 2 GPUs or on cards other than H100/H200)."""
    gpus = 4 if mc.cuda_device_count() >= 4 else 2
    if mc.cuda_device_count() < 2:
        pytest.skip("needs 2 GPUs")
    tp = min(tp, gpus // 2)
    if "H100" not in mc.cuda_device_name(0) and "H200" not in mc.cuda_device_name(0):
        pytest.skip("FP8 needs compute capability 8.9+ (tested on H100/H200)")
    runs = []
    for on in (False, True):
        r = _gpu_recipe(gpus, tmp_path / f"g{int(on)}", 8)
        r.parallel.tensor_model_parallel_size, r.parallel.pipeline_model_parallel_size = tp, 1
        r.parallel.use_distributed_optimizer = r.parallel.overlap_param_gather = True
        r.parallel.bucket_size = 200000  # several FP8 buckets, weights cut by the DP shards
        r.trainer.fp8, r.trainer.fp8_param_gather = scaling, on
        out, rows = _train_on_gpus(r, gpus, tmp_path / f"g{int(on)}.json")
        assert ("gathered as" in out) == on, out[-2000:]
        runs.append([(x["loss"], x["grad_norm"]) for x in rows])
    print(runs[1])
    assert len(runs[0]) == 8 and runs[0][0][0] > 5.0
    assert runs[0] == runs[1]
