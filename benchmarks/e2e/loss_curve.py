"""megacore and Hugging Face transformers trained from the same initial weights on the same batches: the loss of
every step side by side, so the speed comparison of run_e2e.py is known to be for the same computation.

    python3 benchmarks/e2e/loss_curve.py --config llama1b --steps 100 --work /tmp/lc --out loss_curve.json   # GPU
    python3 benchmarks/e2e/loss_curve.py --config tiny --steps 20 --device cpu --work /tmp/lc                 # CPU

1. A LlamaForCausalLM of the config is created with a fixed seed and saved (f32 safetensors).
2. megacore imports it (megacore.convert.hf_to_megacore) and trains it with its own trainer (megacore.train.run:
   its data loader, optimizer, clipping) on the built-in corpus, one process, recording the loss of each step.
3. The HF model is trained in a second process on the very batches megacore's loader produced (the same dataset
   and DataLoader objects, built from the same recipe), with torch AdamW (f32 state, the same hyper-parameters,
   weight decay on the same parameters: not on 1-D ones), global-norm clipping 1.0, f32 weights and bf16 autocast
   on a GPU (megacore: bf16 weights with f32 master weights); f32 throughout on CPU.
The JSON holds both curves, the per-step relative difference and its maximum over the last 10 steps.

With --fp8 delayed|current the comparison is megacore's FP8 linears against megacore in bf16 (step 3 is skipped):
the same initial weights and batches, megacore trained twice (GPU only).

    python3 benchmarks/e2e/loss_curve.py --config llama1b --steps 300 --fp8 delayed --out loss_curve_fp8.json
"""

import argparse
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from e2e_common import CONFIGS, hf_llama_config  # noqa: E402

LC_CONFIGS = dict(CONFIGS)
LC_CONFIGS["tiny"] = dict(h=64, layers=2, heads=4, kv=2, ffn=128, vocab=512, seq=64, micro_batch=2, rope_theta=10000.0)
HP = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip=1.0)


def recipe(a, c):
    from megacore.convert import config_from_hf
    from megacore.recipes import tiny
    r = tiny.pretrain_recipe(num_gpus_per_node=1, dir=os.path.join(a.work, "mc_run"))
    with open(os.path.join(a.work, "hf", "config.json")) as f:
        m = config_from_hf(json.load(f))
    for k, v in m.items():
        if hasattr(r.model, k) and k not in ("rope_scaling", "params_dtype"):
            setattr(r.model, k, v)
    r.model.make_vocab_size_divisible_by = 1
    r.parallel.tensor_model_parallel_size = r.parallel.pipeline_model_parallel_size = 1
    r.data.paths = ["embedded"]
    r.data.tokenizer = "byte"
    r.data.seq_length = c["seq"]
    r.data.micro_batch_size = c["micro_batch"]
    r.data.global_batch_size = c["micro_batch"] * a.grad_accum
    r.data.cache_dir = os.path.join(a.work, "data")
    r.optim.lr = r.optim.min_lr = HP["lr"]
    r.optim.lr_warmup_iters = 0
    r.optim.lr_decay_style = "constant"
    r.optim.adam_beta1, r.optim.adam_beta2 = HP["betas"]
    r.optim.adam_eps, r.optim.weight_decay, r.optim.clip_grad = HP["eps"], HP["weight_decay"], HP["clip"]
    r.trainer.max_steps = a.steps
    r.trainer.val_check_interval = 0
    r.trainer.generate_tokens = 0
    r.trainer.device = a.device
    r.trainer.precision = "bf16" if a.device == "cuda" else "f32"
    if a.side == "megacore_fp8":
        r.trainer.fp8 = a.fp8
        for kv in a.fp8_set:  # section.field=value, e.g. trainer.fp8_amax_history_len=1
            key, val = kv.split("=", 1)
            sec, field = key.split(".", 1)
            cur = getattr(getattr(r, sec), field)
            setattr(getattr(r, sec), field, type(cur)(val) if not isinstance(cur, bool) else val == "true")
    r.checkpoint.pretrained_checkpoint = os.path.join(a.work, "mc_init")
    r.checkpoint.save_dir = ""
    r.checkpoint.save_last = False
    return r


def side_init(a, c):
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(hf_llama_config(c)).save_pretrained(os.path.join(a.work, "hf"), safe_serialization=True)
    from megacore.convert import hf_to_megacore
    hf_to_megacore(os.path.join(a.work, "hf"), os.path.join(a.work, "mc_init"))


def side_megacore(a, c):
    import megacore.train as mt
    losses = []
    mt.run(recipe(a, c), on_step=lambda m: losses.append(float(m["loss"])))
    return losses


class _World:
    rank, size = 0, 1

    def barrier(self):
        pass


