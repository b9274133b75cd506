"""The trainer end to end on CPU ranks: the tiny recipe with TP = 2 × PP = 2 on 4 ranks converges, saves,
resumes bit for bit, and loads into another layout; bad recipes fail before any rank starts."""

import json
import os
import subprocess
import sys

import pytest

import megacore as mc
from megacore import cli, recipes

needs_mpi = pytest.mark.skipif(not mc.comm.mpi_available(), reason="built without MPI")


def _train(recipe, tmp_path, name, timeout=600):
    cfg = tmp_path / f"{name}.json"
    recipe.to_json(str(cfg))
    cmd = [sys.executable, "-m", "megacore.launch", "--nproc-per-node", str(recipe.world_size), "--cpu",
           "-m", "megacore.train", "--config", str(cfg)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return p.stdout


def _metrics(log_dir):
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def _tiny(tmp_path, name, steps, **sets):
    r = recipes.tiny.pretrain_recipe(dir=str(tmp_path / name))
    r.trainer.max_steps = steps
    r.trainer.generate_tokens = 0
    r.data.cache_dir = str(tmp_path / "data")  # the corpus and its indices are shared by the runs of a test
    for k, v in sets.items():
        r.set(k.replace("__", "."), v)
    return r


@needs_mpi
def test_tiny_recipe_tp2_pp2_converges_and_samples(tmp_path):
    r = _tiny(tmp_path, "conv", 40)
    r.trainer.val_check_interval = 20
    r.trainer.generate_tokens = 12
    out = _train(r, tmp_path, "conv")
    steps, vals = _metrics(r.logging.log_dir)
    assert [s["step"] for s in steps] == list(range(1, 41))
    first = steps[0]["loss"]
    last = sum(s["loss"] for s in steps[-5:]) / 5
    # ln(259) ≈ 5.56 at initialisation; the embedded corpus is highly regular, so 40 steps of 16 × 128 tokens
    # take the loss below 3.0 (measured: about 2.5). A stalled or mis-wired pipeline stays near 5.5.
    assert first > 5.0, first
    assert last < 3.0, (first, last)
    assert [v["step"] for v in vals] == [20, 40] and vals[1]["val_loss"] < 3.2
    for s in steps:
        assert s["tokens_per_s"] > 0 and s["grad_norm"] > 0 and not s["skipped"]
    assert steps[0]["lr"] == 0 and steps[5]["lr"] == r.optim.lr  # linear warmup from 0 over 5 steps
    print("tiny TP2xPP2 losses:", [round(s["loss"], 3) for s in steps], "val:", vals)
    assert "step 40/40 | loss" in out and "TFLOP/s/GPU" in out
    assert "sample: 'sam says tree' ->" in out
    ckpt = os.path.join(r.checkpoint.save_dir, "step_40")
    assert os.path.isfile(os.path.join(ckpt, "metadata.json"))
    assert open(os.path.join(r.checkpoint.save_dir, "latest")).read().strip() == "step_40"
    tb = os.listdir(os.path.join(r.logging.log_dir, "tensorboard"))
    assert len(tb) == 1 and tb[0].startswith("events.out.tfevents.")


@needs_mpi
def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    full = _tiny(tmp_path, "full", 10)
    _train(full, tmp_path, "full")
    ref, _ = _metrics(full.logging.log_dir)

    first = _tiny(tmp_path, "split", 10, trainer__stop_after_steps=5)  # a time-limited job: stops (and saves) at 5
    out = _train(first, tmp_path, "first")
    assert "step 5 | checkpoint" in out
    second = _tiny(tmp_path, "split", 10)  # same save_dir: resume = auto finds step_5
    out = _train(second, tmp_path, "second")
    assert "resumed at step 5 (80 samples consumed)" in out
    got, _ = _metrics(second.logging.log_dir)  # the log holds both runs' lines
    assert [g["step"] for g in got] == list(range(1, 11))
    assert [g["loss"] for g in got] == [r["loss"] for r in ref]
    assert [g["grad_norm"] for g in got] == [r["grad_norm"] for r in ref]


@needs_mpi
def test_zero_resume_from_per_rank_shards_is_bit_exact(tmp_path):
    """TP2×DP2 with ZeRO-1: every DP rank writes the optimizer shard it owns and reads it back in place; stopping at
    5 and resuming reproduces the uninterrupted run's losses and grad norms bit for bit."""
    full = _tiny(tmp_path, "zfull", 8, parallel__pp=1, parallel__zero=True)
    _train(full, tmp_path, "zfull")
    ref, _ = _metrics(full.logging.log_dir)
    first = _tiny(tmp_path, "zsplit", 8, parallel__pp=1, parallel__zero=True, trainer__stop_after_steps=5)
    _train(first, tmp_path, "zfirst")
    meta = json.load(open(os.path.join(first.checkpoint.save_dir, "step_5", "metadata.json")))
    files = {s["file"] for n, t in meta["tensors"].items() if n.startswith("optimizer.") for s in t["shards"]}
    assert len(files) == 4, files  # TP2×DP2: each rank wrote its own part of the optimizer state
    second = _tiny(tmp_path, "zsplit", 8, parallel__pp=1, parallel__zero=True)
    _train(second, tmp_path, "zsecond")
    got, _ = _metrics(second.logging.log_dir)
    assert [g["step"] for g in got] == list(range(1, 9))
    assert [g["loss"] for g in got] == [r["loss"] for r in ref]
    assert [g["grad_norm"] for g in got] == [r["grad_norm"] for r in ref]


@needs_mpi
def test_zero_resume_with_pipeline_and_tied_embeddings_is_bit_exact(tmp_path):
    """PP2×DP2 with ZeRO-1 and tied embeddings: the last stage's copy of the embedding is never written (its ZeRO
    shards neither), the save's tiling check passes, and stopping at 3 then resuming reproduces the run."""
    sets = dict(parallel__tp=1, parallel__pp=2, parallel__zero=True, model__tie_word_embeddings=True)
    full = _tiny(tmp_path, "tfull", 6, **sets)
    _train(full, tmp_path, "tfull")
    ref, _ = _metrics(full.logging.log_dir)
    first = _tiny(tmp_path, "tsplit", 6, trainer__stop_after_steps=3, **sets)
    _train(first, tmp_path, "tfirst")
    meta = json.load(open(os.path.join(first.checkpoint.save_dir, "step_3", "metadata.json")))
    assert "output_layer.weight" not in meta["tensors"]
    emb = {s["file"] for s in meta["tensors"]["optimizer.embedding.weight.master"]["shards"]}
    # Written by the first stage's ranks (world ranks 0 and 1 in Megatron's order) only, whichever of them owns
    # which part; the tied copy on the last stage (ranks 2 and 3) is not written.
    assert emb and emb <= {"shard_00000.safetensors", "shard_00001.safetensors"}, emb
    second = _tiny(tmp_path, "tsplit", 6, **sets)
    _train(second, tmp_path, "tsecond")
    got, _ = _metrics(second.logging.log_dir)
    assert [g["loss"] for g in got] == [r["loss"] for r in ref]
    assert [g["grad_norm"] for g in got] == [r["grad_norm"] for r in ref]


@needs_mpi
def test_checkpoint_of_tp2_pp2_continues_under_dp_zero(tmp_path):
    """A checkpoint written by TP2×PP2 (AdamW) resumes under DP=2×TP=2 with ZeRO-1: the next two steps' losses equal
    the TP2×PP2 run's within f32 reduction-order tolerance (step 6 checks the weights, step 7 the optimizer state)."""
    a = _tiny(tmp_path, "a", 7)
    _train(a, tmp_path, "a")
    ref, _ = _metrics(a.logging.log_dir)
    b1 = _tiny(tmp_path, "b", 7, trainer__stop_after_steps=5)
    _train(b1, tmp_path, "b1")
    b2 = _tiny(tmp_path, "b", 7, parallel__pp=1, parallel__zero=True)
    _train(b2, tmp_path, "b2")
    got, _ = _metrics(b2.logging.log_dir)
    assert [g["step"] for g in got[-2:]] == [6, 7]
    for g, r in zip(got[-2:], ref[-2:]):
        assert abs(g["loss"] - r["loss"]) <= 1e-4 * abs(r["loss"]), (g, r)


def test_bad_recipes_fail_before_any_rank_starts(capsys):
    assert cli.main(["train", "--recipe", "tiny", "--set", "parallel.tp=3"]) == 1
    err = capsys.readouterr().err
    assert "world size 4" in err and "not divisible by TP×PP×CP = 3×2×1" in err
    assert cli.main(["train", "--recipe", "tiny", "--set", "parallel.tensor=2"]) == 1
    assert "unknown field 'tensor' in recipe section 'parallel'" in capsys.readouterr().err
    assert cli.main(["train", "--recipe", "tiny", "--set", "data.paths=/no/such/prefix"]) == 1
    assert "'/no/such/prefix' has no /no/such/prefix.bin" in capsys.readouterr().err
    assert cli.main(["train", "--recipe", "nope"]) == 1
    assert "unknown recipe 'nope'" in capsys.readouterr().err


def test_train_dry_runs_and_saved_config(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--recipe", "tiny", "--cpu", "--dryrun"]) == 0
    out = capsys.readouterr()
    assert "-m megacore.launch --nproc-per-node 4 --cpu -m megacore.train --config" in out.out
    # The printed command reads a recipe file: the dry run writes it (and says so).
    cfg = out.out.split()[-1]
    assert os.path.isabs(cfg) and os.path.isfile(cfg) and f"wrote the recipe to {cfg}" in out.err
    want = recipes.get("tiny")
    want.trainer.device = "cpu"  # --cpu: the ranks train on the CPU even where GPUs are visible, and the recipe says so
    assert recipes.Recipe.from_file(cfg).to_json() == want.to_json()
    assert cli.main(["train", "--recipe", "llama32_1b", "--nodes", "2", "--nproc-per-node", "8", "--executor", "slurm",
                     "--dryrun"]) == 0
    assert "#SBATCH --nodes=2" in capsys.readouterr().out
    p = tmp_path / "r.json"
    assert cli.main(["train", "--recipe", "tiny", "--set", "optim.lr=0.01", "--save-config", str(p)]) == 0
    assert recipes.Recipe.from_file(str(p)).optim.lr == 0.01


def test_plan_a_recipe(capsys):
    assert cli.main(["plan", "--recipe", "tiny", "--no-table"]) == 0
    out = capsys.readouterr().out
    assert "layout: world 4 = TP 2 × CP 1 × DP 1 × PP 2" in out
    assert "stage 0:" in out and "stage 1:" in out and "memory per GPU" in out
    assert cli.main(["plan", "--recipe", "llama3_8b", "--set", "resources.gpus=8", "--no-table"]) == 0
    assert "world 8 = TP 2 × CP 1 × DP 4 × PP 1" in capsys.readouterr().out


@needs_mpi
def test_f16_with_dynamic_loss_scaling(tmp_path):
    """f16 parameters and activations with a dynamic loss scale: at the default scale (65536) the tiny recipe
    learns like f32 (measured 5.50 -> 2.18 in 30 steps; held to < 3.0); started at 2^24 the gradients overflow,
    those steps are skipped without an update (the LR schedule does not advance) and the scale backs off until
    steps go through."""
    r = _tiny(tmp_path, "f16", 30, trainer__precision="f16")
    _train(r, tmp_path, "f16")
    steps, _ = _metrics(r.logging.log_dir)
    assert not any(s["skipped"] for s in steps) and all(s["loss_scale"] == 65536 for s in steps)
    assert steps[0]["loss"] > 5.0 and sum(s["loss"] for s in steps[-5:]) / 5 < 3.0

    # 10 steps: even if every step overflows until then, the scale is back at 2^16 by the last ones (no update is
    # made while skipping, so the model is the one that trains fine at 2^16).
    big = _tiny(tmp_path, "f16big", 10, trainer__precision="f16", optim__initial_loss_scale=2.0**24)
    out = _train(big, tmp_path, "f16big")
    steps, _ = _metrics(big.logging.log_dir)
    skipped = [s for s in steps if s["skipped"]]
    assert skipped and steps[0]["skipped"] and "SKIPPED (non-finite gradients)" in out
    for a, b in zip(steps, steps[1:]):  # a skipped step does not advance the LR schedule
        if a["skipped"]:
            assert b["lr"] == a["lr"], (a, b)
    scales = [s["loss_scale"] for s in steps]
    assert scales[0] == 2.0**24 and min(scales) < 2.0**24  # backed off (hysteresis 2: after the second overflow)
    assert any(not s["skipped"] for s in steps)  # once the scale is low enough, updates go through


@needs_mpi
def test_tp_comm_overlap_gives_identical_training(tmp_path):
    """parallel.tp_comm_overlap (the TP collective of the column-parallel backward overlapped with the
    weight-gradient GEMM) reaches the layers through the recipe and changes no number: the same losses and
    gradient norms, bit for bit, with sequence parallelism on (and the communication streams' priority set,
    which only CUDA uses)."""
    runs = []
    for ov in (False, True):
        r = _tiny(tmp_path, f"ov{int(ov)}", 6, parallel__sp=True, parallel__tp_comm_overlap=ov,
                  parallel__tp_comm_stream_priority=-5 if ov else 0)
        out = _train(r, tmp_path, f"ov{int(ov)}")
        assert ("| tp_comm_overlap" in out) == ov and "world 4 = TP 2 x PP 2 (VP 1) x CP 1 x DP 1 on CPU" in out
        runs.append(_metrics(r.logging.log_dir)[0])
    assert [(s["loss"], s["grad_norm"]) for s in runs[0]] == [(s["loss"], s["grad_norm"]) for s in runs[1]]


@needs_mpi
def test_block_recompute_gives_identical_training(tmp_path):
    """trainer.recompute=full with trainer.recompute_num_layers=1 (the first layer of each pipeline stage recomputes,
    the other keeps its activations) reaches the model chunks through the recipe and changes no number: the same
    losses and gradient norms as without recompute, bit for bit, at TP 2 × PP 2."""
    runs = []
    for name, sets in (("none", {}), ("block", {"trainer__recompute": "full", "trainer__recompute_num_layers": 1})):
        r = _tiny(tmp_path, name, 8, **sets)
        out = _train(r, tmp_path, name)
        assert ("| recompute full (first 1 layer per model chunk)" in out) == (name == "block"), out
        runs.append([(s["loss"], s["grad_norm"]) for s in _metrics(r.logging.log_dir)[0]])
    assert len(runs[0]) == 8 and runs[0] == runs[1]


@needs_mpi
def test_async_checkpoints_reserve_their_buffers_and_equal_synchronous_ones(tmp_path):
    """checkpoint.async_save through the trainer: the snapshot buffers are reserved at start (one line says how
    much), the steps go on while checkpoints are written, and every checkpoint's files equal those of the same run
    with synchronous saves, bit for bit."""
    dirs = []
    for a in (False, True):
        r = _tiny(tmp_path, f"async{int(a)}", 6, checkpoint__save_interval=3, checkpoint__async_save=a)
        out = _train(r, tmp_path, f"async{int(a)}")
        assert ("host snapshot buffers reserved on rank 0" in out) == a, out[-2000:]
        dirs.append(r.checkpoint.save_dir)
    for step in ("step_3", "step_6"):
        names = sorted(os.listdir(os.path.join(dirs[0], step)))
        assert names == sorted(os.listdir(os.path.join(dirs[1], step))) and any(n.startswith("shard_") for n in names)
        for n in names:
            if n.startswith("shard_"):
                a, b = (open(os.path.join(d, step, n), "rb").read() for d in dirs)
                assert a == b, (step, n)


@needs_mpi
def test_tp_comm_overlap_forward_gives_identical_training_at_tp2(tmp_path):
    """parallel.tp_comm_overlap_forward (the forward's sequence-parallel all-gathers and reduce-scatters as rings
    overlapping the GEMMs) reaches the layers through the recipe (the start banner names it) and, at TP 2 × PP 2,
    changes no number: the column side computes the same rows, and the row side's ring adds two partial sums,
    which is the collective's sum in either order."""
    runs = []
    for ov in (False, True):
        r = _tiny(tmp_path, f"fwd{int(ov)}", 6, parallel__sp=True, parallel__tp_comm_overlap_forward=ov)
        out = _train(r, tmp_path, f"fwd{int(ov)}")
        assert ("| tp_comm_overlap_forward" in out) == ov and "world 4 = TP 2 x PP 2 (VP 1) x CP 1 x DP 1 on CPU" in out
        runs.append(_metrics(r.logging.log_dir)[0])
    assert [(s["loss"], s["grad_norm"]) for s in runs[0]] == [(s["loss"], s["grad_norm"]) for s in runs[1]]


@needs_mpi
def test_balanced_pipeline_layout_reaches_the_trainer(tmp_path):
    """parallel.pipeline_head_cost splits 5 layers over PP 2 as [3, 2] (balanced for a head worth one layer): the
    trainer says so and trains exactly as with that layout given explicitly."""
    runs = []
    for name, sets in (("bal", {"parallel__pipeline_head_cost": 1.0}), ("expl", {"parallel__pipeline_layout": [3, 2]})):
        r = _tiny(tmp_path, name, 4, parallel__tp=2, parallel__pp=2, model__num_layers=5, optim__lr_warmup_iters=1, **sets)
        out = _train(r, tmp_path, name)
        assert "pipeline layers per stage: 3, 2" in out
        assert ("[balanced for the embedding/head costs]" in out) == (name == "bal")
        runs.append(_metrics(r.logging.log_dir)[0])
    assert [(s["loss"], s["grad_norm"]) for s in runs[0]] == [(s["loss"], s["grad_norm"]) for s in runs[1]]


@needs_mpi
def test_derived_pipeline_layout_trains_as_pp1(tmp_path):
    """With no layout and no costs the trainer balances the split for the head cost derived from the model (0.3
    layers for the tiny model at TP 1: vocab 259 padded to 384): 5 layers over PP 2 become 3 + 2, and 6 layers over
    PP 2 × VP 2 become 1, 2, 2, 1 by virtual stage (unequal chunks under the interleaved schedule); an explicit cost
    wins. The split does not change the math: f32 losses and gradient norms equal PP 1's."""
    head = mc.pipeline.stage_costs_from_model(_tiny(tmp_path, "x", 1).model.to_transformer_config("f32", False, "none"),
                                              128, 1)[1]
    assert head == pytest.approx(6 * 384 * 128 / (6 * (128 * 256 + 128 * 128 + 128 * 512 + 256 * 128) + 6 * 128 * 128))
    # An explicit head cost of 3 layers leaves the last chunk of 4 layers at PP 2 × VP 2 empty (head only).
    for layers, vp, head, text in (
            (5, 1, -1.0, "layers per stage: 3, 2 (head ≈ 0.3 layers; work per stage 3.0, 2.3)"),
            (6, 2, -1.0, "layers per virtual stage (model order): 1, 2, 2, 1; per stage: 3, 3"),
            (4, 2, 3.0, "layers per virtual stage (model order): 1, 1, 2, 0; per stage: 3, 1 (head ≈ 3.0 layers")):
        runs = []
        for pp in (1, 2):
            name = f"l{layers}pp{pp}"
            r = _tiny(tmp_path, name, 3, parallel__tp=1, parallel__pp=pp, parallel__vp=vp if pp > 1 else 1,
                      resources__num_gpus_per_node=pp, model__num_layers=layers, optim__lr_warmup_iters=1,
                      parallel__pipeline_head_cost=head)
            out = _train(r, tmp_path, name)
            if pp > 1:
                assert text in out and "[balanced for the embedding/head costs]" in out, out[-2000:]
            runs.append(_metrics(r.logging.log_dir)[0])
        for a, b in zip(*runs):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=0)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=0)


