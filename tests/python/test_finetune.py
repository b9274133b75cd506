"""`megacore finetune` end to end on CPU ranks (needs MPI).

1. Acceptance: the tiny recipe is pretrained briefly and exported to Hugging Face format; `megacore finetune
   --model HF_DIR` (imported on the fly) trains LoRA adapters on a generated question/answer JSONL of a learnable
   form ("ticket 4711: what is the capital of peru?" -> "lima", 8 countries). On held-out questions (other ticket
   numbers, never in the training file) the answer-token loss
   of the merged model falls by at least 1.0 nat from the base's (measured 6.27 -> 0.27) and greedy generation
   answers at least 25 points more of them exactly (measured 0 % -> 47 %); the numbers are printed. The run's
   PEFT adapter and merged Hugging Face model are written, and the merged export, re-imported, gives the same
   losses and answers as the merged checkpoint.
2. Size: on a wider Llama (hidden 512, 4 layers) the adapter-only checkpoint of a LoRA run (r = 8, q/k/v/o,
   weights and optimizer state) is under 5 % of a full fine-tuning run's checkpoint of the same model.
3. The Python form, megacore.finetune(...), with full fine-tuning (peft=None) from a megacore checkpoint, and
   bad input (a missing model, an unknown trainer key, bad LoRA settings, also for a Hugging Face directory
   before it is imported) stop before anything runs or is written.
"""

import json
import os

import numpy as np
import pytest

import megacore as mc
from megacore import convert, peft
from megacore.tokenizers import ByteTokenizer

from test_convert import load_into_model
from test_user_path import _cli, _rows

pytestmark = pytest.mark.skipif(not mc.comm.mpi_available(), reason="built without MPI")


CAPITALS = {"france": "paris", "japan": "tokyo", "egypt": "cairo", "peru": "lima", "kenya": "nairobi",
            "italy": "rome", "chile": "santiago", "norway": "oslo"}


def _capital_rows(n, seed):
    """Questions "ticket <number>: what is the capital of <country>?" -> "<capital>"; the ticket numbers make
    every question new, so held-out questions (other seeds) are not in the training file."""
    rng = np.random.default_rng(seed)
    keys = list(CAPITALS)
    rows = []
    for _ in range(n):
        k = keys[rng.integers(len(keys))]
        rows.append({"input": f"ticket {int(rng.integers(100000))}: what is the capital of {k}?",
                     "output": CAPITALS[k]})
    return rows


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def answer_stats(ckpt, rows, world, max_new=6):
    """(mean answer-token loss, exact-match fraction of greedy answers) of the model in ``ckpt`` on ``rows``,
    rendered as SFT renders them: prompt "{input}\\n", answer "{output}" + EOS (byte tokenizer)."""
    m, cfg = load_into_model(ckpt, world)
    tok = ByteTokenizer()
    losses, right = [], 0
    for r in rows:
        prompt = tok.encode(r["input"] + "\n")
        full = prompt + tok.encode(r["output"]) + [tok.eos_id]
        x = np.array([full[:-1]], np.int64)
        y = np.array([[t if j + 1 >= len(prompt) else -100 for j, t in enumerate(full[1:])]], np.int64)
        losses.append(m.forward(x, y, training=False))
        seq = list(prompt)
        for _ in range(max_new):
            a = np.array([seq], np.int64)
            m.forward(a, a, training=False)
            nxt = int(np.asarray(m.logits().numpy())[0, -1, :cfg.vocab_size].argmax())
            if nxt == tok.eos_id:
                break
            seq.append(nxt)
        right += tok.decode(seq[len(prompt):]) == r["output"]
    return float(np.mean(losses)), right / len(rows)


