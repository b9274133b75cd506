"""The user's path from the command line, as docs/getting-started.md gives it: pretrain the tiny model, fine-tune
it on a JSONL file from that checkpoint into a run directory of its own, resume the fine-tuning run exactly,
and the hand-off errors a user meets on the way (CPU ranks); and the whole path on one rank — a CPU rank here, one
GPU where there is one — through LoRA and the Hugging Face exports, whose logits in transformers equal megacore's."""

import json
import os
import re
import subprocess
import sys

import numpy as np
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


def _user_path_on_one_rank(tmp_path, device_args, check_hf):
    """getting-started's path from the CLI on one rank (``device_args``: [] for one GPU, ["--cpu"] for a CPU rank):
    pretrain, resume, SFT from it, LoRA fine-tune with --export-hf, convert to Hugging Face; ``check_hf(hf_dir,
    tokens, megacore_logits)`` compares an export in transformers."""
    one = ["--nproc-per-node", "1", *device_args]
    quiet = ["--set", "trainer.generate_tokens=0", "--set", "data.embedded_documents=400"]
    pre = ["train", "--recipe", "tiny", *one, *quiet, "--set", "trainer.val_check_interval=10"]
    rc, out, err = _cli(pre + ["--set", "trainer.max_steps=20"], tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    base = tmp_path / "runs" / "tiny_pretrain" / "checkpoints"
    steps, vals = _rows(tmp_path / "runs" / "tiny_pretrain" / "logs")
    assert [s["step"] for s in steps] == list(range(1, 21)) and [v["step"] for v in vals] == [10, 20]
    assert steps[-1]["loss"] < 0.5 * steps[0]["loss"], (steps[0], steps[-1])
    rc, out, err = _cli(pre + ["--set", "trainer.max_steps=24"], tmp_path)  # the same command, longer: resumes
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "resumed at step 20" in out and (base / "step_24" / "metadata.json").is_file()

    sft = tmp_path / "qa.jsonl"
    _qa_jsonl(sft, 800)
    ft = ["train", "--recipe", "tiny_finetune", *one, "--set", f"data.sft_path={sft}",
          "--set", f"checkpoint.pretrained_checkpoint={base}", "--set", "trainer.max_steps=6",
          "--set", "data.global_batch_size=8", "--set", "data.micro_batch_size=2",
          "--set", "trainer.val_check_interval=3", "--set", "trainer.limit_val_batches=1"]
    rc, out, err = _cli(ft, tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    assert f"weights from {base}" in out
    steps, _ = _rows(tmp_path / "runs" / "tiny_finetune" / "logs")
    assert [s["step"] for s in steps] == list(range(1, 7)) and steps[0]["loss"] < 5.0  # pretrained, not fresh

    lora = ["finetune", "--model", str(base), "--data", str(sft), "--output", str(tmp_path / "qa_lora"),
            "--lora-dim", "8", "--lora-alpha", "16", "--devices", "1", *device_args, "--max-steps", "4",
            "--set", "data.seq_length=128", "--set", "data.global_batch_size=8", "--set", "trainer.val_check_interval=0",
            "--export-hf"]
    rc, out, err = _cli(lora, tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    for f in ("peft/adapter_config.json", "peft/adapter_model.safetensors", "hf/config.json", "hf/model.safetensors"):
        assert (tmp_path / "qa_lora" / f).is_file(), f

    hf = tmp_path / "hf_tiny"
    rc, out, err = _cli(["convert", "megacore-to-hf", str(tmp_path / "runs" / "tiny_finetune" / "checkpoints"), str(hf)],
                        tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    # megacore's logits of the exported weights (imported back, in the export's dtype, then widened to an f32 model
    # on a CPU rank) against transformers'
    back = tmp_path / "back"
    rc, out, err = _cli(["convert", "hf-to-megacore", str(hf), str(back)], tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    from megacore import checkpoint as ck
    from megacore import convert, model

    world = mc.comm.init_from_env("cpu")
    c = convert.config_from_checkpoint(str(back))
    stored = model.GPTModel(convert.transformer_config(c), world)
    vocab = c["vocab_size"]
    ck.load(None, str(back), [(name, data, [vocab, *data.shape[1:]] if name in ("embedding.weight", "output_layer.weight")
                               else list(data.shape), [0] * len(data.shape))
                              for name, (data, _) in stored.parameters().items()])
    c["params_dtype"] = "f32"
    m = model.GPTModel(convert.transformer_config(c), world)
    weights = stored.parameters()
    for name, (data, _) in m.parameters().items():
        data.copy_(weights[name][0])
    tokens = np.array([list(b"what is 3 plus 4?")], dtype=np.int64)
    m.forward(tokens, tokens, training=False)
    check_hf(hf, tokens, np.asarray(m.logits().numpy())[..., :vocab].astype(np.float64))
    check_hf(tmp_path / "qa_lora" / "hf", tokens, None)


@needs_mpi
def test_the_user_path_from_the_cli_on_one_cpu_rank(tmp_path):
    """The same path on one CPU rank (`--nproc-per-node 1 --cpu`); the logits check runs where transformers is
    installed, else the exports' config.json must name LlamaForCausalLM."""
    try:
        import torch
        import transformers
    except ImportError:
        torch = transformers = None

    def check_hf(path, tokens, want):
        if transformers is None:
            assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
            return
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).float().eval()
        with torch.no_grad():
            got = hf(torch.from_numpy(tokens)).logits.double().numpy()
        assert np.isfinite(got).all()
        if want is not None:
            assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()

    _user_path_on_one_rank(tmp_path, ["--cpu"], check_hf)


@pytest.mark.gpu
def test_the_user_path_from_the_cli_on_one_gpu(tmp_path):
    """Pretrain (20 steps, the loss halves), resume, SFT from it, LoRA with --export-hf and convert, all on one GPU
    from the CLI (the tiny recipe's TP 2 x PP 2 sized to one GPU by --nproc-per-node 1); transformers loads both
    exports on the GPU, and the fine-tuned model's logits (f32) equal megacore's of the same weights to 1e-4 of
    their largest magnitude."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    def check_hf(path, tokens, want):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).float().cuda().eval()
        with torch.no_grad():
            got = hf(torch.from_numpy(tokens).cuda()).logits.double().cpu().numpy()
        assert np.isfinite(got).all()
        if want is not None:
            assert got.shape == want.shape
            assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()

    _user_path_on_one_rank(tmp_path, [], check_hf)
