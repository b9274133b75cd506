"""Run on N ranks (by tests/python/test_comm.py through megacore.launch): Python-level collectives and
the process grid against numpy references. Prints 'rank R ok' on success; any mismatch raises."""

import sys

import numpy as np

import megacore as mc

device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
world = mc.comm.init_from_env(device, timeout_s=60)
if device != "cpu":  # each rank's tensors live on the GPU its communicator uses
    device = f"cuda:{mc.comm.detect_launch_env()['local_rank'] % mc.cuda_device_count()}"
r, n = world.rank, world.size
env = mc.comm.detect_launch_env()
assert env["rank"] == r and env["world_size"] == n, env


def inp(rank, count, salt):
    return np.random.default_rng(1000 * salt + rank).standard_normal(count).astype(np.float32)


def on(a):
    t = mc.from_numpy(np.ascontiguousarray(a)).clone()
    return t if device == "cpu" else t.to(device)


def host(t):
    return np.asarray(t.to("cpu")) if device != "cpu" else np.asarray(t)


count = 1001  # not divisible by the world size
t = on(inp(r, count, 1))
world.all_reduce(t, "sum")
np.testing.assert_allclose(host(t), sum(inp(q, count, 1) for q in range(n)), rtol=1e-5, atol=1e-5)
t = on(inp(r, count, 2))
world.all_reduce(t, "max")
np.testing.assert_array_equal(host(t), np.max([inp(q, count, 2) for q in range(n)], axis=0))
out = on(np.zeros(n * count, np.float32))
world.all_gather(on(inp(r, count, 3)), out)
np.testing.assert_array_equal(host(out), np.concatenate([inp(q, count, 3) for q in range(n)]))
rs = on(np.zeros(count, np.float32))
world.reduce_scatter(on(inp(r, n * count, 4)), rs, "avg")
ref = np.mean([inp(q, n * count, 4) for q in range(n)], axis=0)[r * count:(r + 1) * count]
np.testing.assert_allclose(host(rs), ref, rtol=1e-5, atol=1e-6)
b = on(inp(r, count, 5))
world.broadcast(b, root=n - 1)
np.testing.assert_array_equal(host(b), inp(n - 1, count, 5))
# uneven all-to-all: rank r sends (p + r + 1) elements to rank p
send = [p + r + 1 for p in range(n)]
recv = [r + p + 1 for p in range(n)]
src = np.arange(sum(send), dtype=np.float32) + 1000 * r
dst = on(np.zeros(sum(recv), np.float32))
world.all_to_all(on(src), dst, send, recv)
expect = []
for p in range(n):
    s_p = [q + p + 1 for q in range(n)]
    off = sum(s_p[:r])
    expect.append(np.arange(sum(s_p), dtype=np.float32)[off:off + s_p[r]] + 1000 * p)
np.testing.assert_array_equal(host(dst), np.concatenate(expect))
# ring exchange with batched send/recv, asynchronous
nxt, prv = (r + 1) % n, (r - 1) % n
got = on(np.zeros(7, np.float32))
w = world.batch_send_recv([("send", on(np.full(7, r, np.float32)), nxt), ("recv", got, prv)], async_op=True)
w.wait()
assert (host(got) == prv).all()
# stream-ordered wait: the consumer stream (the current one) is ordered after the all-reduce (on MPI the host
# completes it), then a host read on that stream sees the result
y = on(np.full(5, r + 1, np.float32))
w = world.all_reduce(y, async_op=True)
w.wait_on(mc.current_stream(y.device))
assert (host(y) == n * (n + 1) / 2).all()
mc.comm.check_health()  # nothing was aborted
world.barrier()

# process grid: a TP all-reduce sums exactly the TP group's ranks
if n % 2 == 0:
    cfg = mc.parallel.ParallelConfig(tensor=2, pipeline=2 if n % 4 == 0 else 1)
    grid = mc.parallel.ProcessGrid(world, cfg)
    members = grid.layout.group_of("tp", r)
    x = on(np.full(3, r + 1, np.float32))
    grid.tp.all_reduce(x)
    assert (host(x) == sum(m + 1 for m in members)).all()
    assert grid.tp.world_ranks == members and grid.tp.name == "tp"
print(f"rank {r} ok", flush=True)