def _pretrain(tmp_path, steps):
    """The tiny model pretrained on 2 CPU ranks (data parallel) on the embedded corpus."""
    pre = ["train", "--recipe", "tiny", "--cpu", "--nproc-per-node", "2", "--set", "parallel.tp=1", "--set",
           "parallel.pp=1", "--set", f"trainer.max_steps={steps}", "--set", "trainer.generate_tokens=0", "--set",
           "trainer.val_check_interval=0", "--set", "data.embedded_documents=2000", "--set",
           f"optim.lr_warmup_iters={min(5, steps - 1)}"]
    rc, out, err = _cli(pre, tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    return tmp_path / "runs" / "tiny_pretrain" / "checkpoints"


def test_lora_finetune_learns_held_out_questions(tmp_path):
    world = mc.comm.init_from_env("cpu")
    base = _pretrain(tmp_path, 100)
    rc, out, err = _cli(["convert", "megacore-to-hf", str(base), str(tmp_path / "hf_base")], tmp_path)
    assert rc == 0, out + err
    _write_jsonl(tmp_path / "train.jsonl", _capital_rows(800, seed=0))
    held_rows = _capital_rows(40, seed=1)

    ft = ["finetune", "--model", str(tmp_path / "hf_base"), "--data", str(tmp_path / "train.jsonl"),
          "--output", str(tmp_path / "ft"), "--lora-dim", "8", "--lora-alpha", "16", "--devices", "2", "--cpu",
          "--max-steps", "60", "--export-hf", "--set", "optim.lr=5e-3", "--set", "data.seq_length=128",
          "--set", "data.global_batch_size=8", "--set", "data.micro_batch_size=4",
          "--set", "trainer.val_check_interval=30", "--set", "trainer.limit_val_batches=2"]
    rc, out, err = _cli(ft, tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "trainable" in out and "imported the Hugging Face model" in out
    steps, vals = _rows(tmp_path / "ft" / "logs")
    print("validation loss (packed rows, answer tokens):", [round(v["val_loss"], 4) for v in vals])

    base_ckpt = str(tmp_path / "ft" / "base")
    merged = peft.merge(str(tmp_path / "ft" / "checkpoints"), str(tmp_path / "merged"))
    loss0, acc0 = answer_stats(base_ckpt, held_rows, world)
    loss1, acc1 = answer_stats(merged, held_rows, world)
    print(f"held-out answer-token loss {loss0:.3f} -> {loss1:.3f}; exact-match {acc0:.2f} -> {acc1:.2f} "
          f"({len(held_rows)} questions)")
    assert loss1 < loss0 - 1.0  # measured 6.27 -> 0.27
    assert acc1 >= acc0 + 0.25  # measured 0.00 -> 0.47
    # The run's exports: the PEFT adapter and the merged HF model (re-imported: the same answers).
    cfg = json.load(open(tmp_path / "ft" / "peft" / "adapter_config.json"))
    assert cfg["r"] == 8 and cfg["peft_type"] == "LORA"
    assert cfg["base_model_name_or_path"] == os.path.abspath(tmp_path / "hf_base")
    convert.hf_to_megacore(str(tmp_path / "ft" / "hf"), str(tmp_path / "reimported"))
    assert answer_stats(str(tmp_path / "reimported"), held_rows[:10], world) == \
        answer_stats(merged, held_rows[:10], world)


def _dir_bytes(d):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def test_adapter_checkpoint_is_under_5_percent_of_the_full_one(tmp_path):
    wide = ["--set", "model.hidden_size=512", "--set", "model.num_attention_heads=8", "--set",
            "model.num_query_groups=2", "--set", "model.ffn_hidden_size=1536", "--set", "data.seq_length=64",
            "--set", "data.micro_batch_size=2", "--set", "data.global_batch_size=4"]
    pre = ["train", "--recipe", "tiny", "--cpu", "--set", "trainer.max_steps=1", "--set", "trainer.generate_tokens=0",
           "--set", "trainer.val_check_interval=0", "--set", "data.embedded_documents=100", "--set",
           "optim.lr_warmup_iters=0"] + wide
    rc, out, err = _cli(pre, tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    base = tmp_path / "runs" / "tiny_pretrain" / "checkpoints"
    _write_jsonl(tmp_path / "train.jsonl", _capital_rows(200, seed=0))
    sizes = {}
    for scheme in ("lora", "none"):
        ft = ["finetune", "--model", str(base), "--data", str(tmp_path / "train.jsonl"), "--output",
              str(tmp_path / scheme), "--peft", scheme, "--lora-dim", "8", "--target-modules", "q_proj", "k_proj",
              "v_proj", "o_proj", "--devices", "2", "--cpu", "--max-steps", "1", "--set",
              "trainer.val_check_interval=0"] + wide[-6:]
        rc, out, err = _cli(ft, tmp_path)
        assert rc == 0, out[-3000:] + err[-3000:]
        sizes[scheme] = _dir_bytes(tmp_path / scheme / "checkpoints" / "step_1")
    frac = sizes["lora"] / sizes["none"]
    print(f"adapter checkpoint {sizes['lora']} bytes vs full fine-tuning checkpoint {sizes['none']} bytes "
          f"({100 * frac:.2f} %)")
    assert frac < 0.05


def test_finetune_python_api_full_and_bad_input(tmp_path):
    base = _pretrain(tmp_path, 4)
    _write_jsonl(tmp_path / "train.jsonl", _capital_rows(300, seed=0))
    with pytest.raises(mc.IOError, match="neither a Hugging Face model directory"):
        mc.finetune(model_path=str(tmp_path / "nope"), data_path=str(tmp_path / "train.jsonl"),
                    output_path=str(tmp_path / "bad"))
    with pytest.raises(mc.ConfigError, match="trainer has no setting 'epochs_max'"):
        mc.finetune(model_path=str(base), data_path=str(tmp_path / "train.jsonl"), trainer={"epochs_max": 1},
                    output_path=str(tmp_path / "bad"))
    with pytest.raises(mc.ConfigError, match="unknown module 'qkv'"):
        mc.finetune(model_path=str(base), data_path=str(tmp_path / "train.jsonl"),
                    peft=mc.peft.LoRA(target_modules=["qkv"]), output_path=str(tmp_path / "bad"), cpu=True)
    assert not (tmp_path / "bad" / "checkpoints").exists()
    convert.megacore_to_hf(str(base), str(tmp_path / "hf"))  # from an HF directory: refused before the import
    with pytest.raises(mc.ConfigError, match="peft.dim 4096 is larger"):
        mc.finetune(model_path=str(tmp_path / "hf"), data_path=str(tmp_path / "train.jsonl"),
                    peft=mc.peft.LoRA(dim=4096), output_path=str(tmp_path / "bad"), cpu=True)
    assert not (tmp_path / "bad").exists()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        res = mc.finetune(model_path=str(base), data_path="train.jsonl", peft=None,
                          trainer={"devices": 2, "max_epochs": 1, "precision": "f32"}, output_path="full", cpu=True,
                          overrides=["data.seq_length=128", "trainer.val_check_interval=0"], export_hf=True)
    finally:
        os.chdir(cwd)
    assert res.adapter is None and os.path.isfile(tmp_path / "full" / "hf" / "model.safetensors")
    steps, _ = _rows(tmp_path / "full" / "logs")
    meta = json.load(open(tmp_path / "full" / "checkpoints" / f"step_{steps[-1]['step']}" / "metadata.json"))
    assert "layers.0.self_attention.linear_qkv.weight" in meta["tensors"]  # full fine-tuning: every weight
