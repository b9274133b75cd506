"""One-GPU packed-SFT run of the tiny recipe (TP = PP = 1, f32 and bf16, 6 steps) on the device: the trainer's
packed path on CUDA (cuDNN ragged attention through the model, device-side position ids). Prints the losses;
run the same recipe on CPU ranks to compare (tests/python/test_train.py's SFT data)."""
import json
import os
import subprocess
import sys
import tempfile

from megacore import recipes

tmp = tempfile.mkdtemp()
rows = [{"input": f"what is {i % 17} plus {(i * 7) % 13}?", "output": f"{i % 17} plus {(i * 7) % 13} is {i % 17 + (i * 7) % 13}."}
        for i in range(400)]
sft = os.path.join(tmp, "sft.jsonl")
open(sft, "w").write("\n".join(json.dumps(r) for r in rows) + "\n")
for precision in ("f32", "bf16"):
    r = recipes.tiny.pretrain_recipe(num_gpus_per_node=1, dir=os.path.join(tmp, precision))
    for k, v in {"parallel.tp": 1, "parallel.pp": 1, "trainer.max_steps": 6, "trainer.generate_tokens": 0,
                 "trainer.val_check_interval": 0, "data.sft_path": sft, "data.paths": [], "trainer.precision": precision,
                 "data.cache_dir": os.path.join(tmp, "data")}.items():
        r.set(k, v)
    cfg = os.path.join(tmp, f"{precision}.json")
    r.to_json(cfg)
    p = subprocess.run([sys.executable, "-m", "megacore.launch", "--nproc-per-node", "1", "-m", "megacore.train",
                        "--config", cfg], capture_output=True, text=True, timeout=240)
    print(precision, "rc", p.returncode)
    print("\n".join(l for l in (p.stdout + p.stderr).splitlines() if "attention" in l or "error" in l.lower())[-2000:])
    rows = [json.loads(l) for l in open(os.path.join(r.logging.log_dir, "metrics.jsonl"))] if p.returncode == 0 else []
    print(precision, "losses", [round(x["loss"], 4) for x in rows if "loss" in x])
