"""End-to-end training comparison on the GPU machine: megacore and its peers train the same model shape, batch and
random data, one after another in the same call on the same card; one JSON for all of them:

    python3 benchmarks/e2e/run_e2e.py --config llama1b --megacore-bin .gpu-build/benchmarks/megacore_bench_training \
        [--systems megacore,hf_eager,hf_compile,liger,megatron_core,torchtitan] [--out-dir benchmarks/results]

writes benchmarks/results/e2e_<config>_<card>.json:
    {"card", "config", "date", "flops_convention", "runs": [{"system", "tokens_per_s_per_gpu", "tflops_6n_per_gpu",
     "mfu", "peak_mem_gib", "step_ms", ...}], "not_run": [{"system", "reason"}]}
A peer that fails to import or run is listed under not_run with the last lines of its error; the others go on.
megacore variants are the same benchmark binary with extra flags: --variant NAME="--flag value" (or --flag,value; repeatable).
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from e2e_common import CONFIGS, result  # noqa: E402


def card_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def card_tag(name):
    m = re.match(r"(NVIDIA) (\w+)", name)
    return f"{m.group(1)}_{m.group(2)}" if m else re.sub(r"\W+", "_", name)


def run(cmd, timeout):
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr, time.time() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n(timed out after {timeout} s)", time.time() - t0


def tail(text, n=6):
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-900:]


def megacore_run(name, binary, flags, c, a):
    tmp = f"/tmp/e2e_{name}.json"
    if os.path.exists(tmp):
        os.remove(tmp)
    cmd = ["mpirun", "--allow-run-as-root", "-np", "1", binary, "--single", "--micro-batch", str(c["micro_batch"]),
           "--seq", str(c["seq"]), "--iters", str(a.iters), "--warmup", str(a.warmup), "--out", tmp] + flags
    rc, out, wall = run(cmd, a.timeout)
    if rc != 0 or not os.path.exists(tmp):
        return None, f"exit {rc}: {tail(out)}"
    s = json.load(open(tmp))["single"]
    r = result(name, c, s["ms_per_step"] / 1e3, s["peak_allocated_gib"], a.peak_tflops)
    r.update(note=" ".join(["megacore_bench_training --single"] + flags), wall_s=round(wall, 1))
    return r, None


def peer_run(system, c, a):
    cmd = [sys.executable, os.path.join(HERE, "peers.py"), "--system", system, "--config", a.config,
           "--iters", str(a.iters), "--warmup", str(a.warmup)]
    rc, out, wall = run(cmd, a.timeout)
    return peer_result(system, c, rc, out, wall, a.peak_tflops)


def peer_result(system, c, rc, out, wall, peak_tflops):
    """A peer's run from its output. A peer that printed its timed result and then failed to exit in time (torch's
    compile workers can hold up interpreter shutdown) is kept, with the exit status in its note."""
    line = [ln for ln in out.splitlines() if ln.startswith("E2E_RESULT ")]
    if not line:
        return None, f"exit {rc}: {tail(out)}"
    m = json.loads(line[-1][len("E2E_RESULT "):])
    r = result(system, c, m.pop("step_s"), m.pop("peak_mem_gib"), peak_tflops)
    r.update({k: v for k, v in m.items() if k not in ("system", "tokens_per_s")}, wall_s=round(wall, 1))
    if rc != 0:
        r["note"] = (r.get("note", "") + f"; the process exited {rc} after printing this result"
                     + (" (killed at the per-system timeout)" if rc == 124 else "")).lstrip("; ")
    return r, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama1b", choices=sorted(CONFIGS))
    ap.add_argument("--systems", default="megacore,hf_eager,hf_compile,liger,megatron_core,torchtitan")
    ap.add_argument("--megacore-bin", default="build/benchmarks/megacore_bench_training")
    ap.add_argument("--variant", action="append", default=[], help='NAME="--flags" for another megacore run')
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per system")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100/H200 SXM: 989)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "..", "results"))
    ap.add_argument("--tag", default="", help="suffix of the file name")
    a = ap.parse_args()
    c = CONFIGS[a.config]
    name = card_name()
    doc = {"card": name, "config": dict(name=a.config, **c), "date": datetime.date.today().isoformat(),
           "command": " ".join(sys.argv), "flops_convention": "6*N_matmul + 12*L*h*s (non-causal attention count); "
           "mfu against --peak-tflops", "peak_tflops": a.peak_tflops, "runs": [], "not_run": []}
    systems = [s for s in a.systems.split(",") if s]
    variants = [v.split("=", 1) for v in a.variant]
    for s in systems + [v[0] for v in variants]:
        if s == "megacore" or s in dict(variants):
            flags = dict(variants).get(s, "").replace(",", " ").split()
            r, err = megacore_run(s, a.megacore_bin, flags, c, a)
        else:
            r, err = peer_run(s, c, a)
        if r:
            doc["runs"].append(r)
            print(f"{s:16s} {r['tokens_per_s_per_gpu']:9.0f} tok/s  mfu {r['mfu']:.3f}  peak {r['peak_mem_gib']:.1f} GiB"
                  f"  step {r['step_ms']:.1f} ms", flush=True)
        else:
            doc["not_run"].append({"system": s, "reason": err})
            print(f"{s:16s} NOT RUN: {err[-400:]}", flush=True)
    ref = {r["system"]: r["tokens_per_s_per_gpu"] for r in doc["runs"]}
    if "megacore" in ref:
        doc["megacore_vs"] = {k: round(ref["megacore"] / v, 3) for k, v in ref.items() if k != "megacore"}
        print("megacore / peer:", doc["megacore_vs"])
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, f"e2e_{a.config}{a.tag}_{card_tag(name)}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
