"""Checkpoint save/load throughput: megacore's distributed checkpoint vs torch.save / torch.load of the
same state, in the same run, on the same file system.

State: a model's training state built from a megacore TransformerConfig preset (default llama32_1b,
1.24B parameters; llama3_8b for the 8B state): bf16 parameters plus f32 master weights, exp_avg and
exp_avg_sq (AdamW), 14 bytes per parameter (~17 GB for llama32_1b, ~112 GB for llama3_8b); --state params
keeps only the bf16 parameters; --layers N keeps N transformer layers of the preset (a smaller state for a
quick run: `--preset llama32_1b --layers 2` is ~4.3 GB, most of it the embedding and output layers).
Tensors live on --device (cuda: copied to host by both savers, as in training).

Savers: megacore (temp dir, several writer threads, CRC-32C of the memory being written, fsync, atomic
rename; --verify-save also re-reads the files), torch.save (returns with the bytes in the page cache)
and torch.save + fsync (durable, like megacore). Loaders: megacore with CRC verification (its default)
and without (--no-verify for both rows), torch.load.

--async also times megacore's async save (AsyncSaver), after reserving its snapshot buffers as the trainer
does at start ("mc_async_reserve", rank 0's time): "mc_async_block" is the time from the save call
to its return (the snapshot: device→page-locked host copies, or memcpy of host tensors: what a training
step waits for), "mc_async_total" the time until the background write is committed (wait()), next to
torch.save of the same bytes; "async_block_vs_torch_save" is their ratio (issue 24's target: <= 0.10).
--async-only times just those two (no synchronous save, no loads), one checkpoint on disk at a time, so the 8B
state (~112 GB) fits a disk that cannot hold two copies.

One process:   python benchmarks/checkpoint/bench_checkpoint.py --out results.json
N GPUs:        mpirun -np 4 python benchmarks/checkpoint/bench_checkpoint.py --out results.json
With N ranks, every tensor is split along dim 0 into N pieces (as TP/ZeRO would): rank r writes its piece
(megacore: one shard file per rank + metadata; torch: one torch.save file per rank). Time is the slowest
rank's, between barriers. GB/s = total bytes / time (1 GB = 1e9 bytes).

--load-threads 1,2,4,8 times the load once more per LoadOptions::threads value (the reader threads of each rank;
each with the cache dropped), with one more torch.load after them.

Loads are timed after dropping the files from the page cache with posix_fadvise(DONTNEED) (which works
for clean pages without root; whether the device's storage stack honours it is recorded as
"cache_evicted"); --warm skips that. megacore loads with CRC verification on (its default) and --no-verify
shows the cost. The JSON records the card name, world size, bytes and every timing.
"""

import argparse
import filecmp
import json
import os
import shutil
import time

import numpy as np


def shapes_for(cfg):
    h, f, L, V = cfg.hidden_size, cfg.ffn_size, cfg.num_layers, cfg.vocab_size
    qkv = (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim
    out = {"embedding.weight": (V, h), "final_layernorm.weight": (h,)}
    for i in range(L):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "self_attention.linear_qkv.weight": (qkv, h),
                    p + "self_attention.linear_proj.weight": (h, cfg.attention_width),
                    p + "pre_mlp_layernorm.weight": (h,), p + "mlp.linear_fc1.weight": (2 * f, h),
                    p + "mlp.linear_fc2.weight": (h, f)})
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = (V, h)
    return out


def evict(paths):
    ok = True
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except OSError:
            ok = False
    return ok


def files_under(d):
    return [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]


