#!/usr/bin/env python3
"""GPU check: `megacore plan`'s predicted peak against the peak the caching allocator measures in training.

For each configuration it trains a few steps on the embedded corpus with `megacore train` (GPU ranks), reads the
largest `mem_peak_gib` of the run's metrics.jsonl (the allocator's peak of allocated bytes on the logging rank), and
computes the plan's total for the same recipe. It prints both and exits 1 when any prediction is off by more than
--tolerance (default 10 %) of the measured peak.

Configurations (seq × micro-batch as issue 24 measures them):
  ref1b   the reference Llama-1.1B (h2048, 16 layers, 32/8 heads, FFN 8192, vocab 32000, untied), 1 GPU, 4 × 2048
  llama8b the Llama-3-8B recipe's default layout for 4 GPUs (seq 8192, micro-batch 1; fitted for 80 GiB: TP 4 + SP)
  llama8b_card  the same recipe fitted for the memory of this host's first 4 GPUs, as `megacore train --recipe
          llama3_8b --nproc-per-node 4` builds it (on 4 × H200: TP 1 + ZeRO-1 over DP 4)
Add `--bf16-states` to run both with all optimizer state in bf16.

    /opt/torch/.venv/bin/python3 scripts/check_plan_memory.py --configs ref1b llama8b
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

CONFIGS = {
    "ref1b": dict(recipe="llama32_1b", gpus=1, sets=["model.vocab_size=32000", "model.tie_word_embeddings=false",
                                                      "data.seq_length=2048", "data.micro_batch_size=4",
                                                      "data.global_batch_size=8", "parallel.tp=1", "parallel.pp=1",
                                                      "parallel.zero=false"]),
    "llama8b": dict(recipe="llama3_8b", gpus=4, sets=["data.micro_batch_size=1", "data.global_batch_size=8"]),
    "llama8b_card": dict(recipe="llama3_8b", gpus=4, sets=["data.micro_batch_size=1", "data.global_batch_size=8"]),
}
BF16_STATES = ["optim.main_params_dtype=bf16", "optim.main_grads_dtype=bf16", "optim.exp_avg_dtype=bf16",
               "optim.exp_avg_sq_dtype=bf16"]


def run_one(name, bf16_states, steps, workdir):
    import megacore as mc
    from megacore import cli

    c = CONFIGS[name]
    sets = [f"resources.gpus={c['gpus']}", "data.paths=[\"embedded\"]", "data.tokenizer=byte",
            f"trainer.max_steps={steps}", "trainer.generate_tokens=0", "trainer.val_check_interval=0",
            "optim.lr_warmup_iters=0", "optim.lr_warmup_fraction=0", "optim.lr_decay_iters=0",
            "checkpoint.save_interval=0", f"logging.log_dir={workdir}/{name}/logs",
            f"checkpoint.save_dir={workdir}/{name}/ckpt"] + c["sets"] + (BF16_STATES if bf16_states else [])
    if name.startswith("llama8b"):  # the 4-GPU default of the recipe, not the 8-GPU one with resources.gpus overridden
        gib, source = cli.recipe_gpu_memory(nproc=4) if name == "llama8b_card" else (None, "")
        rec = mc.recipes.llama3_8b.pretrain_recipe(num_gpus_per_node=4, gpu_memory_gib=gib)
        print(f"{name}: {cli.recipe_layout(rec)}" + (f", fitted for {gib:.1f} GiB ({source})" if gib else ""))
        base = os.path.join(workdir, f"{name}.json")
        rec.to_json(base)
        rec = cli.load_recipe(None, base, sets)
    else:
        rec = cli.load_recipe(c["recipe"], None, sets)
    cfg = os.path.join(workdir, f"{name}_run.json")
    rec.to_json(cfg)
    p = rec.parallel
    o = rec.optim
    plan = cli.plan(rec.model.to_transformer_config("bf16", p.sequence_parallel, rec.trainer.recompute),
                    rec.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                    p.context_parallel_size, p.expert_model_parallel_size, p.virtual_pipeline_model_parallel_size,
                    rec.data.seq_length, rec.data.micro_batch_size, p.sequence_parallel, p.use_distributed_optimizer,
                    grad_reduce_in_bf16=p.grad_reduce_in_bf16, main_params_dtype=o.main_params_dtype,
                    main_grads_dtype=o.main_grads_dtype, exp_avg_dtype=o.exp_avg_dtype,
                    exp_avg_sq_dtype=o.exp_avg_sq_dtype)
    cmd = [sys.executable, "-m", "megacore.launch", "--nproc-per-node", str(c["gpus"]), "-m", "megacore.train",
           "--config", cfg]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-3000:])
        return name, plan["total_bytes"] / 2**30, None, plan
    rows = [json.loads(line) for line in open(os.path.join(rec.logging.log_dir, "metrics.jsonl"))]
    measured = max(row["mem_peak_gib"] for row in rows if "mem_peak_gib" in row)
    return name, plan["total_bytes"] / 2**30, measured, plan


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--bf16-states", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tolerance", type=float, default=0.10)
    a = ap.parse_args()
    bad = False
    with tempfile.TemporaryDirectory() as work:
        for name in a.configs:
            name, predicted, measured, plan = run_one(name, a.bf16_states, a.steps, work)
            parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan["memory_bytes"].items())
            if measured is None:
                print(f"{name}: predicted {predicted:.2f} GiB ({parts}); the run FAILED")
                bad = True
                continue
            err = (predicted - measured) / measured
            ok = abs(err) <= a.tolerance
            bad |= not ok
            print(f"{name}{' bf16 states' if a.bf16_states else ''}: predicted {predicted:.2f} GiB ({parts}), "
                  f"measured peak {measured:.2f} GiB: {100 * err:+.1f} % {'ok' if ok else 'BEYOND'} "
                  f"{100 * a.tolerance:.0f} %")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
