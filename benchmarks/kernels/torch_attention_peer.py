"""torch SDPA peer for megacore's attention benchmark (bench_attention.cpp).

Times torch.nn.functional.scaled_dot_product_attention (causal, bf16, d=128) forward and
forward+backward at the benchmark's shapes on this card, with torch's default backend choice and
with the flash and cuDNN backends forced, and writes JSON rows keyed by the same shape strings:

    python benchmarks/kernels/torch_attention_peer.py --out attn_peers.json [--quick]
    MC_TORCH_ATTN_PEERS=attn_peers.json megacore_bench_kernels --filter attention
"""
import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch_peers import bench as _bench  # same folder: the scripts are run by path


def bench(fn, warmup=3, samples=15):
    """Median milliseconds of fn() (torch_peers.bench, with this benchmark's sample count)."""
    return _bench(fn, warmup, samples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    cfgs = [(8, 2048, 16, 16), (4, 4096, 16, 16), (2, 8192, 16, 16), (1, 16384, 16, 16), (4, 4096, 32, 8)]
    if args.quick:
        cfgs = [(4, 4096, 16, 16)]
    d = 128
    rows = []
    for b, s, h, hk in cfgs:
        shape = f"b{b}_s{s}_h{h}_kv{hk}_d128_causal"
        g = torch.Generator(device="cuda").manual_seed(0)
        # [B, S, H, D] storage viewed as [B, H, S, D], as megacore's layout
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        q.requires_grad_(True)
        k.requires_grad_(True)
        v.requires_grad_(True)
        gqa = h != hk
        row = {"shape": shape}
        for name, backends in (("default", None), ("flash", [SDPBackend.FLASH_ATTENTION]),
                               ("cudnn", [SDPBackend.CUDNN_ATTENTION])):
            def fwd():
                with torch.no_grad():
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

            def fb():
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                torch.autograd.grad(o, (q, k, v), do)

            try:
                if backends is None:
                    row[name] = {"fwd_ms": bench(fwd), "fwdbwd_ms": bench(fb)}
                else:
                    with sdpa_kernel(backends):
                        row[name] = {"fwd_ms": bench(fwd), "fwdbwd_ms": bench(fb)}
            except Exception as e:  # a backend that refuses the shape is recorded, not fatal
                row[name] = {"error": str(e).splitlines()[0][:200]}
        rows.append(row)
        print(shape, json.dumps({k: v for k, v in row.items() if k != "shape"}))
    doc = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": rows}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
