"""Peer for megacore_bench_training: PyTorch DDP over Hugging Face LlamaForCausalLM of the same shape
(Llama-1.1B: h2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab 32000, untied), bf16 weights, SDPA
attention, micro-batch 4 x 2048, fused AdamW, global-norm clipping at 1.0, gradient accumulation with
no_sync. Same two phases as the C++ benchmark in one launch: every GPU alone (the 1-GPU baseline), then
DDP over all ranks; scaling efficiency = DDP tokens/s per GPU / single tokens/s.

    torchrun --nproc_per_node 4 benchmarks/training/torch_ddp_peer.py --out peer.json
    torchrun --nproc_per_node 4 benchmarks/training/torch_ddp_peer.py --zero --out peer_zero.json

Difference to megacore: torch keeps bf16 parameters, gradients and AdamW state (no f32 master weights or
f32 main grads), so it moves half the gradient bytes per all-reduce and does less optimizer work.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM


def make_model(device):
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).train(), cfg


def make_optimizer(params, zero):
    if zero:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=3e-4, fused=True)
    return torch.optim.AdamW(params, lr=3e-4, fused=True)


def run(model, opt, ids, labels, a, ddp):
    def step():
        opt.zero_grad(set_to_none=False)
        for m in range(a.grad_accum):
            last = m == a.grad_accum - 1
            ctx = model.no_sync() if (ddp and not last) else _null()
            with ctx:
                loss = model(input_ids=ids, labels=labels).loss / a.grad_accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    if ddp:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        loss = step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / a.iters, float(loss)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def reduce(x, op):
    t = torch.tensor([x], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=op)
    return t.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-cap-mb", type=int, default=25)
    ap.add_argument("--zero", action="store_true")
    ap.add_argument("--single", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)  # different data on every rank
    ids = torch.randint(0, 32000, (a.micro_batch, a.seq), generator=g).to(device)
    labels = torch.randint(0, 32000, (a.micro_batch, a.seq), generator=g).to(device)
    tokens = a.micro_batch * a.seq * a.grad_accum

    # 1. every GPU alone
    model, cfg = make_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    sec, loss = run(model, opt, ids, labels, a, ddp=False)
    single_sec = reduce(sec, dist.ReduceOp.SUM) / world
    r = {"peer": "torch DDP + transformers LlamaForCausalLM (sdpa, bf16, fused AdamW)", "torch": torch.__version__,
         "card": torch.cuda.get_device_name(local), "micro_batch": a.micro_batch, "seq": a.seq,
         "grad_accum": a.grad_accum, "optimizer": "ZeroRedundancyOptimizer(AdamW)" if a.zero else "AdamW",
         "single": {"ms_per_step": single_sec * 1e3, "tokens_per_s": tokens / single_sec, "loss": loss}}
    del model, opt
    torch.cuda.empty_cache()

    # 2. DDP over all ranks
    if not a.single and world > 1:
        model, _ = make_model(device)
        model = DDP(model, device_ids=[local], bucket_cap_mb=a.bucket_cap_mb, gradient_as_bucket_view=True)
        opt = make_optimizer(model.parameters(), a.zero)
        torch.cuda.reset_peak_memory_stats()
        sec, loss = run(model, opt, ids, labels, a, ddp=True)
        sec = reduce(sec, dist.ReduceOp.MAX)
        r["ddp"] = {"gpus": world, "ms_per_step": sec * 1e3, "tokens_per_s": tokens * world / sec,
                    "tokens_per_s_per_gpu": tokens / sec, "scaling_efficiency": single_sec / sec, "loss": loss,
                    "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}
    if rank == 0:
        print(json.dumps(r, indent=2))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(r, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
