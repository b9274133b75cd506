"""Peer for benchmarks/cp/bench_cp_attention.cpp: PyTorch's own context parallelism
(torch.distributed.tensor.experimental.context_parallel, ring attention around scaled_dot_product_attention)
on the same attention layer: QKV projection (32 query heads, 8 KV groups, head_dim 64, hidden 2048), causal
SDPA, output projection, bf16, forward + backward, one GPU per rank.

    torchrun --nproc-per-node 4 benchmarks/cp/torch_cp_peer.py --seq 32768 --out-dir benchmarks/results
    torchrun --nproc-per-node 1 benchmarks/cp/torch_cp_peer.py --seq 8192 --out-dir benchmarks/results

FLOPs use the megacore benchmark's convention (causal attention 6·a·d·S per token + 6 · the projections'
weights per token). Where SDPA under context_parallel refuses grouped-query attention (enable_gqa), K and V
are expanded to the 32 query heads and the JSON says so. Writes torch_cp<CP>_seq<S>_<card>.json.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out-dir", default="")
    a = ap.parse_args()

    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    h, H, G, D = 2048, 32, 8, 64
    b, S = a.micro_batch, a.seq
    torch.manual_seed(0)
    qkv = torch.nn.Linear(h, (H + 2 * G) * D, bias=False, device=dev, dtype=torch.bfloat16)
    proj = torch.nn.Linear(H * D, h, bias=False, device=dev, dtype=torch.bfloat16)
    x = torch.randn(b, S, h, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(b, S, h, device=dev, dtype=torch.bfloat16)

    def layer(xs, gqa):
        s = xs.shape[1]
        t = qkv(xs).view(b, s, G, H // G + 2, D)
        q = t[:, :, :, : H // G].reshape(b, s, H, D).transpose(1, 2)
        k = t[:, :, :, H // G].transpose(1, 2)
        v = t[:, :, :, H // G + 1].transpose(1, 2)
        if gqa:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k = k.repeat_interleave(H // G, dim=1)
            v = v.repeat_interleave(H // G, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return proj(o.transpose(1, 2).reshape(b, s, H * D))

    result = {"benchmark": "torch_cp_attention_peer", "card": torch.cuda.get_device_name(), "gpus": n,
              "context_parallel": n, "seq": S, "micro_batch": b, "dtype": "bf16", "torch": torch.__version__,
              "flops_convention": "causal: attention 6*a*d*S per token + 6*N_matmul (projections)"}
    flops = b * S * (6.0 * H * D * S + 6.0 * (h * (H + 2 * G) * D + H * D * h))

    def run(gqa):
        # context_parallel shards its buffers in place (a resize on entry and exit), which a tensor that
        # requires grad refuses: the layer's input is a detached leaf over the sharded buffer.
        xs = x.clone()
        dys = dy.clone()
        leaf = []

        def step():
            out = layer(leaf[0], gqa)
            out.backward(dys)

        if n > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.experimental import context_parallel
            mesh = init_device_mesh("cuda", (n,))
            ctx = context_parallel(mesh, buffers=[xs, dys], buffer_seq_dims=[1, 1])
        else:
            import contextlib
            ctx = contextlib.nullcontext()
        with ctx:
            leaf.append(xs.detach().requires_grad_(True))
            for _ in range(a.warmup):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            return (time.perf_counter() - t0) / a.iters

    try:
        sec, gqa = run(True), True
    except Exception as e:  # noqa: BLE001 - reported in the JSON
        result["enable_gqa_error"] = f"{type(e).__name__}: {e}"[:400]
        sec, gqa = run(False), False
    result.update({"kv_heads_expanded": not gqa, "attention_layer_ms": sec * 1e3,
                   "attention_layer_tflops_per_gpu": flops / sec / n / 1e12,
                   "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30})
    if rank == 0:
        print(json.dumps(result, indent=2))
        if a.out_dir:
            card = result["card"].replace(" ", "_")
            path = os.path.join(a.out_dir, f"torch_cp{n}_seq{S}_{card}.json")
            with open(path, "w") as f:
                json.dump(result, f, indent=2)
            print("wrote", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