@needs_mpi
def test_overlap_param_gather_trains_identically(tmp_path):
    """parallel.overlap_param_gather (ZeRO-1's all-gathers left running after the step, each layer waiting for its
    own in the next forward) reaches the trainer and changes no number: PP2 × DP2, the same losses and gradient
    norms bit for bit. (That each forward waits for its gathers is checked in mpi_test_ddp.cpp.)"""
    runs = []
    for ov in (False, True):
        r = _tiny(tmp_path, f"pg{int(ov)}", 4, parallel__tp=1, parallel__pp=2, parallel__zero=True,
                  parallel__overlap_param_gather=ov, optim__lr_warmup_iters=1)
        out = _train(r, tmp_path, f"pg{int(ov)}")
        assert ("| overlap_param_gather" in out) == ov
        runs.append(_metrics(r.logging.log_dir)[0])
    assert [(s["loss"], s["grad_norm"]) for s in runs[0]] == [(s["loss"], s["grad_norm"]) for s in runs[1]]


@needs_mpi
def test_packed_sft_trains_with_boundaries_and_layouts_agree(tmp_path):
    """SFT on packed rows (several examples per row, data.sft_pack): the trainer hands the rows' boundaries and
    restarting positions to every pipeline stage. TP2×PP2 and DP4 see the same global batches, so their
    losses agree within f32 reduction-order tolerance, and the loss falls; the GPTModel-level equality of a
    packed row with its examples run alone is tests/cpp/model/test_gpt_model.cpp's."""
    rows = []
    for i in range(400):
        a, b = i % 17, (i * 7) % 13
        rows.append({"input": f"what is {a} plus {b}?", "output": f"{a} plus {b} is {a + b}."})
    sft = tmp_path / "sft.jsonl"
    sft.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    def run(name, **sets):
        r = _tiny(tmp_path, name, 6, data__sft_path=str(sft), data__paths=[], trainer__val_check_interval=0,
                  **sets)
        assert r.data.sft_pack  # the default
        _train(r, tmp_path, name)
        steps, _ = _metrics(r.logging.log_dir)
        return [s["loss"] for s in steps]

    tp_pp = run("tp2pp2")
    dp = run("dp4", parallel__tp=1, parallel__pp=1)
    assert len(tp_pp) == len(dp) == 6
    for a, b in zip(tp_pp, dp):
        assert abs(a - b) <= 1e-4 * abs(b), (tp_pp, dp)
    print("packed SFT losses TP2xPP2:", tp_pp, "DP4:", dp)
    assert min(tp_pp[2:]) < tp_pp[0] - 0.5, tp_pp


