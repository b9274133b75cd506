"""torch peers for the memory-bound kernels of megacore_bench_kernels.

Times torch eager and torch.compile versions of the same ops at the same shapes, on the same card,
and writes JSON rows {op, shape, eager_ms, compile_ms} keyed exactly like the C++ benchmark rows, so
`megacore_bench_kernels --peers FILE` can fold them into its table.

    python benchmarks/kernels/torch_peers.py --out peers.json [--quick] [--no-compile]
"""
import argparse
import json
import math
import sys
import time

import torch


def bench(fn, warmup=3, samples=20):
    """Median milliseconds of one fn() call, timed with CUDA events after warm-up. Each sample is a burst
    of back-to-back calls (as many, 1 to 10, as make about 2 ms, from one call timed alone) divided by
    their number: megacore_bench_kernels' time_ms does the same for megacore's ops."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    one = a.elapsed_time(b)
    iters = max(1, min(10, int(2.0 / one))) if one > 0 else 10
    times = []
    for _ in range(samples):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    times.sort()
    return times[len(times) // 2]


def rmsnorm(x, w, eps=1e-5):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rmsnorm_bwd(dy, x, w, rstd):
    # the explicit backward, as a fused kernel would compute it (dx and dw)
    xf, g = x.float(), dy.float() * w.float()
    xh = xf * rstd[:, None]
    dx = rstd[:, None] * (g - xh * (g * xh).mean(-1, keepdim=True))
    dw = (dy.float() * xh).sum(0)
    return dx.to(x.dtype), dw


def layernorm(x, w, b):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def layernorm_bwd(dy, x, w, mean, rstd):
    # the explicit backward from the saved mean / rstd (dx, dw and db), as a fused kernel computes it
    xh = (x.float() - mean[:, None]) * rstd[:, None]
    g = dy.float() * w.float()
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dy.float() * xh).sum(0), dy.float().sum(0)


def swiglu(x):
    a, b = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(a) * b


def swiglu_bwd(dy, x):
    a, b = x.float().chunk(2, dim=-1)
    s = torch.sigmoid(a)
    g = dy.float()
    return torch.cat([g * b * s * (1 + a * (1 - s)), g * a * s], dim=-1).to(x.dtype)


def gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def rope(x, cos, sin):
    # rotate-half (HF Llama); cos/sin [T, 1, D]
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


def rope_bwd(dy, cos, sin):
    # the transposed rotation: rot(x) = [-x2, x1], so rot^T(y) = [y2, -y1]
    h = dy.shape[-1] // 2
    ys = dy.float() * sin
    return (dy.float() * cos + torch.cat([ys[..., h:], -ys[..., :h]], dim=-1)).to(dy.dtype)


def gelu_tanh_bwd(dy, x):
    return torch.ops.aten.gelu_backward(dy, x, approximate="tanh")


def embedding_bwd(dw, ids, dy):
    # the f32 weight gradient accumulated from the token gradients
    return dw.index_add_(0, ids, dy.float())


def ce_fwd_bwd(z, labels):
    # loss and the gradient of the mean loss, as a fused kernel returns them
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1)
    loss = lse - zf.gather(1, labels[:, None]).squeeze(1)
    g = torch.softmax(zf, dim=-1)
    g.scatter_add_(1, labels[:, None], -torch.ones_like(labels[:, None], dtype=g.dtype))
    return loss, (g / z.shape[0]).to(z.dtype)


def dropout(x):
    return torch.nn.functional.dropout(x, 0.1, training=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated op-name prefixes to measure (all when empty)")
    args = ap.parse_args()
    dev = "cuda"
    bf = torch.bfloat16
    samples = 5 if args.quick else 20
    rows = []

    only = [p for p in args.only.split(",") if p]

    def add(op, shape, eager_fn, compile_fn=None):
        if only and not any(op.startswith(p) for p in only):
            return
        t0 = time.time()
        row = {"op": op, "shape": shape}
        try:
            row["eager_ms"] = bench(eager_fn, samples=samples)
            if compile_fn is not None and not args.no_compile:
                row["compile_ms"] = bench(compile_fn, samples=samples)
        except Exception as e:  # a failed peer is reported, not fatal
            row["error"] = repr(e)
        rows.append(row)
        print(f"  {op:24s} {shape:30s} eager {row.get('eager_ms', float('nan')):8.4f} ms  "
              f"compile {row.get('compile_ms', float('nan')):8.4f} ms  ({time.time() - t0:.0f} s)", flush=True)
        torch.cuda.empty_cache()

    C = (lambda f: f) if args.no_compile else torch.compile

    norm_shapes = [(16384, 4096)] if args.quick else [(16384, 4096), (16384, 8192), (32768, 2048)]
    c_rms, c_rms_bwd, c_ln, c_ln_bwd = C(rmsnorm), C(rmsnorm_bwd), C(layernorm), C(layernorm_bwd)
    for n, h in norm_shapes:
        shape = f"{n}x{h}"
        x = torch.randn(n, h, device=dev, dtype=bf)
        dy = torch.randn_like(x)
        w = torch.randn(h, device=dev, dtype=bf) * 0.1
        b = torch.randn(h, device=dev, dtype=bf) * 0.1
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-5)
        mean = x.float().mean(-1)
        lrstd = torch.rsqrt(x.float().var(-1, unbiased=False) + 1e-5)
        add("rmsnorm_fwd", shape, lambda: rmsnorm(x, w), lambda: c_rms(x, w))
        add("rmsnorm_bwd", shape, lambda: rmsnorm_bwd(dy, x, w, rstd), lambda: c_rms_bwd(dy, x, w, rstd))
        add("layernorm_fwd", shape, lambda: layernorm(x, w, b), lambda: c_ln(x, w, b))
        add("layernorm_bwd", shape, lambda: layernorm_bwd(dy, x, w, mean, lrstd),
            lambda: c_ln_bwd(dy, x, w, mean, lrstd))
        del x, dy

    t, heads, hd = 16384, 32, 128
    x = torch.randn(t, heads, hd, device=dev, dtype=bf)
    pos = (torch.arange(t, device=dev) % 4096).float()
    inv = 1.0 / (500000 ** (torch.arange(0, hd, 2, device=dev).float() / hd))
    ang = torch.outer(pos, inv)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    c_rope = C(rope)
    add("rope_fwd", f"{t}x{heads}x{hd}", lambda: rope(x, cos, sin), lambda: c_rope(x, cos, sin))
    c_rope_bwd = C(rope_bwd)
    add("rope_bwd", f"{t}x{heads}x{hd}", lambda: rope_bwd(x, cos, sin), lambda: c_rope_bwd(x, cos, sin))
    del x

    n, f = 16384, (8192 if args.quick else 14336)
    x = torch.randn(n, 2 * f, device=dev, dtype=bf)
    dy = torch.randn(n, f, device=dev, dtype=bf)
    c_sw, c_swb = C(swiglu), C(swiglu_bwd)
    add("swiglu_fwd", f"{n}x{f}", lambda: swiglu(x), lambda: c_sw(x))
    add("swiglu_bwd", f"{n}x{f}", lambda: swiglu_bwd(dy, x), lambda: c_swb(dy, x))
    del x, dy
    x = torch.randn(n, f, device=dev, dtype=bf)
    c_gelu = C(gelu_tanh)
    add("gelu_tanh_fwd", f"{n}x{f}", lambda: gelu_tanh(x), lambda: c_gelu(x))
    dy = torch.randn_like(x)
    c_gelu_bwd = C(gelu_tanh_bwd)
    add("gelu_tanh_bwd", f"{n}x{f}", lambda: gelu_tanh_bwd(dy, x), lambda: c_gelu_bwd(dy, x))
    del x, dy

    ce_shapes = [(8192, 32000)] if args.quick else [(8192, 32000), (8192, 128256)]
    c_ce = C(ce_fwd_bwd)
    for n, v in ce_shapes:
        z = torch.randn(n, v, device=dev, dtype=bf) * 2
        labels = (torch.arange(n, device=dev) * 7919) % v
        add("cross_entropy_fwd_bwd", f"{n}x{v}", lambda: ce_fwd_bwd(z, labels), lambda: c_ce(z, labels))
        del z

    # AdamW: torch's fused kernel (f32 params; torch has no bf16 copy-out in the same pass).
    sizes = []
    for _ in range(8 if args.quick else 48):
        sizes += [16 << 20, 8 << 20]
    total = sum(sizes)
    shape = f"{len(sizes)}tensors_{total}el"
    params = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    add("adamw", shape, lambda: opt.step())
    grads = [p.grad for p in params]
    add("l2norm", shape, lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
    outs = [torch.empty(s, device=dev, dtype=bf) for s in sizes]
    add("cast_f32_bf16", shape, lambda: torch._foreach_copy_(outs, [p.data for p in params]))
    del params, grads, outs, opt

    n, vocab, h = 16384, 128256, 4096
    w = torch.randn(vocab, h, device=dev, dtype=bf) * 0.02
    ids = (torch.arange(n, device=dev) * 104729) % vocab
    add("embedding_fwd", f"{n}x{h}_v{vocab}", lambda: torch.nn.functional.embedding(ids, w))
    del w
    dy = torch.randn(n, h, device=dev, dtype=bf)
    dw = torch.zeros(vocab, h, device=dev)
    c_emb_bwd = C(embedding_bwd)
    add("embedding_bwd", f"{n}x{h}_v{vocab}", lambda: embedding_bwd(dw, ids, dy), lambda: c_emb_bwd(dw, ids, dy))
    del dy, dw
    x = torch.randn(16384, 8192, device=dev, dtype=bf)
    c_drop = C(dropout)
    add("dropout_fwd", "16384x8192", lambda: dropout(x), lambda: c_drop(x))

    doc = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": rows}
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
