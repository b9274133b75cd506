"""Python entry point of the collectives benchmark: megacore.comm from Python next to torch.distributed
(NCCL on GPUs, gloo on CPUs) when torch is installed, in the same run, nccl-tests style.

    python -m megacore.launch --nproc-per-node 4 benchmarks/collectives/bench_collectives.py \
        [--max-bytes 1G] [--iters 20] [--out benchmarks/results/collectives_py.json]

Times are host wall-clock per call after synchronising, the slowest rank's; bus bandwidth uses
nccl-tests' formulas (all-reduce ×2(n−1)/n; all-gather, reduce-scatter ×(n−1)/n of the whole buffer;
broadcast ×1). The C++ binary (megacore_bench_collectives) compares against raw NCCL without Python.
"""

import argparse
import json
import time

import numpy as np

import megacore as mc


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def busbw_factor(op, n):
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--min-bytes", default="8")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    world = mc.comm.init_from_env("auto", timeout_s=300)
    n, r = world.size, world.rank
    gpu = world.backend == "nccl"
    dev = f"cuda:{mc.comm.detect_launch_env()['local_rank'] % max(mc.cuda_device_count(), 1)}" if gpu else "cpu"
    try:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            import os

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29611")
            dist.init_process_group("nccl" if gpu else "gloo", rank=r, world_size=n)
        tdev = torch.device(dev)
    except Exception as e:  # noqa: BLE001 - the peer is optional
        torch = None
        if r == 0:
            print(f"# torch.distributed peer unavailable ({type(e).__name__}: {e}); megacore only")

    def sync():
        if gpu:
            mc.synchronize(dev)

    def timed(fn):
        for _ in range(a.warmup):
            fn()
        sync()
        world.barrier()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            fn()
        sync()
        us = (time.perf_counter() - t0) / a.iters * 1e6
        worst = mc.full((1,), us, device=dev)
        world.all_reduce(worst, "max")
        return float(np.asarray(worst.to("cpu"))[0])

    rows = []
    if r == 0:
        print(f"# {n} ranks, backend {world.backend}, device {mc.cuda_device_name(0) if gpu else 'cpu'}, f32")
        print(f"{'op':15s} {'bytes':>12s} {'mc_us':>10s} {'mc_busbw':>10s} {'torch_us':>10s} {'torch_busbw':>11s}")
    size = parse_size(a.min_bytes)
    while size <= parse_size(a.max_bytes):
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            whole = op in ("all_gather", "reduce_scatter")
            count = size // 4 // (n if whole else 1)
            if count < 1:
                continue
            full = count * (n if whole else 1)
            x = mc.full((full,), 1.0, device=dev)
            y = mc.zeros((count if op == "reduce_scatter" else full,), device=dev)
            fns = {
                "all_reduce": lambda: world.all_reduce(x.slice(0, 0, count)),
                "all_gather": lambda: world.all_gather(x.slice(0, 0, count), y),
                "reduce_scatter": lambda: world.reduce_scatter(x, y),
                "broadcast": lambda: world.broadcast(x.slice(0, 0, count), 0),
            }
            mc_us = timed(fns[op])
            t_us = None
            if torch is not None:
                tx = torch.ones(full, device=tdev)
                ty = torch.zeros(count if op == "reduce_scatter" else full, device=tdev)
                tfns = {
                    "all_reduce": lambda: dist.all_reduce(tx[:count]),
                    "all_gather": lambda: dist.all_gather_into_tensor(ty, tx[:count]),
                    "reduce_scatter": lambda: dist.reduce_scatter_tensor(ty, tx),
                    "broadcast": lambda: dist.broadcast(tx[:count], 0),
                }
                t_us = timed(tfns[op])
            f = busbw_factor(op, n)
            row = {"op": op, "bytes": full * 4, "megacore_us": mc_us, "megacore_busbw_GBps": full * 4 / mc_us / 1e3 * f}
            if t_us is not None:
                row.update(torch_us=t_us, torch_busbw_GBps=full * 4 / t_us / 1e3 * f)
            rows.append(row)
            if r == 0:
                tcol = f"{t_us:10.2f} {row['torch_busbw_GBps']:11.2f}" if t_us is not None else f"{'-':>10s} {'-':>11s}"
                print(f"{op:15s} {full * 4:12d} {mc_us:10.2f} {row['megacore_busbw_GBps']:10.2f} {tcol}")
        size *= 4
    if r == 0 and a.out:
        json.dump({"ranks": n, "backend": world.backend, "card": mc.cuda_device_name(0) if gpu else "cpu",
                   "peer": "torch.distributed" if torch is not None else None, "rows": rows}, open(a.out, "w"), indent=2)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