def report(out, path, scratch):
    """Prints the result, writes it to `path` (when given) and removes the scratch directory."""
    print(json.dumps(out, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    shutil.rmtree(scratch, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama32_1b")
    ap.add_argument("--state", choices=["full", "params"], default="full")
    ap.add_argument("--layers", type=int, default=0, help="keep this many transformer layers (0: the preset's)")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the preset's)")
    ap.add_argument("--verify-save", action="store_true", help="megacore's save also re-reads its files")
    ap.add_argument("--async", dest="async_save", action="store_true", help="also time megacore's async save")
    ap.add_argument("--async-only", action="store_true",
                    help="time only megacore's async save (blocking and total) and torch.save of the same tensors, "
                         "one checkpoint on disk at a time (the 8B state: ~112 GB)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default="/tmp/mc_ckpt_bench")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--load-threads", default="",
                    help="comma list: after the repeats, save once more and time megacore's load (CRC on) with each "
                         "LoadOptions::threads value (mc_load_t<N>), and torch.load again beside them")
    args = ap.parse_args()
    args.async_save |= args.async_only

    import torch

    import megacore as mc
    from megacore import checkpoint as ck
    from megacore import model

    world = mc.comm.init_from_env("cpu")  # MPI (or a singleton): the checkpoint's agreement collectives
    rank, n = world.rank, world.size
    dev = torch.device(args.device if args.device == "cpu" else f"cuda:{rank % max(1, torch.cuda.device_count())}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # DLPack export needs the tensor's device to be the current one
    cfg = getattr(model, args.preset)()
    if args.layers:
        cfg.num_layers = args.layers
    if args.vocab:
        cfg.vocab_size = args.vocab
    g = torch.Generator(device=dev).manual_seed(rank)
    state = {}  # name -> (local torch tensor, global shape, offsets)
    for name, shape in shapes_for(cfg).items():
        kinds = [("", torch.bfloat16)]
        if args.state == "full":
            kinds += [(".master", torch.float32), (".exp_avg", torch.float32), (".exp_avg_sq", torch.float32)]
        rows = shape[0]
        lo, hi = rows * rank // n, rows * (rank + 1) // n
        for suffix, dt in kinds:
            local = torch.empty((hi - lo,) + tuple(shape[1:]), dtype=dt, device=dev)
            local.normal_(generator=g)
            key = ("optimizer." + name + suffix) if suffix else name
            state[key] = (local, list(shape), [lo] + [0] * (len(shape) - 1))
    local_bytes = sum(t.numel() * t.element_size() for t, _, _ in state.values())
    total = np.array([local_bytes], dtype=np.int64)
    tot_t = mc.from_numpy(total)
    world.all_reduce(tot_t)
    total_bytes = int(np.asarray(tot_t.numpy())[0])

    def timed(fn):
        world.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        world.barrier()
        return time.perf_counter() - t0

    mc_root = os.path.join(args.dir, "megacore")
    torch_dir = os.path.join(args.dir, "torch")
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(torch_dir)
    world.barrier()
    mc_tensors = [(k, mc.from_dlpack(t), gs, off) for k, (t, gs, off) in state.items()]
    torch_state = {k: t for k, (t, _, _) in state.items()}
    torch_file = os.path.join(torch_dir, f"rank{rank}.pt")
    def torch_save_durable():
        # torch.save returns once the bytes are in the page cache; megacore's save returns once they are on
        # disk (fsync). This is the like-for-like figure: torch.save followed by an fsync of its file.
        torch.save(torch_state, torch_file)
        fd = os.open(torch_file, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    res = {"mc_save": [], "mc_load": [], "mc_load_noverify": [], "torch_save": [], "torch_save_fsync": [],
           "torch_load": []}
    if args.async_save:
        res.update({"mc_async_block": [], "mc_async_total": []})
        saver = ck.async_saver(world)
        async_root = os.path.join(args.dir, "megacore_async")
        # As the trainer does at start: allocate the snapshot buffers once, outside the timed saves.
        t0 = time.perf_counter()
        saver.reserve(mc_tensors)
        res["mc_async_reserve"] = [time.perf_counter() - t0]

    def async_save(step):
        world.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        saver.save(async_root, step, mc_tensors)
        block = time.perf_counter() - t0  # this rank's; the slowest rank's is reported below
        saver.wait()
        world.barrier()
        total = time.perf_counter() - t0
        b = mc.from_numpy(np.array([block], dtype=np.float32))
        world.all_reduce(b, "max")
        return float(np.asarray(b.numpy())[0]), total
    evicted = True
    if args.async_only:
        for rep in range(args.repeats):
            block, total = async_save(rep)
            world.barrier()
            if rank == 0:
                shutil.rmtree(os.path.join(async_root, f"step_{rep}"), ignore_errors=True)
            res["mc_async_block"].append(block)
            res["mc_async_total"].append(total)
            res["torch_save"].append(timed(lambda: torch.save(torch_state, torch_file)))
            os.remove(torch_file)
            world.barrier()
        res = {k: v for k, v in res.items() if v}
    for rep in range(0 if args.async_only else args.repeats):
        res["mc_save"].append(timed(lambda: ck.save(world, mc_root, rep, mc_tensors, verify=args.verify_save)))
        if args.async_save:
            block, total = async_save(rep)
            if rep == 0:  # the async save wrote exactly what the synchronous one did
                shard = f"step_0/shard_{rank:05d}.safetensors"
                assert filecmp.cmp(os.path.join(mc_root, shard), os.path.join(async_root, shard), shallow=False)
                world.barrier()
            if rank == 0:  # disk space: keep one checkpoint of each kind at a time (8B: ~112 GB each)
                shutil.rmtree(os.path.join(async_root, f"step_{rep}"), ignore_errors=True)
            res["mc_async_block"].append(block)
            res["mc_async_total"].append(total)
        res["torch_save"].append(timed(lambda: torch.save(torch_state, torch_file)))
        res["torch_save_fsync"].append(timed(torch_save_durable))
        mc_files = files_under(os.path.join(mc_root, f"step_{rep}"))
        if not args.warm:
            evicted &= evict(mc_files + [torch_file])
        dst = [(k, mc.from_dlpack(torch.empty_like(t)), gs, off) for k, (t, gs, off) in state.items()]
        res["mc_load"].append(timed(lambda: ck.load(world, mc_root, dst, verify=not args.no_verify)))
        if rep == 0:  # correctness of the round trip, once
            for (k, (t, _, _)), (_, d, _, _) in zip(state.items(), dst):
                assert torch.equal(torch.from_dlpack(d), t), k
        if not args.warm:
            evicted &= evict(mc_files)
        res["mc_load_noverify"].append(timed(lambda: ck.load(world, mc_root, dst, verify=False)))
        del dst
        world.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(mc_root, f"step_{rep}"), ignore_errors=True)
        res["torch_load"].append(timed(lambda: torch.load(torch_file, map_location=dev)))
    sweep = [int(t) for t in args.load_threads.split(",") if t and not args.async_only]
    if sweep:
        ck.save(world, mc_root, args.repeats, mc_tensors)
        mc_files = files_under(os.path.join(mc_root, f"step_{args.repeats}"))
        dst = [(k, mc.from_dlpack(torch.empty_like(t)), gs, off) for k, (t, gs, off) in state.items()]
        for t in sweep:
            if not args.warm:
                evicted &= evict(mc_files)
            res[f"mc_load_t{t}"] = [timed(lambda: ck.load(world, mc_root, dst, verify=not args.no_verify, threads=t))]
        del dst
        if not args.warm:
            evicted &= evict([torch_file])
        res["torch_load"].append(timed(lambda: torch.load(torch_file, map_location=dev)))
    if rank == 0:
        best = {k: min(v) for k, v in res.items()}
        out = {"benchmark": "checkpoint save/load", "preset": args.preset, "state": args.state,
               "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "layers": cfg.num_layers, "world_size": n, "total_bytes": total_bytes,
               "verify": not args.no_verify, "verify_save": args.verify_save,
               "cache_evicted": (not args.warm) and bool(evicted), "seconds": res,
               "best_GBps": {k: total_bytes / 1e9 / v for k, v in best.items() if k != "mc_async_reserve"}}
        if args.async_save:
            out["async_block_vs_torch_save"] = best["mc_async_block"] / best["torch_save"]
            if "torch_save_fsync" in best:
                out["async_block_vs_torch_save_fsync"] = best["mc_async_block"] / best["torch_save_fsync"]
        if args.async_only:
            out["mode"] = "async-only: megacore's async save and torch.save of the same tensors, nothing else"
            out["cache_evicted"] = None
        report(out, args.out, args.dir)


if __name__ == "__main__":
    main()
