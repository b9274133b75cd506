"""One recipe trained by `megacore train` in several parallel layouts on the same GPUs, one after another in the
same call; the steady-state throughput of each against the first (the data-parallel baseline):

    python3 benchmarks/training/bench_layouts.py --recipe llama32_1b --nproc 4 --out-dir benchmarks/results \
        --layout dp4="parallel.zero=true" --layout tp2dp2="parallel.tp=2 parallel.sp=true parallel.zero=true" \
        --layout pp2dp2="parallel.pp=2 parallel.vp=2 parallel.zero=true" [--set data.gbs=64 ...] [--steps 8]
        [--layout tp2dp2fwd="parallel.tp=2 parallel.sp=true parallel.zero=true parallel.tp_comm_overlap_forward=true"]

Every layout runs the recipe with the common --set values (default: the embedded corpus, byte tokens, no validation,
no checkpoint) plus its own. A layout's NAME=value items whose name has no dot and is upper case are environment
variables for that layout's run only (e.g. CUDA_DEVICE_MAX_CONNECTIONS=1, NCCL_MAX_CTAS=8). Steady state = mean of steps 3.. (the first two include plan tuning and warm-up).
Writes layouts_<recipe>_<N>gpu_<card>.json: {"card", "recipe", "common_sets", "runs": [{"layout", "sets",
"tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "peak_mem_gib", "step_s", "loss_first", "loss_last",
"vs_first"}], "not_run": [...]}.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time

COMMON = ["data.paths=embedded", "data.tokenizer=byte", "trainer.val_check_interval=0", "trainer.generate_tokens=0",
          "checkpoint.save_dir=", "checkpoint.save_last=false", "logging.tensorboard=false",
          "optim.lr_warmup_iters=2"]


def card():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="llama32_1b")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--layout", action="append", required=True, help='NAME="section.field=value ..."')
    ap.add_argument("--set", action="append", default=[], help="section.field=value for every layout")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--work", default="/tmp/megacore_layouts")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks (checks the driver only)")
    a = ap.parse_args()
    common = COMMON + [f"trainer.max_steps={a.steps}"] + a.set
    doc = {"card": card(), "recipe": a.recipe, "gpus": a.nproc, "date": datetime.date.today().isoformat(),
           "common_sets": common, "steady_state": "mean over steps 3..", "runs": [], "not_run": []}
    for spec in a.layout:
        name, sets = spec.split("=", 1)
        sets = sets.replace(",", " ").split()
        env_sets = [x for x in sets if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", x)]
        sets = [x for x in sets if x not in env_sets]
        env = dict(os.environ, **dict(x.split("=", 1) for x in env_sets))
        logdir = os.path.join(a.work, name)
        shutil.rmtree(logdir, ignore_errors=True)
        cmd = [sys.executable, "-m", "megacore.cli", "train", "--recipe", a.recipe, "--nproc-per-node", str(a.nproc)] + \
            (["--cpu"] if a.cpu else [])
        for s in common + sets + [f"logging.log_dir={logdir}"]:
            cmd += ["--set", s]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
            out, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = str(e.stdout or "") + f"\n(timed out after {a.timeout} s)", 124
        rows = []
        jl = os.path.join(logdir, "metrics.jsonl")
        if os.path.exists(jl):
            rows = [json.loads(ln) for ln in open(jl) if ln.strip()]
            rows = [r for r in rows if "tokens_per_s" in r]
        steady = [r for r in rows if r["step"] >= 3]
        if rc != 0 or not steady:
            tail = " | ".join([ln for ln in out.strip().splitlines() if ln.strip()][-6:])[-900:]
            doc["not_run"].append({"layout": name, "sets": sets, "env": env_sets, "reason": f"exit {rc}: {tail}"})
            print(f"{name}: failed ({tail})", flush=True)
            continue
        mean = lambda k: sum(r[k] for r in steady) / len(steady)  # noqa: E731
        run = {"layout": name, "sets": sets, "env": env_sets, "tokens_per_s": mean("tokens_per_s"),
               "tokens_per_s_per_gpu": mean("tokens_per_s") / a.nproc, "tflops_per_gpu": mean("tflops_per_gpu"),
               "mfu": mean("mfu"), "peak_mem_gib": max(r.get("mem_peak_gib", 0) for r in rows),
               "step_s": mean("step_seconds"), "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
               "steps": len(rows), "wall_s": round(time.time() - t0, 1)}
        # The trainer's start banner names the pipeline split it used (PP > 1).
        split = [ln.split("megacore: pipeline ", 1)[1] for ln in out.splitlines() if "megacore: pipeline " in ln]
        if split:
            run["pipeline_layout"] = split[0]
        if doc["runs"]:
            run["vs_first"] = run["tokens_per_s"] / doc["runs"][0]["tokens_per_s"]
        doc["runs"].append(run)
        print(f"{name:10s} {run['tokens_per_s'] / 1e3:8.1f}k tok/s  {run['tflops_per_gpu']:6.1f} TFLOP/s/GPU  "
              f"MFU {100 * run['mfu']:5.1f}%  peak {run['peak_mem_gib']:6.2f} GiB  "
              f"{'%.3f x first' % run['vs_first'] if 'vs_first' in run else '(baseline)'}  "
              f"loss {run['loss_first']:.3f} -> {run['loss_last']:.3f}", flush=True)
    tag = re.sub(r"\W+", "_", doc["card"].replace("NVIDIA ", "NVIDIA_").split(" ")[0])
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, f"layouts_{a.recipe}_{a.nproc}gpu{a.tag}_{tag}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", path)
    return 0 if doc["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
