"""torch SDPA peer for megacore's attention benchmark (bench_attention.cpp).

Times torch.nn.functional.scaled_dot_product_attention (causal, bf16, d=128) forward and
forward+backward at the benchmark's shapes on this card, with torch's default backend choice and
with the flash and cuDNN backends forced, and writes JSON rows keyed by the same shape strings:

    python benchmarks/kernels/torch_attention_peer.py --out attn_peers.json [--quick]
    MC_TORCH_ATTN_PEERS=attn_peers.json megacore_bench_kernels --filter attention

Where the megacore Python package is importable (and CUDA is available), each row also gets
"same_process": megacore's attention (megacore.ops on the same torch tensors, cuDNN and flash backends)
and torch SDPA timed in this one process, interleaved round by round (A B C, then C B A, ...), each
sample a burst of calls between device synchronisations timed on the host clock, the median kept. Clock
and power drift between processes or rows then cancels, which a separate-process peer cannot promise.
"""
import argparse
import json
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch_peers import bench as _bench  # same folder: the scripts are run by path


def bench(fn, warmup=3, samples=15):
    """Median milliseconds of fn() (torch_peers.bench, with this benchmark's sample count)."""
    return _bench(fn, warmup, samples)


def _wall_ms(fn, iters):
    torch.cuda.synchronize()  # the whole device: megacore's stream and torch's
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


def interleaved(fns, rounds=9, burst_ms=40.0):
    """Median ms per call of each named fn, measured in alternating order round by round."""
    names = list(fns)
    iters = {}
    for n in names:  # warm-up (graph builds, autotuners) and burst sizing
        for _ in range(3):
            fns[n]()
        one = _wall_ms(fns[n], 1)
        iters[n] = max(2, min(50, int(burst_ms / max(one, 1e-3))))
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            times[n].append(_wall_ms(fns[n], iters[n]))
    return {n: sorted(t)[len(t) // 2] for n, t in times.items()}


def same_process(q, k, v, do, gqa, mc):
    """megacore.ops (cuDNN where built in, flash) against torch SDPA (default and cuDNN backends), fwd+bwd."""
    qs, ks, vs, dos = (x.detach().transpose(1, 2) for x in (q, k, v, do))  # the [B, S, H, D] storage
    b, s, h, d = qs.shape
    out = torch.empty_like(qs)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    dq, dk, dv = (torch.empty_like(x) for x in (qs, ks, vs))
    # megacore views of the same memory, made once so the timed calls carry no DLPack exchange
    qs, ks, vs, dos, out, lse, dq, dk, dv = (mc.from_dlpack(x) for x in (qs, ks, vs, dos, out, lse, dq, dk, dv))

    def ours(backend):
        def fb():
            mc.ops.attention_forward(qs, ks, vs, out, lse, causal=True, backend=backend)
            mc.ops.attention_backward(qs, ks, vs, out, lse, dos, dq, dk, dv, causal=True, backend=backend)
        return fb

    def theirs(backends):
        def run():
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            torch.autograd.grad(o, (q, k, v), do)

        if backends is None:
            return run

        def forced():
            with sdpa_kernel(backends):
                run()
        return forced

    fns = {"torch_default": theirs(None), "torch_cudnn": theirs([SDPBackend.CUDNN_ATTENTION]),
           "megacore_flash": ours("flash")}
    if mc.ops.attention_cudnn_available():
        fns["megacore_cudnn"] = ours("cudnn")
    res = interleaved(fns)
    return {k + "_fwdbwd_ms": v for k, v in res.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    cfgs = [(8, 2048, 16, 16), (4, 4096, 16, 16), (2, 8192, 16, 16), (1, 16384, 16, 16), (4, 4096, 32, 8)]
    if args.quick:
        cfgs = [(4, 4096, 16, 16)]
    d = 128
    try:
        import megacore as mc
        if not mc.cuda_available():
            mc = None
    except ImportError:
        mc = None
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
        if mc is not None:
            try:
                row["same_process"] = same_process(q, k, v, do, gqa, mc)
            except Exception as e:  # recorded, not fatal: the separate-process rows still stand
                row["same_process"] = {"error": str(e).splitlines()[0][:300]}
        rows.append(row)
        print(shape, json.dumps({k: v for k, v in row.items() if k != "shape"}))
    doc = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": rows}
    if mc is not None:
        doc["megacore_cudnn"] = mc.ops.attention_cudnn_available()
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
