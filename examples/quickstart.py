"""The main job until the trainer lands (issue 10 turns it into a tiny Llama pretrain with TP=2, PP=2):
four ranks in a TP=2 × PP=2 process grid (Megatron-Core's rank order), on GPUs when there are four,
else on CPU ranks through MPI. Each step is checked against a single-rank computation:

  1. a column-parallel projection: each TP rank owns a column slice of one weight drawn from the Philox
     generator (the same numbers on every rank and device), multiplies its slice, and the TP group
     all-gathers the pieces: the result equals the unsharded product;
  2. pipeline hand-off: stage 0 sends its activations to stage 1 with a batched send/recv;
  3. gradient averaging over the data-parallel × context-parallel group (here of size 1) and a global
     all-reduce over the world.

Run it with ``python -m megacore.launch --nproc-per-node 4 examples/quickstart.py`` (scripts/quickstart.sh).
"""

import numpy as np

import megacore as mc


def main():
    world = mc.comm.init_from_env("auto", timeout_s=120)
    r = world.rank
    gpu = mc.cuda_available() and world.backend == "nccl"
    env = mc.comm.detect_launch_env()
    device = f"cuda:{env['local_rank'] % mc.cuda_device_count()}" if gpu else "cpu"
    say = (lambda *a: print(*a, flush=True)) if r == 0 else (lambda *a: None)

    info = mc.build_info()
    say(f"megacore {mc.__version__} (cuda={info['cuda']} nccl={info['nccl']} mpi={info['mpi']}): "
        f"{world.size} ranks on {'GPUs: ' + mc.cuda_device_name(0) if gpu else 'CPU (MPI)'}")
    cfg = mc.parallel.ParallelConfig(tensor=2, pipeline=2)
    grid = mc.parallel.ProcessGrid(world, cfg)
    say(grid.layout.table())

    def on(a):
        t = mc.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).clone()
        return t.to(device) if gpu else t

    def host(t):
        return np.asarray(t.to("cpu")) if gpu else np.asarray(t)

    # 1. column-parallel projection over the TP group
    tokens, hidden, ffn = 64, 128, 256
    x = np.asarray(mc.empty((tokens, hidden)).normal_(mc.Generator(seed=1)))
    w = np.asarray(mc.empty((hidden, ffn)).normal_(mc.Generator(seed=2), std=0.02))  # the same on every rank
    tp, tpr = grid.tp, grid.tp_rank
    cols = ffn // tp.size
    part = x @ w[:, tpr * cols:(tpr + 1) * cols]
    gathered = on(np.zeros((tp.size, tokens, cols), np.float32))
    tp.all_gather(on(part), gathered)
    y = np.concatenate(list(host(gathered)), axis=1)
    err = np.abs(y - x @ w).max()
    assert err < 1e-4, err
    say(f"[1] column-parallel {tokens}x{hidden} @ {hidden}x{ffn} over TP={tp.size}: max |error| vs unsharded = {err:.2e}")

    # 2. stage 0 -> stage 1 activations over the PP group
    pp = grid.pp
    if pp.size > 1:
        if grid.pp_rank == 0:
            pp.batch_send_recv([("send", on(y), 1)])
        else:
            recv = on(np.zeros_like(y))
            pp.batch_send_recv([("recv", recv, 0)])
            assert np.array_equal(host(recv), y)
    say(f"[2] pipeline hand-off stage 0 -> stage 1 over PP={pp.size}: received activations match")

    # 3. gradient averaging and a world-wide reduction
    g = on(np.full(1000, r, np.float32))
    grid.dp_cp.all_reduce(g, "avg")
    members = grid.layout.group_of("dp_cp", r)
    assert np.allclose(host(g), np.mean(members))
    total = on(np.array([r + 1.0], np.float32))
    world.all_reduce(total)
    assert host(total)[0] == world.size * (world.size + 1) / 2
    say(f"[3] DP×CP average (group size {grid.dp_cp.size}) and world sum = {host(total)[0]:.0f} ok")
    say("quickstart ok")


if __name__ == "__main__":
    main()
