"""Peer for bench_gpt_model: Hugging Face LlamaForCausalLM of the same shape (Llama-1.1B: h2048, 16 layers,
32 heads, 8 KV heads, FFN 8192, vocab 32000), bf16 weights, SDPA attention, forward + backward (no optimizer)
on one GPU, micro-batch 4 × 2048 by default. Same FLOP convention as megacore (6·N_matmul + 12·L·h·s).

    python benchmarks/model/torch_llama_peer.py --out peer.json
"""

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--out")
    a = ap.parse_args()

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    model.train()
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (a.micro_batch, a.seq), generator=g).cuda()
    labels = torch.randint(0, cfg.vocab_size, (a.micro_batch, a.seq), generator=g).cuda()

    def step():
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        loss = step()
    torch.cuda.synchronize()
    sec = (time.perf_counter() - t0) / a.iters

    h, L, s = 2048, 16, a.seq
    n_matmul = L * (h * (h + 2 * 8 * 64) + h * h + 3 * h * 8192) + h * cfg.vocab_size
    flops_per_token = 6 * n_matmul + 12 * L * h * s
    tokens = a.micro_batch * a.seq
    tflops = flops_per_token * tokens / sec / 1e12
    r = {"peer": "transformers LlamaForCausalLM (sdpa, bf16, eager)", "torch": torch.__version__,
         "card": torch.cuda.get_device_name(0), "micro_batch": a.micro_batch, "seq": a.seq,
         "ms_per_step": sec * 1e3, "tokens_per_s": tokens / sec, "tflops_per_gpu": tflops,
         "mfu": tflops / a.peak_tflops, "loss": float(loss),
         "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}
    print(json.dumps(r, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
