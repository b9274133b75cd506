"""End-to-end MoE training on GPUs: a Mixtral-style model trained by `megacore train` (the mixtral_8x7b recipe
with its shape overridden) with EP = all GPUs, against Hugging Face MixtralForCausalLM of the same shape on one
GPU (eager, then torch.compile), all in one call. Writes moe_e2e_<card>.json under --out-dir.

    python benchmarks/moe/bench_moe_e2e.py --out-dir benchmarks/results          # 4 GPUs, the full size
    python benchmarks/moe/bench_moe_e2e.py --small                               # < 60 s smoke test
    python benchmarks/moe/bench_moe_e2e.py --small --cpu --nproc 2 --no-peer     # the driver itself, on CPU ranks
    python benchmarks/moe/bench_moe_e2e.py --force-balance --out-dir benchmarks/results   # forced balanced routing

Model (full size): h 2048, 16 layers, 16 heads / 8 KV groups, 8 experts of FFN 4096 in every layer, top-2, vocab
32000, untied; total and active parameter counts come from megacore's TransformerConfig (parameter_count).
Run: bf16, ZeRO-1 (distributed optimizer) over DP, EP = --nproc, TP = 1, selective recompute, micro-batch 4 × seq
2048, global batch 32 (2 micro-batches per rank; `megacore plan` estimates 25 GiB per GPU before the experts'
activations), byte tokens of the embedded corpus, no checkpoints. Steady
state = mean of steps 4..N (--measure-from) of the trainer's metrics.jsonl. tokens/s/GPU = global tokens / step time / GPUs.
MFU = the trainer's: FLOPs per token = 6 · N_matmul over *active* weights (router, top-k experts) + non-causal
attention 12 · L · h · s, against the card's dense bf16 peak (989 TFLOP/s for H100/H200 SXM, as the other
benchmarks). The peer's tokens/s is for its one GPU (compare per-GPU throughput, not MFU).

Routing. By default the router learns. From random init on byte tokens the routed load goes through an early
phase in which the MoE layers' inputs (the router's) nearly all point one way, so every token picks the same
experts (per-step "moe_load_imbalance", max/mean tokens per expert of the worst layer, near top-k's bound E/k); it
recovers as the model learns past the byte frequencies (docs/training.md, "Learned routing"). A learned-routing
figure takes --steps past that phase and --measure-from after it; the JSON's per-step imbalance shows where it is.
--force-balance sets model.moe_router_force_load_balancing (Megatron-Core's --moe-router-force-load-balancing,
benchmarking only): each token's experts come from random scores, so the load is even and the run measures
the throughput of a balanced model. The JSON says which ("routing"); the Hugging Face peer always routes with
its learned router (transformers has no such switch) and says so. With --force-balance the file is
moe_e2e_forced_<card>.json.

A part that fails (OOM, compile error, missing package) is recorded with its reason; the others still run. A part
that runs out of GPU memory is run once more at half the micro-batch (its result says so: "retried_after").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from out_dir import check_out_dir

HERE = os.path.dirname(os.path.abspath(__file__))

FULL = dict(hidden=2048, layers=16, heads=16, kv_heads=8, ffn=4096, experts=8, topk=2, vocab=32000, seq=2048,
            micro_batch=4, global_batch=32, steps=12)
SMALL = dict(hidden=512, layers=4, heads=8, kv_heads=4, ffn=1024, experts=8, topk=2, vocab=32000, seq=512,
             micro_batch=2, global_batch=16, steps=6)


def megacore_sets(m: dict, nproc: int, work: str, cpu: bool, force_balance: bool = False) -> list[str]:
    sets = {"model.hidden_size": m["hidden"], "model.num_layers": m["layers"],
            "model.num_attention_heads": m["heads"], "model.num_query_groups": m["kv_heads"],
            "model.kv_channels": m["hidden"] // m["heads"], "model.ffn_hidden_size": m["ffn"],
            "model.moe_ffn_hidden_size": m["ffn"], "model.num_moe_experts": m["experts"],
            "model.moe_router_topk": m["topk"], "model.vocab_size": m["vocab"], "model.max_position_embeddings": 4096,
            "model.moe_aux_loss_coeff": 0.01,
            "model.moe_router_force_load_balancing": "true" if force_balance else "false",
            "parallel.tp": 1, "parallel.sp": "false", "parallel.pp": 1, "parallel.ep": nproc, "parallel.etp": 1,
            "parallel.zero": "true",
            "data.paths": "embedded", "data.tokenizer": "byte", "data.seq": m["seq"], "data.mbs": m["micro_batch"],
            "data.global_batch_size": m["global_batch"],
            "trainer.max_steps": m["steps"], "trainer.val_check_interval": 0, "trainer.recompute": "selective",
            "trainer.log_interval": 1, "trainer.generate_tokens": 0,
            "optim.lr_warmup_iters": 2, "checkpoint.save_dir": "", "checkpoint.save_last": "false",
            "data.cache_dir": os.path.join(work, "data"), "logging.log_dir": os.path.join(work, "mc_logs"),
            "logging.tensorboard": "false"}
    if cpu:
        sets["trainer.precision"] = "auto"  # the CPU path's own precision: this run checks the driver only
    out = []
    for k, v in sets.items():
        out += ["--set", f"{k}={v}"]
    return out


def parameter_counts(sets: list[str], seq: int) -> dict:
    """Total and active parameters and FLOPs per token of the configured model, from megacore's TransformerConfig."""
    import megacore as mc
    from megacore.cli import load_recipe

    r = load_recipe("mixtral_8x7b", None, [sets[i + 1] for i in range(0, len(sets), 2)])
    cfg = r.model.to_transformer_config("bf16")
    c = mc.model.parameter_count(cfg, 0)
    f = mc.model.flops_per_token(cfg, seq, False)
    return {"total": int(c["total"]), "active": int(c["active"]),
            "flops_per_token": float(f["total"]), "flops_per_token_attention": float(f["attention"])}