@needs_mpi
def test_the_dry_run_command_runs_when_pasted(tmp_path, capsys, monkeypatch):
    import shlex

    monkeypatch.chdir(tmp_path)
    sets = ["trainer.max_steps=2", "trainer.generate_tokens=0", "trainer.val_check_interval=0", "optim.lr_warmup_iters=1",
            "resources.num_gpus_per_node=2", "parallel.pp=1"]
    assert cli.main(["train", "--recipe", "tiny", "--cpu", "--dryrun"] + [a for s in sets for a in ("--set", s)]) == 0
    cmd = capsys.readouterr().out.strip().splitlines()[-1]
    p = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=600, cwd=tmp_path, env=dict(os.environ))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "step 2/2 | loss" in p.stdout


@needs_mpi
def test_tiny_trains_on_the_two_ranks_given(tmp_path):
    # `--nproc-per-node 2` sizes the tiny recipe to 2 ranks (TP 2 × PP 1) instead of refusing its 4-rank TP 2 × PP 2.
    # (3 steps need a warmup shorter than the recipe's 5 steps.)
    cmd = [sys.executable, "-m", "megacore.cli", "train", "--recipe", "tiny", "--nproc-per-node", "2", "--cpu",
           "--set", "trainer.max_steps=3", "--set", "optim.lr_warmup_iters=1", "--set", "trainer.generate_tokens=0"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=dict(os.environ))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "world 2 = TP 2 x PP 1 (VP 1) x CP 1 x DP 1" in p.stdout and "micro-batch 4 x 128, 4 micro-batches" in p.stdout
    steps, _ = _metrics(str(tmp_path / "runs" / "tiny_pretrain" / "logs"))
    assert [s["step"] for s in steps] == [1, 2, 3] and steps[-1]["loss"] < steps[0]["loss"]
    assert (tmp_path / "runs" / "tiny_pretrain" / "checkpoints" / "step_3").is_dir()
