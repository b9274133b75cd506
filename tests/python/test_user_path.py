"""The user's path from the command line, as docs/getting-started.md gives it: pretrain the tiny model, fine-tune
it on a JSONL file from that checkpoint into a run directory of its own, resume the fine-tuning run exactly,
and the hand-off errors a user meets on the way (CPU ranks)."""

import json
import os
import re
import subprocess
import sys

import pytest

import megacore as mc
from megacore import recipes
from megacore.data.sft import split_counts

needs_mpi = pytest.mark.skipif(not mc.comm.mpi_available(), reason="built without MPI")


def _cli(args, cwd, timeout=600):
    p = subprocess.run([sys.executable, "-m", "megacore.cli", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ))
    return p.returncode, p.stdout, p.stderr


def _rows(log_dir):
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def _qa_jsonl(path, n, start=0):
    with open(path, "w") as f:
        for i in range(start, start + n):
            x, y = i % 9 + 1, (i * 7) % 9 + 1
            f.write(json.dumps({"input": f"what is {x} plus {y}?", "output": f"{x + y}"}) + "\n")


@needs_mpi
def test_pretrain_then_finetune_from_the_cli_into_a_new_run_dir(tmp_path):
    pre = ["train", "--recipe", "tiny", "--cpu", "--set", "trainer.max_steps=12", "--set", "trainer.generate_tokens=0",
           "--set", "trainer.val_check_interval=0", "--set", "data.embedded_documents=400"]
    rc, out, err = _cli(pre, tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    base = tmp_path / "runs" / "tiny_pretrain" / "checkpoints"
    assert (base / "step_12" / "metadata.json").is_file()
    base_files = sorted(p.name for p in base.iterdir())

    sft = tmp_path / "qa.jsonl"
    _qa_jsonl(sft, 600)
    ft = ["train", "--recipe", "tiny_finetune", "--cpu", "--set", f"data.sft_path={sft}",
          "--set", f"checkpoint.pretrained_checkpoint={base}", "--set", "trainer.limit_val_batches=1",
          "--set", "data.global_batch_size=8", "--set", "data.micro_batch_size=2"]
    rc, out, err = _cli(ft + ["--set", "trainer.max_steps=8", "--set", "trainer.val_check_interval=4"], tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    assert f"weights from {base}" in out
    run = tmp_path / "runs" / "tiny_finetune"
    steps, vals = _rows(run / "logs")
    # Weights only: the fine-tuning run starts at step 1 with its own schedule and data (5 % of 8 steps rounds to
    # no warmup: the first step runs at the fine-tuning peak lr, 1e-3, then cosine decay).
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert steps[0]["lr"] == 1e-3 and steps[-1]["lr"] < steps[0]["lr"]
    assert [v["step"] for v in vals] == [4, 8]
    assert (run / "checkpoints" / "step_8" / "metadata.json").is_file()
    # The base run is untouched: nothing written into its checkpoint root.
    assert sorted(p.name for p in base.iterdir()) == base_files
    # The first loss is that of the pretrained weights (12 steps: about 4.5 on these answers), below the ~5.5 of a
    # freshly initialised model (near-uniform over 259 ids, ln 259 = 5.56).
    assert steps[0]["loss"] < 5.0, steps[0]

    # Resuming the fine-tuning run itself continues from its own checkpoint (not from the base weights again).
    rc, out, err = _cli(ft + ["--set", "trainer.max_steps=10", "--set", "trainer.val_check_interval=5"], tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "resumed at step 8" in out and "weights from" not in out


@needs_mpi
def test_a_bf16_run_starts_from_f32_pretrained_weights(tmp_path):
    """Weights-only starts convert the stored precision (an f32 pretraining run or Hugging Face import into bf16
    parameters); a resume stays exact and is not converted."""
    pre = ["train", "--recipe", "tiny", "--cpu", "--set", "trainer.max_steps=4", "--set", "trainer.generate_tokens=0",
           "--set", "trainer.val_check_interval=0", "--set", "data.embedded_documents=200",
           "--set", "trainer.precision=f32", "--set", "optim.lr_warmup_iters=0"]
    rc, out, err = _cli(pre, tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    base = tmp_path / "runs" / "tiny_pretrain" / "checkpoints"
    meta = json.loads((base / "step_4" / "metadata.json").read_text())
    assert "f32" in json.dumps(meta).lower()
    ft = ["train", "--recipe", "tiny", "--cpu", "--set", "trainer.max_steps=3", "--set", "trainer.generate_tokens=0",
          "--set", "trainer.val_check_interval=0", "--set", "data.embedded_documents=200",
          "--set", "trainer.precision=bf16", "--set", "optim.lr_warmup_iters=0",
          "--set", f"checkpoint.pretrained_checkpoint={base}",
          "--set", f"checkpoint.save_dir={tmp_path / 'bf16_run'}", "--set", f"logging.log_dir={tmp_path / 'bf16_logs'}"]
    rc, out, err = _cli(ft, tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    assert f"weights from {base}" in out
    steps, _ = _rows(tmp_path / "bf16_logs")
    # the pretrained weights, not a fresh init (ln 259 = 5.56 for a fresh model)
    assert steps[0]["loss"] < 5.3, steps[0]


@needs_mpi
def test_finetune_recipe_needs_its_data_and_base_named_before_launch(tmp_path):
    rc, out, err = _cli(["train", "--recipe", "tiny_finetune", "--cpu"], tmp_path)
    assert rc == 1
    assert "data.sft_path" in err and "Traceback" not in err
    rc, out, err = _cli(["train", "--recipe", "tiny_finetune", "--cpu", "--set", f"data.sft_path={tmp_path}/none.jsonl",
                         "--set", f"checkpoint.pretrained_checkpoint={tmp_path}/nope"], tmp_path)
    assert rc == 1
    assert "data.sft_path: '" in err and "checkpoint.pretrained_checkpoint: '" in err and "does not exist" in err
    assert not (tmp_path / "runs").exists()  # nothing written


def test_recipe_name_moves_the_run_directory_it_derived():
    r = recipes.get("tiny_finetune")
    assert r.checkpoint.save_dir == "runs/tiny_finetune/checkpoints"
    r.set("name", "my_sft")
    assert (r.name, r.checkpoint.save_dir, r.logging.log_dir) == ("my_sft", "runs/my_sft/checkpoints", "runs/my_sft/logs")
    r.set("checkpoint.save_dir", "/data/ck")
    r.set("name", "other")  # an explicit directory stays where the user put it
    assert r.checkpoint.save_dir == "/data/ck"


def test_finetune_warmup_follows_max_steps():
    r = recipes.get("tiny_finetune", sft_path="x.jsonl")
    for steps in (20, 400):
        r.trainer.max_steps = steps
        assert r.optim.lr_warmup_fraction == 0.05 and r.optim.lr_warmup_iters == 0
        r.validate(check_paths=False)  # a warmup fixed at build time used to break a shorter max_steps


def test_sft_split_counts():
    assert split_counts(100, "90,10,0") == [90, 10, 0]
    assert split_counts(10, "969,30,1") == [8, 1, 1]  # requested parts get at least one example
    assert sum(split_counts(1234, "969,30,1")) == 1234
    with pytest.raises(mc.ValueError, match="data.split"):
        split_counts(10, "a,b")


@needs_mpi
def test_logs_after_a_resume_hold_every_step_once_and_saves_record_val_loss(tmp_path):
    common = ["train", "--recipe", "tiny", "--cpu", "--set", "trainer.generate_tokens=0",
              "--set", "data.embedded_documents=400", "--set", "trainer.val_check_interval=2",
              "--set", "trainer.limit_val_batches=1", "--set", "checkpoint.save_interval=2",
              "--set", "checkpoint.keep_last=3", "--set", "checkpoint.keep_top_k=1", "--set", "trainer.max_steps=6"]
    rc, out, err = _cli(common, tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    # Output to a pipe has no progress bar: the launcher says its stdout is not a terminal (the ranks under
    # mpirun see a pty either way).
    assert "step 6/6 | loss" in out and not re.search(r"\[[#.]{20}\]", out)
    ck = tmp_path / "runs" / "tiny_pretrain" / "checkpoints"
    for s in (2, 4, 6):  # keep_top_k ranks by the validation loss each save records
        meta = json.load(open(ck / f"step_{s}" / "metadata.json"))
        assert isinstance(meta.get("val_loss"), float), meta.get("val_loss")
    # A rerun from step_4 (as after a failure past it) replaces the rows of steps 5 and 6 instead of repeating them.
    rc, out, err = _cli(common + ["--set", f"checkpoint.resume={ck / 'step_4'}"], tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "resumed at step 4" in out
    steps, vals = _rows(tmp_path / "runs" / "tiny_pretrain" / "logs")
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert [v["step"] for v in vals] == [2, 4, 6]


@needs_mpi
def test_sft_longer_than_its_data_makes_more_passes(tmp_path):
    sft = tmp_path / "qa.jsonl"
    _qa_jsonl(sft, 120)  # about 20 packed rows: 2 steps of 8 per pass
    args = ["train", "--recipe", "tiny_finetune", "--cpu", "--set", f"data.sft_path={sft}",
            "--set", "trainer.val_check_interval=0", "--set", "data.global_batch_size=8",
            "--set", "data.micro_batch_size=2", "--set", "trainer.max_steps=5"]
    rc, out, err = _cli(args, tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "passes, each reshuffled" in out
    steps, _ = _rows(tmp_path / "runs" / "tiny_finetune" / "logs")
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    # Whole passes by trainer.max_epochs: the length follows the data.
    rc, out, err = _cli(args[:-2] + ["--set", "trainer.max_epochs=2", "--set", "name=two_passes"], tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "2 epoch(s) of" in out