def side_hf(a, c):
    import torch
    from megacore.data import DataLoader
    from megacore.train import build_data
    from transformers import LlamaForCausalLM
    r = recipe(a, c)
    train, _ = build_data(r, _World())
    loader = DataLoader(train, micro_batch_size=r.data.micro_batch_size, global_batch_size=r.data.global_batch_size)
    dev = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    model = LlamaForCausalLM.from_pretrained(os.path.join(a.work, "hf"), torch_dtype=torch.float32).to(dev).train()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() > 1 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": HP["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=HP["lr"], betas=HP["betas"], eps=HP["eps"])
    losses, it = [], iter(loader)
    for _ in range(a.steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        mbs = [next(it) for _ in range(a.grad_accum)]
        ntok = sum(float(b.loss_mask.numpy().sum()) for b in mbs)
        for b in mbs:
            ids = torch.from_numpy(b.tokens.numpy()).long().to(dev)
            labels = torch.from_numpy(b.labels.numpy()).long().to(dev)
            mask = torch.from_numpy(b.loss_mask.numpy()).float().to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits = model(input_ids=ids).logits
            ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
            loss = (ce * mask.flatten()).sum() / ntok
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), HP["clip"])
        opt.step()
        losses.append(total)
    return losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama1b", choices=sorted(LC_CONFIGS))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--work", default="/tmp/megacore_loss_curve")
    ap.add_argument("--fp8", default="none", choices=["none", "delayed", "current"],
                    help="compare megacore with FP8 linears against megacore in bf16 instead of against HF")
    ap.add_argument("--fp8-set", action="append", default=[],
                    help="section.field=value for the FP8 run only (e.g. trainer.fp8_amax_history_len=16)")
    ap.add_argument("--side", choices=["init", "megacore", "megacore_fp8", "hf"],
                    help="(internal) run one side in this process")
    ap.add_argument("--reuse", action="store_true",
                    help="keep --work's initial weights and megacore bf16 curve when they have --steps steps")
    ap.add_argument("--out")
    a = ap.parse_args()
    c = LC_CONFIGS[a.config]
    if a.side:
        fn = {"init": side_init, "megacore": side_megacore, "megacore_fp8": side_megacore, "hf": side_hf}[a.side]
        res = fn(a, c)
        if res is not None:
            with open(os.path.join(a.work, f"{a.side}.json"), "w") as f:
                json.dump(res, f)
        return
    os.makedirs(a.work, exist_ok=True)
    base = [sys.executable, os.path.abspath(__file__), "--config", a.config, "--steps", str(a.steps), "--grad-accum",
            str(a.grad_accum), "--device", a.device, "--work", a.work, "--fp8", a.fp8] + \
        [x for kv in a.fp8_set for x in ("--fp8-set", kv)]
    other = "megacore_fp8" if a.fp8 != "none" else "hf"
    for side in ("init", "megacore", other):  # separate processes: each side has the GPU to itself
        done = os.path.join(a.work, "megacore.json")
        if a.reuse and side in ("init", "megacore") and os.path.exists(done) and len(json.load(open(done))) == a.steps:
            continue  # the same weights and bf16 curve as the last run in --work
        subprocess.run(base + ["--side", side], check=True)
    mc = json.load(open(os.path.join(a.work, "megacore.json")))
    hf = json.load(open(os.path.join(a.work, f"{other}.json")))
    rel = [abs(m - h) / h for m, h in zip(mc, hf)]
    last = rel[-10:]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    doc = {"config": dict(name=a.config, **c), "device": a.device, "steps": a.steps, "grad_accum": a.grad_accum,
           "hyper_parameters": HP, "megacore": mc, other: hf, "rel_diff": rel,
           "max_rel_diff_last10": max(last), "mean_rel_diff_last10": sum(last) / len(last),
           "rel_diff_of_last10_means": abs(mean(mc[-10:]) - mean(hf[-10:])) / mean(hf[-10:]),
           "loss_first_last": {"megacore": [mc[0], mc[-1]], other: [hf[0], hf[-1]]}}
    if a.fp8 != "none":
        doc["fp8"] = a.fp8
        doc["fp8_sets"] = a.fp8_set
        doc["compared"] = "megacore trainer.fp8=" + a.fp8 + " (megacore_fp8) against megacore bf16 (megacore)"
    if a.device == "cuda":
        import torch
        doc["card"] = torch.cuda.get_device_name(0)
    for i in sorted(set([0, 1, 2, 4, 9] + list(range(19, a.steps, 20)) + [a.steps - 1])):
        if i < len(mc):
            print(f"step {i + 1:4d}  megacore {mc[i]:.4f}  {other} {hf[i]:.4f}  rel {rel[i]:.2e}")
    print(f"max relative difference over the last 10 steps: {doc['max_rel_diff_last10']:.3e}; of their means: "
          f"{doc['rel_diff_of_last10_means']:.3e}")
    assert all(math.isfinite(x) for x in mc + hf)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
