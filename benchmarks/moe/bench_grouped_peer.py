"""megacore's grouped expert GEMMs against torch._grouped_mm (the grouped GEMM torchtitan's MoE experts call) and
a dense torch.mm of the same FLOPs, on the shapes and routing splits of a megacore_bench_moe JSON, in one process
on one GPU, timed call by call in turn.

    python benchmarks/moe/bench_grouped_peer.py --out-dir benchmarks/results
    python benchmarks/moe/bench_grouped_peer.py --shapes-from benchmarks/results/moe_gemm_sm90_NVIDIA_H200.json \
        --models fine-128e --samples 10

Each row of the shapes file (model, op, group sizes, M x K) becomes one problem on fresh random bf16 tensors:
  fwd    y = x_g w_g^T       megacore.ops.grouped_gemm_forward  | torch._grouped_mm(x, w.transpose(-2, -1), offs)
  dgrad  dx = dy_g w_g       megacore.ops.grouped_gemm_dgrad    | torch._grouped_mm(dy, w, offs)
  wgrad  dw_g += dy_g^T x_g  megacore.ops.grouped_gemm_wgrad    | torch._grouped_mm(dy.t(), x, offs) (bf16) and, as
         into the f32 main grad (beta = 1)                        'peer_accum', the same plus main_grad.add_(it)
The dense reference is one torch.mm over all rows with the first expert's weight (bf16 out). Every path runs
`reps` back-to-back calls (at least 2, enough to span --min-ms) between two CUDA events, the paths in turn,
`--samples` times; the medians are reported. Within a window the host enqueues the next call while the GPU runs
the last, so only the first call's launch is timed (spread over the window), and the GPU stays under load as in a
training step (as megacore_bench_moe times its paths). `reps` in the JSON lists megacore, dense, peer and (wgrad)
peer + add in that order. megacore runs on torch's current stream through
megacore.Stream.from_handle, on its default path (auto: the Hopper kernel where it can run). The first call of
each path is checked against the others (relative Frobenius error < 2e-2 against megacore's result).
"""

import argparse
import json
import os
import sys
import time

import numpy as np

try:
    import torch
except ImportError as e:  # the peer is torch's kernel
    raise SystemExit(f"this benchmark needs torch 2.8 or newer with CUDA (the peer is torch._grouped_mm): {e}")

import megacore as mc
from out_dir import check_out_dir


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--shapes-from", default=os.path.join(here, "..", "results", "moe_gemm_sm90_NVIDIA_H200.json"),
                    help="a megacore_bench_moe JSON whose rows give the problems (default: the committed H200 run)")
    ap.add_argument("--models", default="all", help="comma-separated model names of the shapes file, or all")
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--min-ms", type=float, default=2.0, help="back-to-back calls per timed sample span this")
    ap.add_argument("--out-dir", help="writes moe_gemm_torch_peer_<card>.json there")
    a = ap.parse_args()
    if a.samples < 1:
        ap.error("--samples must be at least 1")
    if not a.min_ms > 0:
        ap.error("--min-ms must be a positive number of milliseconds")
    if not os.path.isfile(a.shapes_from):
        ap.error(f"--shapes-from {a.shapes_from} is not a file; pass a megacore_bench_moe JSON "
                 "(benchmarks/results/moe_gemm_sm90_<card>.json)")
    if a.out_dir:  # made (or refused) now, not after the runs
        check_out_dir(ap, a.out_dir)
    return a


def load_rows(path, models):
    with open(path) as f:
        d = json.load(f)
    rows = d.get("rows")
    need = ("model", "op", "group_sizes", "shape_MxK", "flops", "tokens", "split")
    if not isinstance(rows, list) or not rows or any(not all(k in r for k in need) for r in rows):
        raise SystemExit(f"{path} has no megacore_bench_moe rows (each with {', '.join(need)}); pass such a JSON")
    bad = sorted({r["op"] for r in rows if r["op"].rsplit("_", 1)[-1] not in ("fwd", "dgrad", "wgrad")})
    if bad:
        raise SystemExit(f"{path} has ops {', '.join(bad)}; this benchmark knows *_fwd, *_dgrad and *_wgrad")
    if models != "all":
        keep = set(models.split(","))
        unknown = keep - {r["model"] for r in rows}
        if unknown:
            raise SystemExit(f"--models {','.join(sorted(unknown))} not in {path}; it has "
                             f"{', '.join(sorted({r['model'] for r in rows}))}")
        rows = [r for r in rows if r["model"] in keep]
    return d, rows


