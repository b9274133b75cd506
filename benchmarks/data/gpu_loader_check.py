"""GPU check of the loader: pinned host buffers, asynchronous copy to the device, stall under a paced step.

    PYTHONPATH=build/python python3 benchmarks/data/gpu_loader_check.py [--step-ms 150]

Writes benchmarks/results/data_gpu_loader.json with the card's name. Skips (exit 0) without CUDA.
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np

import megacore as mc
import megacore.data as D


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-ms", type=float, default=150.0)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "data_gpu_loader.json"))
    args = ap.parse_args()
    if not mc.cuda_available():
        print("no CUDA device: skipped")
        return
    with tempfile.TemporaryDirectory() as tmp:
        prefix = D.default_corpus(tmp, 20000)
        ds = D.GPTDataset(D.IndexedDataset(prefix), seq_length=2048, num_samples=4 * (args.steps + 8), seed=1,
                          use_cache=False)
        cpu = D.DataLoader(ds, micro_batch_size=4, prefetch=4)
        gpu = D.DataLoader(ds, micro_batch_size=4, prefetch=4, device="cuda:0")
        s = mc.Stream("cuda:0")
        checked = 0
        gpu.next(s)
        cpu.next()  # keep the two loaders in step
        cold = gpu.stats()["wait_seconds"]
        t_copy = 0.0
        for i in range(args.steps):
            time.sleep(args.step_ms / 1000)
            t0 = time.perf_counter()
            b = gpu.next(s)
            t_copy += time.perf_counter() - t0
            ref = cpu.next()
            if i % 10 == 0:
                s.synchronize()
                assert str(b.tokens.device).startswith("cuda"), b.tokens
                got = np.asarray(b.tokens.to("cpu"))
                assert (got == np.asarray(ref.tokens)).all()
                assert (np.asarray(b.loss_mask.to("cpu")) == np.asarray(ref.loss_mask)).all()
                checked += 1
        st = gpu.stats()
        res = {"device": mc.cuda_device_name(0), "seq_length": 2048, "micro_batch_size": 4,
               "micro_batches": args.steps, "simulated_step_ms": args.step_ms, "pinned": st["pinned"],
               "cold_start_wait_ms": round(cold * 1e3, 3),
               "stall_total_ms": round((st["wait_seconds"] - cold) * 1e3, 3),
               "next_call_mean_ms": round(t_copy / args.steps * 1e3, 4), "batches_checked_against_cpu": checked}
    print(json.dumps(res, indent=2))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
