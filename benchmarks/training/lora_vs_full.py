"""LoRA vs full fine-tuning of a 1B-class Llama on one GPU with megacore, and the PEFT round trip on it.

1. transformers writes a randomly initialised LlamaForCausalLM (hidden 2048, 16 layers, 32 heads, 8 KV heads,
   FFN 8192, vocab 32000, untied; bf16 safetensors) into WORK/hf.
2. megacore.finetune fine-tunes it from that directory (imported on the fly) on a generated JSONL
   ({"input", "output"} rows, packed into 2048-token rows, byte tokenizer ids) twice, bf16, micro-batch
   --micro-batch x 2048, the same steps each: LoRA (r = 32, alpha = 32, q/k/v/o_proj) and full SFT (AdamW, f32
   master weights and grads). Per run: peak allocated GPU memory (megacore's allocator statistics, the trainer's
   mem_peak_gib), median tokens/s and step time over the steps after --warmup.
3. PEFT check (LoRA run): its adapter is exported in Hugging Face PEFT format; transformers loads the HF model
   in f32, peft.PeftModel.from_pretrained adds the adapter, and the logits are compared with megacore's merged
   model (merged in f32 by megacore.peft.merge, loaded into a megacore GPTModel in f32 on the GPU) on random
   tokens. Reported: max |diff| / max |logit|, and the same for the adapter's own effect (peft minus plain HF),
   so the comparison is seen to be sensitive to the adapter.

4. Fused vs unfused LoRA (--part fused runs only this): LoRA r = 16, alpha = 32, dropout 0 on q/k/v/o/gate/up/down
   twice in the same process, the same steps each: the fused path (base GEMM and x·Aᵀ in one product over the
   activations, layers/lora.hpp) and MEGACORE_LORA_FUSED=0 (the low-rank path as its own GEMMs). Median tokens/s
   and step time of each, and their ratio.

Writes benchmarks/results/lora_vs_full_<card>.json, or with --part fused lora_fused_vs_unfused_<card>.json (card
from torch.cuda.get_device_name).

    PYTHONPATH=.gpu-build/python /opt/torch/.venv/bin/python3 benchmarks/training/lora_vs_full.py --work /tmp/lora_bench
    PYTHONPATH=.gpu-build/python /opt/torch/.venv/bin/python3 benchmarks/training/lora_vs_full.py --part fused
    PYTHONPATH=build/python python3 benchmarks/training/lora_vs_full.py --smoke --out /tmp/smoke.json  # the script on CPU
"""

import argparse
import json
import os
import statistics
import sys
import time


