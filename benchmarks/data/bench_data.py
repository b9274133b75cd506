"""Data pipeline throughput on the CPU: preprocessing tokens/s, loader samples/s, and loader stall.

    PYTHONPATH=build/python python3 benchmarks/data/bench_data.py [--quick] [--out benchmarks/results/data_cpu.json]

* preprocess: a synthetic JSONL corpus (byte tokenizer; also a tokenizer.json when --hf-tokenizer is given)
  through `megacore preprocess` with 1 and N workers.
* loader: GPT samples of seq_length 2048, micro-batch 4, read as fast as possible (samples/s), then paced
  by a simulated training step (default 150 ms per micro-batch, about a 1B model at ~54k tokens/s on one
  H100) to measure how long the trainer would wait for data (stall). Both with and without a device copy
  are CPU-only here; the stall number includes everything the consumer thread does in next().

Results are one JSON file recording the host, CPU count and whether CUDA was present.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

import megacore as mc
import megacore.data as D


def _make_jsonl(path, n_docs, words=200, seed=0):
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(5000)]
    with open(path, "w") as f:
        for _ in range(n_docs):
            n = int(rng.integers(words // 2, words * 2))
            f.write(json.dumps({"text": " ".join(rng.choice(vocab, n))}) + "\n")
    return os.path.getsize(path)


def bench_preprocess(tmp, n_docs, workers, tokenizer):
    src = os.path.join(tmp, "docs.jsonl")
    size = _make_jsonl(src, n_docs)
    out = []
    for w in sorted({1, workers}):
        s = D.preprocess(src, os.path.join(tmp, f"pp_{w}"), tokenizer=tokenizer, workers=w, log=False,
                         progress=False)
        out.append({"tokenizer": str(tokenizer), "workers": w, "documents": s["documents"], "tokens": s["tokens"],
                    "input_bytes": size, "seconds": round(s["seconds"], 4),
                    "tokens_per_second": round(s["tokens_per_second"], 1),
                    "mb_per_second": round(size / s["seconds"] / 1e6, 2)})
        print(f"preprocess {tokenizer} workers={w}: {s['tokens_per_second']:,.0f} tokens/s "
              f"({size / s['seconds'] / 1e6:.1f} MB/s)")
    return out


def bench_loader(tmp, seq_length, mbs, steps, step_ms):
    prefix = D.default_corpus(tmp, 20000)
    ds = D.GPTDataset(D.IndexedDataset(prefix), seq_length=seq_length, num_samples=mbs * (steps + 8) * 2,
                      seed=1, use_cache=False)
    # Raw speed: nothing else to do between batches.
    loader = D.DataLoader(ds, micro_batch_size=mbs, prefetch=4)
    t0 = time.perf_counter()
    n = 0
    for b in loader:
        n += 1
        if n == steps:
            break
    raw = time.perf_counter() - t0
    raw_stats = loader.stats()
    # Paced by a simulated training step: how long does next() block once the pipeline is warm?
    loader = D.DataLoader(ds, micro_batch_size=mbs, prefetch=4)
    first = loader.next()  # includes the cold start, reported separately
    cold = loader.stats()["wait_seconds"]
    for _ in range(steps):
        time.sleep(step_ms / 1000)
        b = loader.next()
    st = loader.stats()
    res = {"seq_length": seq_length, "micro_batch_size": mbs, "micro_batches": steps,
           "samples_per_second": round(steps * mbs / raw, 1),
           "tokens_per_second": round(steps * mbs * seq_length / raw, 1),
           "producer_ms_per_micro_batch": round(raw_stats["produce_seconds"] / max(raw_stats["batches"], 1) * 1e3, 3),
           "simulated_step_ms": step_ms, "cold_start_wait_ms": round(cold * 1e3, 3),
           "stall_total_ms": round((st["wait_seconds"] - cold) * 1e3, 3),
           "stall_max_ms": round(st["max_wait_seconds"] * 1e3 if steps else 0, 3), "pinned": st["pinned"]}
    print(f"loader seq={seq_length} mbs={mbs}: {res['samples_per_second']:,.0f} samples/s, "
          f"stall {res['stall_total_ms']:.3f} ms over {steps} steps of {step_ms} ms")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--hf-tokenizer", default=None, help="also benchmark this tokenizer.json")
    ap.add_argument("--step-ms", type=float, default=150.0, help="simulated training step per micro-batch")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "data_cpu.json"))
    args = ap.parse_args(argv)
    n_docs, steps = (2000, 20) if args.quick else (20000, 100)
    with tempfile.TemporaryDirectory() as tmp:
        pre = bench_preprocess(tmp, n_docs, args.workers, "byte")
        if args.hf_tokenizer:
            pre += bench_preprocess(tmp, n_docs, args.workers, args.hf_tokenizer)
        load = [bench_loader(tmp, 2048, 4, steps, 0 if args.quick else args.step_ms)]
        if not args.quick:
            load.append(bench_loader(tmp, 2048, 4, steps, 0))
    result = {"benchmark": "data", "host": platform.node(), "cpu_count": os.cpu_count(),
              "cpu": platform.processor() or platform.machine(), "python": sys.version.split()[0],
              "cuda": mc.cuda_available(), "device": mc.cuda_device_name(0) if mc.cuda_available() else "cpu",
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "preprocess": pre, "loader": load}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {os.path.abspath(args.out)}")


if __name__ == "__main__":
    main()