def timed(fns, samples, min_ms):
    """Median ms per call of each fn: back-to-back reps between events, the fns in turn, `samples` rounds."""
    stream = torch.cuda.current_stream()
    reps = []
    for fn in fns:  # warm-up, and a rough time to pick reps
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        per = (time.perf_counter() - t0) / 3 * 1e3
        reps.append(max(2, min(200, int(np.ceil(min_ms / max(per, 1e-3))))))
    ms = [[] for _ in fns]
    for _ in range(samples):
        for i, fn in enumerate(fns):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            for _ in range(reps[i]):
                fn()
            b.record(stream)
            b.synchronize()
            ms[i].append(a.elapsed_time(b) / reps[i])
    return [float(np.median(v)) for v in ms], reps


def rel(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def problem(r, gen):
    """One row's tensors and callables: megacore, the peer, dense and (wgrad) the peer plus its add into the main
    grad; `out` is megacore's result."""
    sizes = [int(s) for s in r["group_sizes"]]
    e, n = len(sizes), sum(sizes)
    m, k = (int(v) for v in r["shape_MxK"].split("x"))  # w_g is [M, K]
    offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
    bf = dict(device="cuda", dtype=torch.bfloat16)

    def randn(*shape):
        return (torch.randn(*shape, generator=gen, **bf) * 0.5)

    op = r["op"].rsplit("_", 1)[1]  # fwd, dgrad or wgrad (load_rows refuses others)
    if op in ("fwd", "dgrad"):
        w = randn(e, m, k)
        if op == "fwd":
            a, out = randn(n, k), torch.empty(n, m, **bf)
            b_peer = w.transpose(-2, -1)
            mc_fn = lambda: mc.ops.grouped_gemm_forward(a_mc, w_mc, sizes, out_mc)  # noqa: E731
            dense_fn = lambda: torch.mm(a, w[0].t())  # noqa: E731
        else:
            a, out = randn(n, m), torch.empty(n, k, **bf)
            b_peer = w
            mc_fn = lambda: mc.ops.grouped_gemm_dgrad(a_mc, w_mc, sizes, out_mc)  # noqa: E731
            dense_fn = lambda: torch.mm(a, w[0])  # noqa: E731
        a_mc, w_mc, out_mc = mc.from_dlpack(a), mc.from_dlpack(w), mc.from_dlpack(out)
        peer_fn = lambda: torch._grouped_mm(a, b_peer, offs=offs)  # noqa: E731
        return dict(mc=mc_fn, peer=peer_fn, dense=dense_fn, out=out, accum=None)
    dy, x = randn(n, m), randn(n, k)
    main = torch.zeros(e, m, k, device="cuda", dtype=torch.float32)
    dy_mc, x_mc, main_mc = mc.from_dlpack(dy), mc.from_dlpack(x), mc.from_dlpack(main)
    dyt = dy.t()
    mc_fn = lambda: mc.ops.grouped_gemm_wgrad(dy_mc, x_mc, sizes, main_mc)  # noqa: E731
    peer_fn = lambda: torch._grouped_mm(dyt, x, offs=offs)  # noqa: E731
    peer_main = torch.zeros_like(main)
    accum_fn = lambda: peer_main.add_(torch._grouped_mm(dyt, x, offs=offs))  # noqa: E731
    dense_fn = lambda: torch.mm(dyt, x)  # noqa: E731
    return dict(mc=mc_fn, peer=peer_fn, dense=dense_fn, out=main, accum=accum_fn)


def main():
    a = parse()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark runs on a GPU")
    if not hasattr(torch, "_grouped_mm"):
        raise SystemExit(f"torch {torch.__version__} has no torch._grouped_mm (the peer); use torch 2.8 or newer")
    card = torch.cuda.get_device_name(0)
    src, rows = load_rows(a.shapes_from, a.models)
    stream = mc.Stream.from_handle("cuda:0", torch.cuda.current_stream().cuda_stream)
    seed = int(np.random.default_rng().integers(1 << 30))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    print(f"card: {card}; torch {torch.__version__}; megacore grouped-GEMM path: {mc.ops.grouped_gemm_path()}"
          f" (sm90 kernel available: {mc.ops.grouped_gemm_sm90_available('cuda:0')})")
    print(f"{'model':12} {'tokens':>6} {'split':10} {'op':10} {'megacore':>9} {'peer':>9} {'peer+acc':>9} "
          f"{'dense':>9} {'peer/mc':>8} {'dense/mc':>8}  (ms; peer = torch._grouped_mm)")
    out_rows = []
    with mc.stream(stream):
        for r in rows:
            p = problem(r, gen)
            launches = mc.ops.grouped_gemm_sm90_launches()
            p["mc"]()
            torch.cuda.synchronize()
            on_sm90 = mc.ops.grouped_gemm_sm90_launches() > launches
            # megacore's result against the peer's before anything is timed
            peer_error, err = None, None
            try:
                ref = p["accum"]() if p["accum"] else p["peer"]()
            except RuntimeError as e:  # a layout or alignment the peer refuses: time megacore and dense only
                if "CUDA" in str(e) or "cuda" in str(e):
                    raise  # a fault on the device, not a refusal: the context is gone
                peer_error = str(e).splitlines()[0][:300]
            if peer_error is None:
                torch.cuda.synchronize()
                err = rel(p["out"], ref)
            if err is not None and not err < 2e-2:
                raise SystemExit(f"{r['model']} {r['op']} {r['split']}: megacore and torch._grouped_mm differ by "
                                 f"{err:.3g} (relative); not timing a wrong result")
            fns = [p["mc"], p["dense"]]
            if peer_error is None:
                fns += [p["peer"]] + ([p["accum"]] if p["accum"] else [])
            ms, reps = timed(fns, a.samples, a.min_ms)
            mc_ms, dense_ms = ms[:2]
            peer_ms = ms[2] if peer_error is None else None
            acc_ms = ms[3] if peer_error is None and p["accum"] else None
            peer_best = acc_ms if acc_ms is not None else peer_ms
            ratio = peer_best / mc_ms if peer_best is not None else None
            row = dict(model=r["model"], experts=r["experts"], tokens=r["tokens"], split=r["split"], op=r["op"],
                       shape_MxK=r["shape_MxK"], rows=r["rows"], rows_per_expert_mean=r["rows_per_expert_mean"],
                       flops=r["flops"], megacore_ms=mc_ms, megacore_on_sm90=on_sm90, peer_ms=peer_ms,
                       peer_accum_ms=acc_ms, dense_ms=dense_ms, peer_vs_megacore=ratio,
                       megacore_tflops=r["flops"] / mc_ms / 1e9,
                       peer_tflops=r["flops"] / peer_best / 1e9 if peer_best else None,
                       dense_tflops=r["flops"] / dense_ms / 1e9, megacore_vs_dense=dense_ms / mc_ms,
                       rel_err_vs_peer=err, peer_error=peer_error, reps=reps, card=card)
            out_rows.append(row)
            nan = float("nan")
            print(f"{r['model']:12} {r['tokens']:6} {r['split']:10} {r['op']:10} {mc_ms:9.3f} "
                  f"{peer_ms if peer_ms is not None else nan:9.3f} {acc_ms if acc_ms is not None else nan:9.3f} "
                  f"{dense_ms:9.3f} {ratio if ratio is not None else nan:8.2f} {dense_ms / mc_ms:8.2f}"
                  + (f"  peer refused: {peer_error}" if peer_error else ""), flush=True)
            del p
    timed_rows = [x for x in out_rows if x["peer_vs_megacore"] is not None]
    ratios = np.array([x["peer_vs_megacore"] for x in timed_rows])
    by_op = {}
    for x in timed_rows:
        by_op.setdefault(x["op"].rsplit("_", 1)[1], []).append(x["peer_vs_megacore"])
    geo = lambda v: float(np.exp(np.log(np.asarray(v)).mean()))  # noqa: E731
    summary = dict(rows=len(out_rows), rows_peer_refused=len(out_rows) - len(timed_rows),
                   peer_vs_megacore_geomean=geo(ratios) if len(ratios) else None,
                   peer_vs_megacore_min=float(ratios.min()) if len(ratios) else None,
                   peer_vs_megacore_max=float(ratios.max()) if len(ratios) else None,
                   megacore_slower_rows=int((ratios < 1.0).sum()),
                   megacore_slower_than_peer_bf16_product_alone=sum(
                       1 for x in timed_rows if x["peer_ms"] < x["megacore_ms"]),
                   by_op={k: dict(geomean=geo(v), min=float(min(v)), max=float(max(v))) for k, v in by_op.items()})
    print(json.dumps(summary, indent=1))
    if a.out_dir:
        path = os.path.join(a.out_dir, f"moe_gemm_torch_peer_{card.replace(' ', '_')}.json")
        doc = dict(benchmark="moe_gemm_torch_peer", card=card, date=time.strftime("%Y-%m-%d"),
                   command=" ".join([os.path.basename(sys.executable)] + sys.argv), torch=torch.__version__,
                   megacore=mc.build_info().get("version"), megacore_path=mc.ops.grouped_gemm_path(), seed=seed,
                   shapes_from=os.path.relpath(a.shapes_from), shapes_from_date=src.get("date"),
                   note="peer_vs_megacore = the peer's time over megacore's (above 1: megacore faster); for wgrad the "
                        "peer's time includes adding its bf16 result into the f32 main grad (peer_accum_ms), which "
                        "megacore's kernel does in its epilogue. Times are ms per call (median).",
                   summary=summary, rows=out_rows)
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
