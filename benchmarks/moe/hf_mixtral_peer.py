"""Peer for bench_moe_e2e.py: Hugging Face MixtralForCausalLM of a given shape trained on one GPU (bf16 weights,
SDPA attention, fused AdamW, router aux loss on), random tokens, micro-batch × seq per step. Prints one JSON object
(and writes it with --out): tokens/s, ms per step and peak allocated memory; with --compile the model goes through
torch.compile first (its compile time is reported apart and not timed).

    python benchmarks/moe/hf_mixtral_peer.py --hidden 2048 --layers 16 --ffn 4096 --out peer.json [--compile]
"""

import argparse
import json
import time

import torch
import transformers
from transformers import MixtralConfig, MixtralForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=4096, help="each expert's FFN width")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()

    cfg = MixtralConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, num_local_experts=a.experts,
                        num_experts_per_tok=a.topk, max_position_embeddings=max(4096, a.seq), rope_theta=1e6,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, output_router_logits=True,
                        router_aux_loss_coef=0.01, attn_implementation="sdpa")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):  # built in place: a 3.5 B model initialised on the host takes minutes
        model = MixtralForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.micro_batch, a.seq), generator=g).cuda()
    labels = torch.randint(0, a.vocab, (a.micro_batch, a.seq), generator=g).cuda()
    fwd = torch.compile(model) if a.compile else model

    def step():
        loss = fwd(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(a.warmup - 1):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        loss = step()
    torch.cuda.synchronize()
    sec = (time.perf_counter() - t0) / a.iters
    tokens = a.micro_batch * a.seq
    r = {"peer": "transformers MixtralForCausalLM (sdpa, bf16, fused AdamW" + (", torch.compile)" if a.compile else ", eager)"),
         "torch": torch.__version__, "transformers": transformers.__version__, "card": torch.cuda.get_device_name(0),
         "gpus": 1, "micro_batch": a.micro_batch, "seq": a.seq, "parameters": sum(p.numel() for p in model.parameters()),
         "first_step_s": first_s, "ms_per_step": sec * 1e3, "tokens_per_s": tokens / sec, "loss": float(loss),
         "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}
    text = json.dumps(r, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