def run(cmd: list[str], timeout: float, log: str) -> tuple[int, str]:
    """Runs cmd with its output in `log`; (exit status, last lines). 124 when cut at timeout."""
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with open(log) as f:
        tail = f.read()[-3000:]
    return rc, tail


def ran_out_of_memory(tail: str) -> bool:
    t = tail.lower()
    return "out of memory" in t or "outofmemoryerror" in t


def first_error(tail: str) -> str:
    lines = [l for l in tail.splitlines() if any(w in l for w in ("Error", "error", "OOM", "out of memory"))]
    return (lines[-1] if lines else tail.strip().splitlines()[-1] if tail.strip() else "no output")[:400]


def with_memory_retry(part, a, m: dict, *args) -> dict:
    """part(a, m, ...) and, when it ran out of memory, once more at half the micro-batch (same global batch)."""
    r = part(a, m, *args)
    if m["micro_batch"] > 1 and r.pop("out_of_memory", False):
        half = dict(m, micro_batch=m["micro_batch"] // 2)
        r = dict(part(a, half, *args), retried_after=r["error"])
    r.pop("out_of_memory", None)
    return r


def megacore_part(a, m: dict, work: str) -> dict:
    work = tempfile.mkdtemp(prefix=f"megacore_mbs{m['micro_batch']}_", dir=work)
    log_dir = os.path.join(work, "mc_logs")
    sets = megacore_sets(m, a.nproc, work, a.cpu, a.force_balance)
    res: dict = {"system": "megacore", "gpus": a.nproc, "layout": f"EP{a.nproc} (DP{a.nproc}, ZeRO-1), TP1",
                 "routing": routing(a),
                 "micro_batch": m["micro_batch"], "seq": m["seq"], "global_batch": m["global_batch"]}
    try:
        res["parameters"] = parameter_counts(sets, m["seq"])
    except Exception as e:  # noqa: BLE001 - recorded, the run below still says whether it works
        res["parameters"] = {"error": f"{type(e).__name__}: {e}"}
    cmd = [a.python, "-m", "megacore.cli", "train", "--recipe", "mixtral_8x7b", "--nproc-per-node", str(a.nproc)]
    cmd += (["--cpu"] if a.cpu else []) + sets
    res["command"] = " ".join(cmd)
    t0 = time.time()
    rc, tail = run(cmd, a.timeout, os.path.join(work, "megacore.log"))
    res["wall_s"] = time.time() - t0
    metrics = os.path.join(log_dir, "metrics.jsonl")
    steps = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            steps = [json.loads(l) for l in f if l.strip()]
    res["loss"] = [s["loss"] for s in steps]
    # max/mean tokens per expert of every step (the worst MoE layer), as the trainer logged it
    res["moe_load_imbalance"] = [s.get("moe_load_imbalance") for s in steps]
    # and every step's time, so a run's throughput can be read against its load (learned routing varies from run to run)
    res["step_seconds"] = [s.get("step_seconds") for s in steps]
    if rc != 0 or len(steps) < m["steps"]:
        res["error"] = f"exit status {rc}, {len(steps)}/{m['steps']} steps: {first_error(tail)}"
        res["out_of_memory"] = ran_out_of_memory(tail)
        return res
    first = a.measure_from - 1
    steady = steps[first:] if len(steps) > first + 1 else steps[1:]
    mean = lambda k: sum(float(s[k]) for s in steady) / len(steady)  # noqa: E731
    res.update({"steady_steps": [steady[0]["step"], steady[-1]["step"]],
                "s_per_step": mean("step_seconds"),
                "tokens_per_s_per_gpu": mean("tokens_per_s") / a.nproc,
                "tflops_per_gpu": mean("tflops_per_gpu"), "mfu_active": mean("mfu"),
                "mem_peak_gib": max(float(s["mem_peak_gib"]) for s in steps),
                "moe_load_imbalance_last": steps[-1].get("moe_load_imbalance")})
    return res


def peer_part(a, m: dict, work: str, compile_: bool) -> dict:
    name = "hf_compile" if compile_ else "hf_eager"
    out = os.path.join(work, f"{name}_mbs{m['micro_batch']}.json")
    cmd = [a.python, os.path.join(HERE, "hf_mixtral_peer.py"), "--hidden", str(m["hidden"]), "--layers", str(m["layers"]),
           "--heads", str(m["heads"]), "--kv-heads", str(m["kv_heads"]), "--ffn", str(m["ffn"]),
           "--experts", str(m["experts"]), "--topk", str(m["topk"]), "--vocab", str(m["vocab"]),
           "--micro-batch", str(m["micro_batch"]), "--seq", str(m["seq"]), "--out", out]
    cmd += ["--iters", "3", "--warmup", "2"] if a.small else []
    cmd += ["--compile"] if compile_ else []
    rc, tail = run(cmd, a.timeout, os.path.join(work, f"{name}_mbs{m['micro_batch']}.log"))
    if rc != 0 or not os.path.exists(out):
        return {"system": name, "micro_batch": m["micro_batch"], "routing": PEER_ROUTING, "command": " ".join(cmd),
                "error": f"exit status {rc}: {first_error(tail)}", "out_of_memory": ran_out_of_memory(tail)}
    with open(out) as f:
        r = json.load(f)
    r["system"] = name
    r["routing"] = PEER_ROUTING
    return r


PEER_ROUTING = "learned (transformers' MixtralForCausalLM has no way to force balanced routing)"


def routing(a) -> str:
    return "forced balanced" if a.force_balance else "learned"


def card_name(cpu: bool) -> str:
    if cpu:
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=60).stdout.strip().splitlines()
        return out[0].strip() if out else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def table(rows: list[dict]) -> str:
    lines = [f"{'system':<12} {'GPUs':>4} {'tok/s/GPU':>10} {'TFLOP/s':>8} {'MFU act':>8} {'peak GiB':>9} {'s/step':>7}  note"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['system']:<12} {'':>4} {'-':>10} {'-':>8} {'-':>8} {'-':>9} {'-':>7}  {r['error'][:100]}")
            continue
        tps = r.get("tokens_per_s_per_gpu", r.get("tokens_per_s", 0))
        tfl = r.get("tflops_per_gpu")
        mfu = r.get("mfu_active")
        mem = r.get("mem_peak_gib", r.get("peak_allocated_gib", 0))
        sps = r.get("s_per_step", r.get("ms_per_step", 0) / 1e3)
        lines.append(f"{r['system']:<12} {r.get('gpus', 1):>4} {tps:>10.0f} {tfl if tfl is not None else 0:>8.1f} "
                     f"{100 * (mfu or 0):>7.1f}% {mem:>9.2f} {sps:>7.3f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4, help="GPUs (= EP = DP) for megacore")
    ap.add_argument("--small", action="store_true", help="a small model and few steps (< 60 s), a smoke test")
    ap.add_argument("--cpu", action="store_true", help="megacore on CPU ranks (checks the driver; implies --no-peer)")
    ap.add_argument("--no-peer", action="store_true", help="skip the Hugging Face peer")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant of the peer")
    ap.add_argument("--micro-batch", type=int, help="override the micro-batch (megacore and peer)")
    ap.add_argument("--seq", type=int, help="override the sequence length (megacore and peer)")
    ap.add_argument("--steps", type=int, help="override the megacore steps (at least 5)")
    ap.add_argument("--measure-from", type=int, default=4,
                    help="first step of the steady state (default 4); with learned routing, a step after the early "
                         "phase in which the router's inputs share one direction and the load collapses (docs/training.md)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per part")
    ap.add_argument("--python", default=sys.executable, help="interpreter for megacore and the peer")
    ap.add_argument("--out-dir", help="write moe_e2e_<card>.json here")
    ap.add_argument("--keep", action="store_true", help="keep the logs' temporary directory")
    ap.add_argument("--force-balance", action="store_true",
                    help="megacore routes by random scores (model.moe_router_force_load_balancing; benchmarking only)")
    a = ap.parse_args()
    m = dict(SMALL if a.small else FULL)
    for k in ("micro_batch", "seq", "steps"):
        if getattr(a, k) is not None:
            m[k] = getattr(a, k)
    if a.measure_from < 2 or m["steps"] < a.measure_from + 1:
        ap.error(f"--steps must be at least --measure-from + 1 = {a.measure_from + 1} and --measure-from at least 2 "
                 "(steady state is steps measure_from..N)")
    if a.out_dir:  # made (or refused) now, not after the runs
        check_out_dir(ap, a.out_dir)
    m["global_batch"] = max(m["global_batch"], m["micro_batch"] * a.nproc)
    m["global_batch"] -= m["global_batch"] % (m["micro_batch"] * a.nproc)

    card = card_name(a.cpu)
    work = tempfile.mkdtemp(prefix="moe_e2e_")
    print(f"card: {card}; model {m}; logs in {work}", flush=True)
    rows = [with_memory_retry(megacore_part, a, m, work)]
    print(table(rows), flush=True)
    if not (a.no_peer or a.cpu):
        for c in ([False] if a.no_compile else [False, True]):
            rows.append(with_memory_retry(peer_part, a, m, work, c))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    mc = rows[0]
    r = {"benchmark": "moe_e2e" + ("_small" if a.small else ""), "card": card, "model": m, "routing": routing(a),
         "parameters": mc.get("parameters"),
         "flops_convention": "6*N_matmul(active: router + top-k experts) + 12*L*h*s (non-causal); peak = the card's "
                             "dense bf16 figure (trainer.peak_tflops / known_peak_tflops)",
         "results": rows}
    print(table(rows))
    print(json.dumps(r, indent=2))
    if a.out_dir:
        short = "_".join(card.split()[:2]) if card not in ("cpu", "unknown") else card
        tag = ("_small" if a.small else "") + ("_forced" if a.force_balance else "")
        path = os.path.join(a.out_dir, f"moe_e2e{tag}_{short}.json")
        with open(path, "w") as f:
            json.dump(r, f, indent=2)
        print(f"wrote {path}")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if "error" in mc else 0


if __name__ == "__main__":
    sys.exit(main())
