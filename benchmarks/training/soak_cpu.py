"""Soak test on CPU ranks: a long run of the tiny recipe (2 ranks, TP 2, 4 sequences of 128 tokens per
step; validation and checkpoints every 500 steps) while every rank samples its own resident set size (VmRSS)
after each 50th step. Host memory that grows with the step count is a leak: the summary gives each rank's RSS
at steps 100, 1000 and the last, and the growth between them.

    PYTHONPATH=build/python python3 benchmarks/training/soak_cpu.py --steps 2000 \
        --out benchmarks/results/soak_cpu_2000_steps.json
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

SAMPLE_EVERY = 50


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def as_rank(cfg: str, out_dir: str) -> int:
    """One rank of the soak: megacore.train's own entry plus an RSS sample every SAMPLE_EVERY steps."""
    from megacore import train

    samples, world = {}, []

    def on_step(m):
        if m["step"] == 1 or m["step"] % SAMPLE_EVERY == 0:
            samples[m["step"]] = rss_mib()

    def body(on_world):
        def keep(w):
            world.append(w)
            on_world(w)
        train.run(train._load(cfg, []), on_step=on_step, on_world=keep)
        with open(os.path.join(out_dir, f"rss.rank{world[0].rank}.json"), "w") as f:
            json.dump(samples, f)

    return train.guarded(body)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=4, help="sequences per step (the recipe's micro-batch of 4: "
                    "one micro-batch per step keeps 2,000 steps within minutes on 2 cores)")
    ap.add_argument("--out", default="")
    ap.add_argument("--as-rank", nargs=2, metavar=("CONFIG", "OUT_DIR"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.as_rank:
        return as_rank(*a.as_rank)

    from megacore import recipes

    work = tempfile.mkdtemp(prefix="megacore-soak-")
    r = recipes.tiny.pretrain_recipe(dir=os.path.join(work, "run"))
    r.resources.num_gpus_per_node = a.ranks
    r.parallel.tensor_model_parallel_size = a.ranks
    r.parallel.pipeline_model_parallel_size = 1
    r.trainer.max_steps = a.steps
    r.data.global_batch_size = a.global_batch
    r.trainer.generate_tokens = 0
    r.trainer.val_check_interval = 500
    r.trainer.log_interval = SAMPLE_EVERY
    r.checkpoint.save_interval = 500
    r.data.cache_dir = os.path.join(work, "data")
    cfg = os.path.join(work, "soak.json")
    r.to_json(cfg)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "megacore.launch", "--nproc-per-node", str(a.ranks), "--cpu",
                        os.path.abspath(__file__), "--as-rank", cfg, work], capture_output=True, text=True)
    took = time.monotonic() - t0
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        return p.returncode
    ranks = []
    for k in range(a.ranks):
        with open(os.path.join(work, f"rss.rank{k}.json")) as f:
            s = {int(step): v for step, v in json.load(f).items()}
        at = {step: round(s[step], 1) for step in (100, 1000, a.steps) if step in s}
        ranks.append({"rank": k, "rss_mib_by_step": {str(step): round(v, 1) for step, v in sorted(s.items())},
                      "rss_mib_at": {str(step): v for step, v in at.items()},
                      "growth_mib_100_to_last": round(s[a.steps] - s[100], 1) if 100 in s and a.steps in s else None,
                      "growth_mib_1000_to_last": round(s[a.steps] - s[1000], 1) if 1000 in s and a.steps in s else None})
    result = {
        "benchmark": "soak_cpu",
        "what": f"tiny recipe, {a.steps} steps of {a.global_batch} x 128 tokens on {a.ranks} CPU ranks (TP {a.ranks}), "
                "validation and a checkpoint every 500 steps; VmRSS of each rank after every 50th step",
        "steps": a.steps, "ranks": a.ranks, "global_batch": a.global_batch, "seconds": round(took, 1),
        "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                 "python": platform.python_version()},
        "per_rank": ranks,
    }
    text = json.dumps(result, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    for rk in ranks:
        print(f"rank {rk['rank']}: RSS MiB at {rk['rss_mib_at']}; growth 100->{a.steps}: "
              f"{rk['growth_mib_100_to_last']} MiB, 1000->{a.steps}: {rk['growth_mib_1000_to_last']} MiB")
    print(f"{a.steps} steps in {took:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
