"""A rank dies in the middle of a run; the others must raise CommError within the timeout and exit
non-zero (code 3), never hang. argv: device ('cpu' or 'cuda'), mode ('kill': SIGKILL itself; 'exit':
crash with exit code 9), timeout in seconds."""

import os
import signal
import sys
import time

import megacore as mc

device, mode, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
world = mc.comm.init_from_env(device, timeout_s=timeout)
t = mc.full((1 << 16,), 1.0, device="cpu" if device == "cpu" else f"cuda:{mc.comm.detect_launch_env()['local_rank'] % max(mc.cuda_device_count(), 1)}")
world.all_reduce(t)
if device != "cpu":
    mc.synchronize(t.device)
print(f"rank {world.rank} first all_reduce ok", flush=True)
if world.rank == 1:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(9)
t0 = time.monotonic()
try:
    for _ in range(5):
        world.all_reduce(t)
    if device != "cpu":
        mc.synchronize(t.device)
    print(f"rank {world.rank} NO ERROR", flush=True)
    sys.exit(0)
except mc.CommError as e:
    print(f"rank {world.rank} CommError after {time.monotonic() - t0:.1f} s: {e}", flush=True)
    sys.exit(3)