# The 1B shape, and a small one for checking the script itself on CPU (--smoke).
SHAPES = {"1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=32000),
          "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512)}


def write_hf_model(path, shape, seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def write_data(path, words_per_part, rows=4000, seed=0):
    import random

    rnd = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "green", "seven", "market", "north"]
    with open(path, "w") as f:
        for i in range(rows):
            q = " ".join(rnd.choice(words) for _ in range(rnd.randint(*words_per_part)))
            a = " ".join(rnd.choice(words) for _ in range(rnd.randint(*words_per_part)))
            f.write(json.dumps({"input": f"question {i}: {q}?", "output": a}) + "\n")


def run(mc, name, hf_dir, data, work, lora, steps, mb, save, seq, cpu):
    import shutil

    out = os.path.join(work, name)
    for sub in ("checkpoints", "logs"):  # a fresh run each time (the imported base in out/base is kept)
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    t0 = time.time()
    mc.finetune(model_path=hf_dir, data_path=data, peft=lora, output_path=out, cpu=cpu,
                trainer={"devices": 1, "max_steps": steps, "precision": "bf16"},
                overrides=[f"data.seq_length={seq}", "optim.lr_warmup_iters=0", f"data.micro_batch_size={mb}", f"data.global_batch_size={mb}",
                           "trainer.val_check_interval=0", "checkpoint.save_interval=0",
                           f"checkpoint.save_last={'true' if save else 'false'}",
                           "optim.lr=1e-3" if lora else "optim.lr=1e-5"])
    rows = [json.loads(line) for line in open(os.path.join(out, "logs", "metrics.jsonl"))]
    return [r for r in rows if "loss" in r], time.time() - t0


def summarise(rows, warmup, mb, seq):
    timed = [r for r in rows if r["step"] > warmup]
    return {"steps_timed": len(timed), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "step_seconds": statistics.median(r["step_seconds"] for r in timed),
            "peak_mem_gib": max(r["mem_peak_gib"] for r in rows), "tokens_per_step": mb * seq,
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}


def fused_vs_unfused(mc, hf_dir, data, work, steps, warmup, mb, seq, cpu):
    """LoRA r = 16 on all seven projections, fused and unfused (MEGACORE_LORA_FUSED=0), the same steps each."""
    lora = mc.peft.LoRA(dim=16, alpha=32, dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    out = {"lora_settings": {"r": 16, "alpha": 32, "dropout": 0.0, "targets": lora.target_modules}}
    for name, flag in (("fused", "1"), ("unfused", "0")):
        os.environ["MEGACORE_LORA_FUSED"] = flag  # read when the adapters are attached
        try:
            rows, wall = run(mc, f"lora_{name}", hf_dir, data, work, lora, steps, mb, False, seq, cpu)
        finally:
            os.environ.pop("MEGACORE_LORA_FUSED", None)
        out[name] = dict(summarise(rows, warmup, mb, seq), wall_seconds=wall)
        print(f"lora {name}: {out[name]}", flush=True)
    out["tokens_per_s_fused_over_unfused"] = out["fused"]["tokens_per_s"] / out["unfused"]["tokens_per_s"]
    print(f"fused / unfused tokens/s: {out['tokens_per_s_fused_over_unfused']:.3f}", flush=True)
    return out


def peft_check(mc, hf_dir, lora_ckpt, work, device):
    """(max |megacore merged − peft| / max |logit|, max |peft − plain HF| / max |logit|) in f32."""
    import numpy as np
    import peft as peft_lib
    import torch
    from transformers import LlamaForCausalLM

    from megacore import checkpoint as ck
    from megacore import convert, model

    adapter_dir = mc.peft.export_peft(lora_ckpt, os.path.join(work, "peft_check"), base_model_name_or_path=hf_dir)
    merged = mc.peft.merge(lora_ckpt, os.path.join(work, "merged_f32"), dtype="f32")
    cfg = convert.transformer_config(convert.config_from_checkpoint(merged))
    V = cfg.vocab_size
    tokens = np.random.default_rng(0).integers(0, V, size=(1, 128)).astype(np.int64)
    world = mc.comm.init_from_env("cpu")
    # The f32 merged model runs on the host: megacore's GPU attention kernels take bf16/f16 only.
    m = model.GPTModel(cfg, world, device="cpu")
    targets = [(n, d, [cfg.vocab_size] + list(d.shape[1:]) if n in ("embedding.weight", "output_layer.weight")
                else list(d.shape), [0] * len(d.shape)) for n, (d, _) in m.parameters().items()]
    ck.load(None, merged, targets)
    m.forward(tokens, tokens, training=False)
    got = np.asarray(m.logits().to("cpu").numpy())[..., :V].astype(np.float64)
    del m

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        t = torch.from_numpy(tokens).to(device)
        plain = hf(t).logits.double().cpu().numpy()
        pm = peft_lib.PeftModel.from_pretrained(hf, adapter_dir).eval()
        want = pm(t).logits.double().cpu().numpy()
    scale = np.abs(want).max()
    return float(np.abs(got - want).max() / scale), float(np.abs(want - plain).max() / scale)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/megacore_lora_bench", help="scratch directory (HF model, data, runs)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--out", default=None, help="default benchmarks/results/lora_vs_full_<card>.json")
    ap.add_argument("--part", choices=("all", "fused"), default="all",
                    help="fused: only the fused vs unfused LoRA comparison (item 4 above)")
    ap.add_argument("--smoke", action="store_true",
                    help="check the script on CPU ranks with a small model (seq 128; needs --out)")
    a = ap.parse_args()
    if a.smoke and not a.out:
        ap.error("--smoke needs --out (its numbers are no benchmark result)")

    import torch

    import megacore as mc

    card = "cpu" if a.smoke else torch.cuda.get_device_name(0)
    seq = 128 if a.smoke else 2048
    os.makedirs(a.work, exist_ok=True)
    hf_dir, data = os.path.join(a.work, "hf"), os.path.join(a.work, "train.jsonl")
    write_hf_model(hf_dir, "smoke" if a.smoke else "1b")
    write_data(data, (3, 6) if a.smoke else (20, 60))  # rows of at most ~100 / ~750 bytes
    model_info = dict(SHAPES["smoke" if a.smoke else "1b"], init="random, written by transformers")
    if a.part == "fused":
        res = {"card": card, "model": model_info, "precision": "bf16", "seq_length": seq, "micro_batch": a.micro_batch,
               "steps": a.steps, "warmup_steps_excluded": a.warmup,
               "fused_vs_unfused": fused_vs_unfused(mc, hf_dir, data, a.work, a.steps, a.warmup, a.micro_batch, seq,
                                                    a.smoke)}
        out = a.out or os.path.join(os.path.dirname(__file__), "..", "results",
                                    f"lora_fused_vs_unfused_{card.replace(' ', '_')}.json")
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {out}")
        return 0
    lora = mc.peft.LoRA(dim=32, alpha=32, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    res = {"card": card, "model": dict(SHAPES["smoke" if a.smoke else "1b"], init="random, written by transformers"),
           "precision": "bf16", "seq_length": seq, "micro_batch": a.micro_batch,
           "steps": a.steps, "warmup_steps_excluded": a.warmup, "lora_settings": {"r": 32, "alpha": 32, "targets":
                                                                        lora.target_modules}}
    for name, p, save in (("lora", lora, True), ("full", None, False)):
        rows, wall = run(mc, name, hf_dir, data, a.work, p, a.steps, a.micro_batch, save, seq, a.smoke)
        res[name] = dict(summarise(rows, a.warmup, a.micro_batch, seq), wall_seconds=wall)
        print(f"{name}: {res[name]}", flush=True)
    res["memory_factor_full_over_lora"] = res["full"]["peak_mem_gib"] / res["lora"]["peak_mem_gib"]
    res["tokens_per_s_lora_over_full"] = res["lora"]["tokens_per_s"] / res["full"]["tokens_per_s"]
    res["fused_vs_unfused"] = fused_vs_unfused(mc, hf_dir, data, a.work, a.steps, a.warmup, a.micro_batch, seq,
                                               a.smoke)
    err, effect = peft_check(mc, hf_dir, os.path.join(a.work, "lora", "checkpoints"), a.work,
                             "cpu" if a.smoke else "cuda")
    res["peft_check"] = {"max_abs_diff_over_max_logit": err, "adapter_effect_over_max_logit": effect,
                         "dtype": "f32 (megacore merged in f32; transformers + peft in f32, TF32 off)"}
    print(f"peft check: megacore merged vs peft {err:.3g} of the largest logit; the adapter's effect {effect:.3g}")
    out = a.out or os.path.join(os.path.dirname(__file__), "..", "results",
                                f"lora_vs_full_{card.replace(' ', '_')}.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {out}")
    ok = err <= 1e-3 and effect > 10 * err
    print("PEFT check " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
