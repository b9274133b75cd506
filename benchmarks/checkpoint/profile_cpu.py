"""Where megacore's checkpoint save and load spend their time, on the CPU, without torch.

Same state as bench_checkpoint.py (a preset's bf16 parameters + f32 master weights and AdamW moments; bf16
travels as 2-byte float16 here, numpy having no bfloat16: same bytes to write), as host numpy arrays that
megacore shares without copying. Rows, best of --repeats, GB/s = bytes / time (1 GB = 1e9 bytes):

  plain_write        one Python thread writing every array into one file (page cache): what torch.save
                     reduces to without its pickling and zip framing — an upper bound on torch.save
  plain_write_fsync  the same, then fsync (durable)
  mc_save            megacore save_checkpoint (writer threads, CRC-32C of the written memory, fsync, rename)
  mc_save_verify     the same with verify=True (re-reads the files and checks every CRC)
  mc_async_block     an async save's blocking time (the snapshot), mc_async_total until it is committed
  plain_read         one Python thread reading the file into preallocated arrays (readinto)
  mc_load            megacore load (pread into the arrays, CRC-32C checked), mc_load_noverify without CRC
  crc32c / crc32     checksum throughput of one thread on 256 MiB in memory (CRC-32C: SSE4.2 where present;
                     megacore's CRC-32 of format 1 and zlib's for comparison)

Loads run after posix_fadvise(DONTNEED) of the files unless --warm (on a VM whose disk cache sits in the
host, "cold" reads may still come from the host's memory).

  PYTHONPATH=build/python python3 benchmarks/checkpoint/profile_cpu.py --preset llama32_1b --layers 2 --vocab 32000
"""

import argparse
import os
import shutil
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_checkpoint import evict, files_under, report, shapes_for  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama32_1b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dir", default="/tmp/mc_ckpt_profile")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import megacore as mc
    from megacore import checkpoint as ck
    from megacore import model

    world = mc.comm.init_from_env("cpu")
    cfg = getattr(model, args.preset)()
    cfg.num_layers = args.layers
    cfg.vocab_size = args.vocab
    rng = np.random.default_rng(0)
    arrays = {}
    for name, shape in shapes_for(cfg).items():
        arrays[name] = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
        for suffix in (".master", ".exp_avg", ".exp_avg_sq"):
            arrays["optimizer." + name + suffix] = rng.standard_normal(shape, dtype=np.float32)
    total = sum(a.nbytes for a in arrays.values())
    tensors = [(k, mc.from_numpy(a), list(a.shape), [0] * a.ndim) for k, a in arrays.items()]
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    plain = os.path.join(args.dir, "plain.bin")

    def plain_write(fsync):
        with open(plain, "wb") as f:
            for a in arrays.values():
                f.write(memoryview(a).cast("B"))
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    def plain_read(dst):
        with open(plain, "rb", buffering=0) as f:
            for a in dst.values():
                f.readinto(memoryview(a).cast("B"))

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    res = {k: [] for k in ("plain_write", "plain_write_fsync", "mc_save", "mc_save_verify", "mc_async_block",
                           "mc_async_total", "plain_read", "mc_load", "mc_load_noverify")}
    # Older builds (format 1) lack the async saver's binding and crc32c: their rows are left out.
    saver = ck.async_saver(world, threads=args.threads) if hasattr(ck, "async_saver") else None
    for rep in range(args.repeats):
        res["plain_write"].append(timed(lambda: plain_write(False)))
        res["plain_write_fsync"].append(timed(lambda: plain_write(True)))
        root = os.path.join(args.dir, "mc")
        res["mc_save"].append(timed(lambda: ck.save(world, root, rep, tensors, threads=args.threads)))
        res["mc_save_verify"].append(
            timed(lambda: ck.save(world, os.path.join(args.dir, "mcv"), rep, tensors, verify=True,
                                  threads=args.threads)))
        if saver is not None:
            t0 = time.perf_counter()
            saver.save(os.path.join(args.dir, "mca"), rep, tensors)
            res["mc_async_block"].append(time.perf_counter() - t0)
            saver.wait()
            res["mc_async_total"].append(time.perf_counter() - t0)
        dst = {k: np.empty_like(a) for k, a in arrays.items()}
        if not args.warm:
            evict([plain])
        res["plain_read"].append(timed(lambda: plain_read(dst)))
        mc_files = files_under(os.path.join(root, f"step_{rep}"))
        targets = [(k, mc.from_numpy(dst[k]), list(a.shape), [0] * a.ndim) for k, a in arrays.items()]
        for verify, key in ((True, "mc_load"), (False, "mc_load_noverify")):
            for a in dst.values():
                a.fill(0)
            if not args.warm:
                evict(mc_files)
            res[key].append(timed(lambda: ck.load(world, root, targets, verify=verify, threads=args.threads)))
            if rep == 0:
                for k, a in arrays.items():
                    assert np.array_equal(dst[k].view(np.uint8), a.view(np.uint8)), k
        del dst, targets
    sample = rng.integers(0, 255, 256 << 20, dtype=np.uint8)
    raw = sample.tobytes()
    crc = {"crc32_megacore": timed(lambda: ck._need_c().crc32(raw)), "crc32_zlib": timed(lambda: zlib.crc32(raw))}
    if hasattr(ck._need_c(), "crc32c"):
        crc["crc32c_megacore"] = timed(lambda: ck._need_c().crc32c(sample))
    res = {k: v for k, v in res.items() if v}
    best = {k: min(v) for k, v in res.items()}
    out = {"benchmark": "checkpoint CPU profile", "preset": args.preset, "layers": args.layers, "vocab": args.vocab,
           "total_bytes": total, "cpus": os.cpu_count(), "cache_evicted": not args.warm, "seconds": res,
           "best_GBps": {k: total / 1e9 / v for k, v in best.items()},
           "checksum_GBps_one_thread": {k: sample.nbytes / 1e9 / v for k, v in crc.items()}}
    report(out, args.out, args.dir)


if __name__ == "__main__":
    main()
